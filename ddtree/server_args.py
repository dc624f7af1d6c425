"""Server arguments: SGLang flag names, one frozen dataclass, resolved against config.json files only.

The dataclass is the single source of truth: argparse flags, defaults, choices and help are generated from its
fields. `resolve_server_args` fills derived defaults (logged the way SGLang logs them) and reports every problem
at once in one `ConfigError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import typing
from dataclasses import dataclass, field

from ddtree import envs
from ddtree.config_checks import check_pair, check_quantization, check_tp, load_model_config
from ddtree.configs import ConfigError, DrafterConfig, TargetConfig
from ddtree.engine.config import (
    DEFAULT_CUDA_GRAPH_MAX_BS,
    DEFAULT_MAMBA_STRATEGY,
    MAMBA_STRATEGIES,
    SpecConfig,
    cuda_available,
    spec_config,
)
from ddtree.model_sources import source_for
from ddtree.models.checkpoint import Fp8Layout

logger = logging.getLogger("ddtree")

SPECULATIVE_ALGORITHMS = ("NONE", "DFLASH", "DDTREE")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flex")
IMPLEMENTED_ATTENTION_BACKENDS = ("auto", "torch", "triton")
DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("fp8",)
DRAFT_QUANTIZATIONS = ("fp8", "unquant")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
# replicas sharing a GPU (--gpu-id-step 0): their static pools together, leaving each process its
# CUDA context and activations outside the pool
SHARED_GPU_FRACTION = 0.9
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_MAX_RUNNING_REQUESTS = 256
SPECULATIVE_MAX_RUNNING_REQUESTS = 48
DEFAULT_DDTREE_BUDGET = 64
AUTO_BUDGET = "auto"  # --speculative-ddtree-budget auto: the load-aware policy picks per round
# CPU threads by default: one per this many parameters (target + drafter); a small model's matmuls
# are too small to split across threads, which then only wait for each other (README, CPU threads)
CPU_PARAMS_PER_THREAD = 200_000_000


def _opt(default, help: str, choices=None, aliases=()):
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = _opt(
        None,
        "target model dir (or cached HF repo id), or inflate:<shape>[:<src_target>:<src_drafter>] "
        "(an inflated pair built in memory); default: the embedded model pair",
    )
    tokenizer_path: str | None = _opt(None, "tokenizer dir; default: --model-path")
    trust_remote_code: bool = _opt(
        False, "accepted for SGLang compatibility; no remote code is ever run"
    )
    dtype: str = _opt("auto", "weight/activation dtype; auto = the target config's dtype", DTYPES)
    quantization: str | None = _opt(
        None,
        "fp8: the target's decoder linears in block FP8, quantized at load (128x128 weight "
        "blocks; activations per token in groups of 128; needs FP8 tensor cores, compute "
        "capability >= 8.9); a block-FP8 checkpoint (quantization_config) is served as stored "
        "without it",
        QUANTIZATIONS,
    )
    kv_cache_dtype: str = _opt(
        "auto", "KV cache dtype; auto = --dtype (the one implemented)", DTYPES
    )
    device: str = _opt("auto", "auto = cuda when available, else cpu", ("auto", "cpu", "cuda"))
    context_length: int | None = _opt(
        None, "max tokens per request; default: target max_position_embeddings"
    )
    served_model_name: str | None = _opt(
        None, "model name reported by the API; default: --model-path"
    )
    reasoning_parser: str | None = _opt(
        None,
        "split a thinking model's <think>...</think> into reasoning_content (chat) / reasoning_text "
        "(/generate with separate_reasoning): qwen3 (reasoning only where the output or the "
        "prompt opened <think>), deepseek-r1 (the output starts in reasoning)",
        ("qwen3", "deepseek-r1"),
    )
    tool_call_parser: str | None = _opt(
        None,
        "parse tool calls out of chat outputs: hermes (Qwen3's <tool_call>{json}</tool_call>), "
        "qwen3_coder (Qwen3.5 / 3.6's <tool_call><function=...><parameter=...>); `tools` need it",
        ("hermes", "qwen3_coder"),
    )
    mem_fraction_static: float = _opt(
        0.85, "fraction of device memory for weights, KV and state pools"
    )
    max_running_requests: int | None = _opt(
        None, "max concurrent requests; default 48 speculative, 256 otherwise"
    )
    max_queued_requests: int | None = _opt(
        None,
        "requests that may wait for a slot; past it a new request gets 503 with Retry-After "
        "(back-pressure); default: no limit",
    )
    max_total_tokens: int | None = _opt(
        None, "cap on KV cache tokens; default: what fits in memory"
    )
    max_prefill_tokens: int = _opt(16384, "max tokens in one prefill batch")
    chunked_prefill_size: int = _opt(2048, "prefill chunk size in tokens; -1 disables chunking")
    page_size: int = _opt(16, "KV cache page size in tokens")
    disable_radix_cache: bool = _opt(
        False, "turn the prefix (radix) cache off: every prompt is prefilled from its first token"
    )
    tp_size: int = _opt(
        1,
        "tensor parallel degree: one process per rank started by ddtree (rank r on cuda:r; "
        "gloo ranks on the CPU); KV heads are replicated where there are fewer than ranks",
        aliases=("--tp", "--tensor-parallel-size"),
    )
    dp_size: int = _opt(
        1,
        "data parallel: N engine replicas behind this one server, each in its own process on its "
        "own --tp-size GPUs (replica i on GPUs i*tp .. i*tp+tp-1 of those visible; see "
        "--base-gpu-id, --gpu-id-step); 1 = one engine inside the server's process",
        aliases=("--dp", "--data-parallel-size"),
    )
    load_balance_method: str = _opt(
        "round_robin",
        "how --dp-size dispatches requests: round_robin; shortest_queue (fewest requests in "
        "flight); cache_aware (where the prefix cache already holds the prompt's longest prefix, "
        "unless that replica is overloaded; else the shortest queue)",
        LOAD_BALANCE_METHODS,
    )
    base_gpu_id: int = _opt(
        0, "--dp-size: the first GPU (index among the visible ones) replicas use"
    )
    gpu_id_step: int = _opt(
        1,
        "--dp-size: replica i's rank r runs on GPU base-gpu-id + (i * tp-size + r) * step; 0 puts "
        f"every replica on one GPU (with --tp-size 1; their --mem-fraction-static shares must sum "
        f"to <= {SHARED_GPU_FRACTION})",
    )
    random_seed: int | None = _opt(None, "random seed")
    attention_backend: str = _opt(
        "auto",
        "attention kernels; auto = triton on cuda (Gluon kernels "
        "on sm_90) when triton is installed, else torch (the reference)",
        ATTENTION_BACKENDS,
    )
    disable_cuda_graph: bool = _opt(
        False, "run verify and draft eagerly (no CUDA graphs); graphs need cuda + triton"
    )
    cuda_graph_max_bs: int | None = _opt(
        None,
        "largest (padded) batch size captured in CUDA graphs; default "
        f"min({DEFAULT_CUDA_GRAPH_MAX_BS}, --max-running-requests)",
    )
    skip_server_warmup: bool = _opt(
        False,
        "serve at once: no start-up warm-up (on cuda the server otherwise compiles every kernel "
        "first, /health 503 'warming up' until done)",
    )
    disable_overlap_schedule: bool = _opt(
        False,
        "server: publish each decode round's outputs at once instead of under the next round's "
        "device work",
    )
    host: str = _opt("127.0.0.1", "HTTP host")
    port: int = _opt(30000, "HTTP port")
    api_key: str | None = _opt(
        None, "require this API key (Authorization: Bearer) on every route but /health"
    )
    enable_metrics: bool = _opt(False, "expose Prometheus metrics at /metrics")
    metrics_no_auth: bool = _opt(
        False, "serve /metrics without the --api-key (for scrapers that send no key)"
    )
    graceful_shutdown_timeout: float = _opt(
        30.0,
        "seconds SIGTERM waits for in-flight requests "
        "before ending them with an error; a second SIGTERM "
        "or a SIGINT ends them at once",
    )
    log_level: str = _opt("info", "logging level", LOG_LEVELS)
    decode_log_interval: int = _opt(40, "log a 'Decode batch.' stats line every N decode steps")
    speculative_algorithm: str = _opt(
        "NONE", "NONE, DFLASH (chain) or DDTREE (tree); case-insensitive", SPECULATIVE_ALGORITHMS
    )
    speculative_draft_model_path: str | None = _opt(
        None, "DFlash drafter dir (or cached HF repo id)"
    )
    speculative_draft_quantization: str | None = _opt(
        None,
        "the drafter's linears: fp8 (block FP8, quantized at load like --quantization fp8) or "
        "unquant (an FP8 drafter dequantized to --dtype); default: as stored",
        DRAFT_QUANTIZATIONS,
    )
    speculative_dflash_block_size: int | None = _opt(
        None, "drafter block size incl. bonus; default: draft config"
    )
    speculative_num_draft_tokens: int | None = _opt(
        None, "draft tokens per round; equals the block size"
    )
    speculative_ddtree_budget: int | str | None = _opt(
        None,
        "DDTree nodes drafted per round, root excluded (default 64), or auto: per round and "
        "request, the budget that maximises expected tokens per second under the load, up to "
        "--speculative-ddtree-max-budget",
    )
    speculative_ddtree_max_budget: int | None = _opt(
        None,
        f"the largest budget --speculative-ddtree-budget auto picks (default {DEFAULT_DDTREE_BUDGET})",
    )
    speculative_ddtree_topk_cap: int | None = _opt(
        None, "max DDTree candidates per depth; default min(budget, vocab)"
    )
    speculative_ddtree_shadow_linear: bool = _opt(
        False, "always include the drafter's top-1 chain in the tree"
    )
    mamba_scheduler_strategy: str | None = _opt(
        None,
        "hybrid targets: recurrent states under speculation (no_buffer: replay the accepted "
        "path; extra_buffer: a state per tree node)",
        MAMBA_STRATEGIES,
        aliases=("--mamba-radix-cache-strategy",),
    )
    mamba_full_memory_ratio: float = _opt(0.9, "hybrid targets: state pool : KV pool memory ratio")
    mamba_ssm_dtype: str = _opt("float32", "hybrid targets: recurrent state dtype", DTYPES[1:])
    max_mamba_cache_size: int | None = _opt(
        None, "hybrid targets: pin the state pool to this many requests"
    )
    cpu_threads: int | None = _opt(
        None,
        "torch threads for the engine's CPU work (torch.set_num_threads); default on the CPU: "
        "OMP_NUM_THREADS when set, else one thread per "
        f"{CPU_PARAMS_PER_THREAD // 10**6}M model parameters (1 for a small model, whose ops are "
        "too small to split) up to the cores this process may use, divided among --tp-size "
        "ranks; on a GPU: torch's own",
    )
    target_config: TargetConfig | None = field(
        default=None, compare=False, repr=False, metadata={"cli": False}
    )
    drafter_config: DrafterConfig | None = field(
        default=None, compare=False, repr=False, metadata={"cli": False}
    )
    # the speculative settings, derived once by resolve_server_args (engine/config.spec_config)
    spec: SpecConfig | None = field(default=None, compare=False, metadata={"cli": False})
    # the FP8 layouts resolved from the flags and the checkpoints (`models.checkpoint.Fp8Layout`)
    target_fp8: Fp8Layout | None = field(
        default=None, compare=False, repr=False, metadata={"cli": False}
    )
    drafter_fp8: Fp8Layout | None = field(
        default=None, compare=False, repr=False, metadata={"cli": False}
    )

    def __post_init__(self):
        object.__setattr__(
            self, "speculative_algorithm", str(self.speculative_algorithm or "NONE").upper()
        )
        if self.spec is not None:
            # `dataclasses.replace` of resolved args (e.g. the AR run of `generate --compare-ar`)
            # copies `spec`: derive it again from the fields it now has, so it never goes stale
            object.__setattr__(self, "spec", spec_config(self))

    @property
    def is_speculative(self) -> bool:
        return self.speculative_algorithm != "NONE"


SPECULATIVE_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ServerArgs)
    if f.name.startswith("speculative_") and f.name != "speculative_algorithm"
)
DDTREE_FIELDS = tuple(n for n in SPECULATIVE_FIELDS if n.startswith("speculative_ddtree_"))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def cli_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(ServerArgs) if f.metadata.get("cli", True)]


# every flag in one group (tests/test_server_args.py checks the cover): --help lists them by
# concern, and `ddtree generate` leaves out the server's own (flags that would not act there)
FLAG_GROUPS: dict[str, tuple[str, ...]] = {
    "model": (
        "model_path",
        "tokenizer_path",
        "trust_remote_code",
        "dtype",
        "kv_cache_dtype",
        "quantization",
        "context_length",
        "random_seed",
    ),
    "speculative decoding": (
        "speculative_algorithm",
        "speculative_draft_model_path",
        "speculative_draft_quantization",
        "speculative_dflash_block_size",
        "speculative_num_draft_tokens",
        "speculative_ddtree_budget",
        "speculative_ddtree_max_budget",
        "speculative_ddtree_topk_cap",
        "speculative_ddtree_shadow_linear",
    ),
    "memory and scheduling": (
        "mem_fraction_static",
        "max_running_requests",
        "max_total_tokens",
        "max_prefill_tokens",
        "chunked_prefill_size",
        "page_size",
        "disable_radix_cache",
    ),
    "hybrid targets (Gated DeltaNet)": (
        "mamba_scheduler_strategy",
        "mamba_full_memory_ratio",
        "mamba_ssm_dtype",
        "max_mamba_cache_size",
    ),
    "device and kernels": (
        "device",
        "tp_size",
        "cpu_threads",
        "attention_backend",
        "disable_cuda_graph",
        "cuda_graph_max_bs",
    ),
    "logging": ("log_level", "decode_log_interval"),
    "data parallel (server replicas)": (
        "dp_size",
        "load_balance_method",
        "base_gpu_id",
        "gpu_id_step",
    ),
    "HTTP server": (
        "host",
        "port",
        "api_key",
        "served_model_name",
        "enable_metrics",
        "metrics_no_auth",
        "graceful_shutdown_timeout",
        "max_queued_requests",
        "skip_server_warmup",
        "disable_overlap_schedule",
        "reasoning_parser",
        "tool_call_parser",
    ),
}
# the groups `ddtree generate` leaves out (one engine, no HTTP server)
SERVER_ONLY_GROUPS = ("data parallel (server replicas)", "HTTP server")


def make_parser(
    prog: str = "ddtree serve",
    groups: tuple[str, ...] | None = None,
    description: str = "DDTree / DFlash speculative decoding server",
    add_help: bool = True,
) -> argparse.ArgumentParser:
    """The server flags, by FLAG_GROUPS (all of them, or the `groups` named); abbreviations are
    refused (`--speculative-ddtree-bud 8` is a typo, not a flag)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, allow_abbrev=False, add_help=add_help
    )
    hints = typing.get_type_hints(ServerArgs)
    fields = {f.name: f for f in cli_fields()}
    for title in groups or tuple(FLAG_GROUPS):
        group = parser.add_argument_group(title)
        for name in FLAG_GROUPS[title]:
            _add_flag(group, fields[name], hints)
    return parser


def _add_flag(parser, f: dataclasses.Field, hints: dict) -> None:
    names = [flag(f.name), *f.metadata["aliases"]]
    kind = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
    if kind is bool:
        parser.add_argument(
            *names,
            dest=f.name,
            default=f.default,
            help=f.metadata["help"],
            action=argparse.BooleanOptionalAction if f.default else "store_true",
        )
        return
    convert = CONVERTERS.get(f.name, kind)
    parser.add_argument(
        *names,
        dest=f.name,
        type=convert,
        default=f.default,
        choices=f.metadata["choices"],
        help=f.metadata["help"] + (f" (default: {f.default})" if f.default is not None else ""),
    )


def budget_value(text: str) -> int | str:
    """--speculative-ddtree-budget: an integer or `auto`."""
    if str(text).strip().lower() == AUTO_BUDGET:
        return AUTO_BUDGET
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an integer nor auto; pass e.g. 64, or auto"
        ) from None


CONVERTERS = {"speculative_algorithm": str.upper, "speculative_ddtree_budget": budget_value}


def prepare_server_args(argv: list[str]) -> ServerArgs:
    return resolve_server_args(ServerArgs(**vars(make_parser().parse_args(argv))))


def triton_available() -> bool:
    """Whether `import triton` would succeed, found without importing it (that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _check_scalars(a: ServerArgs, p: list[str]) -> None:
    for f in cli_fields():
        value, choices = getattr(a, f.name), f.metadata["choices"]
        if choices and value is not None and value not in choices:
            p.append(f"{flag(f.name)} {value!r}: choose one of {', '.join(choices)}")
    if (
        a.attention_backend in ATTENTION_BACKENDS
        and a.attention_backend not in IMPLEMENTED_ATTENTION_BACKENDS
    ):
        p.append(
            f"--attention-backend {a.attention_backend} is not implemented yet; use --attention-backend "
            + " or ".join(b for b in IMPLEMENTED_ATTENTION_BACKENDS if b != "auto")
        )
    if not 0 < a.mem_fraction_static < 1:
        p.append(f"--mem-fraction-static {a.mem_fraction_static}: must be in (0, 1), e.g. 0.85")
    if not 0 < a.mamba_full_memory_ratio < 1:
        p.append(
            f"--mamba-full-memory-ratio {a.mamba_full_memory_ratio}: must be in (0, 1), e.g. 0.9"
        )
    budget = a.speculative_ddtree_budget
    if isinstance(budget, str) and budget != AUTO_BUDGET:
        p.append(
            f"--speculative-ddtree-budget {budget!r}: pass an integer (e.g. {DEFAULT_DDTREE_BUDGET}) or auto"
        )
    for name, low in _MINIMUMS.items():
        value = getattr(a, name)
        if isinstance(value, int) and value < low:
            p.append(f"{flag(name)} {value}: must be at least {low}{_MINIMUM_HINTS.get(name, '')}")
    if a.chunked_prefill_size == 0 or a.chunked_prefill_size < -1:
        p.append(
            f"--chunked-prefill-size {a.chunked_prefill_size}: must be positive, or -1 to disable chunking"
        )
    if not 0 < a.port < 65536:
        p.append(f"--port {a.port}: must be in 1..65535")
    if not a.graceful_shutdown_timeout >= 0:  # also refuses NaN
        p.append(
            f"--graceful-shutdown-timeout {a.graceful_shutdown_timeout}: must be >= 0 seconds "
            "(0 ends in-flight requests at the first SIGTERM)"
        )
    if a.metrics_no_auth and not (a.api_key and a.enable_metrics):
        p.append(
            "--metrics-no-auth opens /metrics despite --api-key: it needs both --api-key and "
            "--enable-metrics; drop it or add them"
        )


_MINIMUMS = {
    "context_length": 1,
    "max_running_requests": 1,
    "max_queued_requests": 1,
    "max_total_tokens": 1,
    "max_prefill_tokens": 1,
    "page_size": 1,
    "tp_size": 1,
    "dp_size": 1,
    "base_gpu_id": 0,
    "gpu_id_step": 0,
    "cuda_graph_max_bs": 1,
    "max_mamba_cache_size": 1,
    "speculative_dflash_block_size": 2,
    "speculative_ddtree_budget": 1,
    "speculative_ddtree_max_budget": 1,
    "speculative_ddtree_topk_cap": 1,
    "decode_log_interval": 1,
}
_MINIMUM_HINTS = {
    "speculative_dflash_block_size": " (the bonus token plus one drafted token)",
    "speculative_ddtree_budget": f" (drafted nodes, root excluded; {DEFAULT_DDTREE_BUDGET} is a good start)",
}


def _resolve_speculative(a: ServerArgs, t, d, upd: dict, p: list[str]) -> None:
    algo = a.speculative_algorithm
    if algo == "NONE":
        given = [
            flag(n)
            for n in SPECULATIVE_FIELDS
            if getattr(a, n) != ServerArgs.__dataclass_fields__[n].default
        ]
        if given:
            logger.warning(
                "%s ignored because --speculative-algorithm is NONE; pass --speculative-algorithm "
                "DDTREE or DFLASH to use them",
                ", ".join(given),
            )
        return
    block = a.speculative_dflash_block_size
    if d is not None and block is None:
        block = d.block_size
        logger.info(
            "Speculative DFlash block size is set to %d from the draft model config.", block
        )
    elif d is not None and block > d.block_size:
        p.append(
            f"--speculative-dflash-block-size {block} exceeds the drafter's trained block_size {d.block_size}; "
            f"pass a value in 2..{d.block_size}"
        )
    elif d is not None and block < d.block_size:
        # Valid (the drafter fills a prefix of its trained block), but it changes what a round can
        # accept, so it is said out loud.
        logger.warning(
            "--speculative-dflash-block-size %d is below the drafter's trained "
            "block_size %d: each round drafts %d tokens instead of %d, so at most %d "
            "are accepted per round; drop the flag to use the trained size",
            block,
            d.block_size,
            block - 1,
            d.block_size - 1,
            block,
        )
    upd["speculative_dflash_block_size"] = block
    draft_tokens = a.speculative_num_draft_tokens
    if draft_tokens is not None and block is not None and draft_tokens != block:
        if algo == "DFLASH":
            p.append(
                f"--speculative-num-draft-tokens {draft_tokens} must equal the block size {block} for DFLASH; "
                f"drop it or pass --speculative-dflash-block-size {draft_tokens}"
            )
        else:
            logger.warning(
                "--speculative-num-draft-tokens %d ignored for DDTREE: the drafter proposes %d tokens "
                "per round; the tree size is --speculative-ddtree-budget",
                draft_tokens,
                block,
            )
    if block is not None and draft_tokens != block:
        logger.info("Speculative num draft tokens is set to %d (the block size).", block)
    upd["speculative_num_draft_tokens"] = block
    if algo == "DFLASH":
        given = [flag(n) for n in DDTREE_FIELDS if getattr(a, n) not in (None, False)]
        if given:
            logger.warning(
                "%s ignored: they apply to --speculative-algorithm DDTREE only", ", ".join(given)
            )
        upd.update({n: ServerArgs.__dataclass_fields__[n].default for n in DDTREE_FIELDS})
    else:
        budget = a.speculative_ddtree_budget
        if budget is None:
            budget = DEFAULT_DDTREE_BUDGET
            logger.info("Speculative DDTree budget is set to %d.", budget)
        upd["speculative_ddtree_budget"] = budget
        if budget == AUTO_BUDGET:
            budget = a.speculative_ddtree_max_budget or DEFAULT_DDTREE_BUDGET
            upd["speculative_ddtree_max_budget"] = budget
            logger.info(
                "Speculative DDTree budget is auto: chosen per round up to %d "
                "(--speculative-ddtree-max-budget).",
                budget,
            )
        elif a.speculative_ddtree_max_budget is not None:
            p.append(
                f"--speculative-ddtree-max-budget {a.speculative_ddtree_max_budget} caps "
                f"--speculative-ddtree-budget auto only; drop it, or pass "
                f"--speculative-ddtree-budget auto"
            )
        if (
            a.speculative_ddtree_topk_cap is None
            and t is not None
            and isinstance(budget, int)
            and budget >= 1
        ):
            upd["speculative_ddtree_topk_cap"] = min(budget, t.vocab_size)
            logger.info(
                "Speculative DDTree top-k cap is set to %d.", upd["speculative_ddtree_topk_cap"]
            )
    if a.max_running_requests is None:
        upd["max_running_requests"] = SPECULATIVE_MAX_RUNNING_REQUESTS
        logger.info(
            "Max running requests is reset to %d for speculative decoding.",
            SPECULATIVE_MAX_RUNNING_REQUESTS,
        )


def _resolve_mamba(a: ServerArgs, t: TargetConfig, upd: dict, p: list[str]) -> None:
    strategy = a.mamba_scheduler_strategy
    if not t.is_hybrid:
        if strategy is not None:
            logger.warning(
                "--mamba-scheduler-strategy %s ignored: %s is a dense (attention-only) target",
                strategy,
                t.architecture,
            )
            upd["mamba_scheduler_strategy"] = None
        return
    if a.is_speculative and strategy is None:
        upd["mamba_scheduler_strategy"] = DEFAULT_MAMBA_STRATEGY
        logger.info(
            "Mamba scheduler strategy is set to no_buffer: the hybrid target %s keeps no per-node "
            "recurrent states for %s; after each verify the accepted path is replayed. Pass "
            "--mamba-scheduler-strategy extra_buffer to commit by copy instead.",
            t.architecture,
            a.speculative_algorithm,
        )
    elif a.is_speculative and strategy == "no_buffer":
        logger.info(
            "--mamba-scheduler-strategy no_buffer: per-node recurrent states are not kept; after each %s "
            "verify the accepted path is replayed from stashed inputs (less memory, one extra chunked pass "
            "per GDN layer). Pass --mamba-scheduler-strategy extra_buffer to commit by copy instead.",
            a.speculative_algorithm,
        )
    elif strategy is None:
        upd["mamba_scheduler_strategy"] = DEFAULT_MAMBA_STRATEGY
        logger.info("Mamba scheduler strategy is set to no_buffer (no speculative decoding).")


def resolve_server_args(args: ServerArgs, capability: tuple[int, int] | None = None) -> ServerArgs:
    """Fill derived defaults from the target/drafter config.json; raise one ConfigError listing every
    problem. `capability`: the GPU planned for (default: the local one's, on --device cuda)."""
    p: list[str] = []
    upd: dict = {}
    _check_scalars(args, p)
    target_path, drafter_path = args.model_path, args.speculative_draft_model_path
    if target_path is None:
        try:
            from ddtree.assets import default_model_paths

            target_path, default_drafter = default_model_paths()
        except Exception as e:  # noqa: BLE001 - any failure means "no embedded pair", reported as a problem
            p.append(
                f"--model-path is required: the embedded default model pair is unavailable ({e})"
            )
        else:
            logger.info(
                "No --model-path given: using the embedded default model pair %s + %s.",
                target_path,
                default_drafter,
            )
            if args.is_speculative and drafter_path is None:
                drafter_path = default_drafter
    source = source_for(target_path) or source_for(drafter_path)
    if source is not None:  # a source may bring its own drafter (an inflated pair does)
        drafter_path = source.drafter_path_for(target_path, drafter_path, args.is_speculative, p)
    if args.is_speculative and drafter_path is None:
        p.append(
            f"--speculative-draft-model-path is required for --speculative-algorithm "
            f"{args.speculative_algorithm}; pass the DFlash drafter directory"
        )
    t = d = None
    if target_path is not None:
        target_path, t = load_model_config(target_path, True, p)
        upd["model_path"] = target_path
    if args.is_speculative and drafter_path is not None:
        drafter_path, d = load_model_config(drafter_path, False, p)
        upd["speculative_draft_model_path"] = drafter_path
    if t is not None and d is not None:
        check_pair(t, d, p)
    check_tp(args.tp_size, t, d, p)
    if args.tp_size > 1 and source_for(args.model_path) is not None:
        p.append(
            f"--model-path {args.model_path}: an inflate: pair is built whole on one device; use "
            "--tp-size 1, or write it with `ddtree inflate` and load the directory"
        )
    _resolve_speculative(args, t, d, upd, p)
    _check_policy_trace(args, upd, p)
    if not args.is_speculative and args.max_running_requests is None:
        upd["max_running_requests"] = DEFAULT_MAX_RUNNING_REQUESTS
        logger.info("Max running requests is set to %d.", DEFAULT_MAX_RUNNING_REQUESTS)
    if args.device == "auto":
        upd["device"] = "cuda" if cuda_available() else "cpu"
        logger.info("Device is set to %s.", upd["device"])
    if t is not None:
        _resolve_mamba(args, t, upd, p)
        _resolve_target_defaults(args, t, d, upd, upd.get("device", args.device), p)
    device = upd.get("device", args.device)
    paths = (upd.get("model_path", target_path), upd.get("speculative_draft_model_path"))
    t_fp8, d_fp8 = check_quantization(args, t, d, paths, device, capability, p)
    _check_tp_devices(args.tp_size, device, p)
    _resolve_cpu_threads(args, t, d, upd, device, p)
    _check_dp(args, device, p)
    _resolve_attention_backend(args, upd, device, p)
    _resolve_cuda_graph(args, upd, device)
    upd["served_model_name"] = args.served_model_name or args.model_path or upd.get("model_path")
    model_source = source_for(upd.get("model_path"))
    upd["tokenizer_path"] = args.tokenizer_path or (
        model_source.tokenizer_dir(upd["model_path"]) if model_source else upd.get("model_path")
    )
    if p:
        raise ConfigError(p)
    resolved = dataclasses.replace(
        args, target_config=t, drafter_config=d, target_fp8=t_fp8, drafter_fp8=d_fp8, **upd
    )
    return dataclasses.replace(resolved, spec=spec_config(resolved))


def _check_policy_trace(a: ServerArgs, upd: dict, p: list[str]) -> None:
    """DDTREE_POLICY_TRACE traces the auto budget policy: refused for any other config (it would
    write nothing) and where its file cannot be created, before the weights load."""
    path = envs.POLICY_TRACE.get().strip()
    if not path:
        return
    name = envs.POLICY_TRACE.name
    budget = upd.get("speculative_ddtree_budget", a.speculative_ddtree_budget)
    if a.speculative_algorithm != "DDTREE" or budget != AUTO_BUDGET:
        p.append(
            f"{name}={path}: traces --speculative-ddtree-budget auto only; unset it, or pass "
            "--speculative-algorithm DDTREE --speculative-ddtree-budget auto"
        )
    elif not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        p.append(f"{name}={path}: its directory does not exist; create it or name another file")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask; a container's CPU set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _resolve_cpu_threads(
    a: ServerArgs, t: TargetConfig | None, d: DrafterConfig | None, upd: dict, device: str, p
) -> None:
    """--cpu-threads as given; on the CPU by default OMP_NUM_THREADS, else by model size (see
    CPU_PARAMS_PER_THREAD), at most this process's share of the cores."""
    if a.cpu_threads is not None:
        if a.cpu_threads < 1:
            p.append(f"--cpu-threads {a.cpu_threads}: give at least 1 (or leave it out: automatic)")
        return
    if device != "cpu" or t is None:
        return
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        upd["cpu_threads"] = int(omp)
        logger.info("CPU threads are set to %d from OMP_NUM_THREADS.", int(omp))
        return
    from ddtree.memory_plan import drafter_param_count, target_param_count

    params = target_param_count(t) + (drafter_param_count(d) if d is not None else 0)
    # every rank of every --dp-size replica is a process of its own (bad sizes are reported apart)
    share = max(1, available_cores() // max(a.tp_size * a.dp_size, 1))
    n = max(1, min(share, -(-params // CPU_PARAMS_PER_THREAD)))
    upd["cpu_threads"] = n
    logger.info(
        "CPU threads are set to %d (%.0fM parameters, %d cores per rank; --cpu-threads or "
        "OMP_NUM_THREADS to choose).",
        n,
        params / 1e6,
        share,
    )


def _check_tp_devices(tp: int, device: str, p: list[str]) -> None:
    """Rank r runs on cuda:r (the GPU count is checked when the ranks start, so check-config can
    plan --tp-size 8 from any machine)."""
    if tp > 1 and device.startswith("cuda") and device != "cuda":
        p.append(f"--device {device}: with --tp-size {tp} pass --device cuda (rank r uses cuda:r)")


def _check_dp(a: ServerArgs, device: str, p: list[str]) -> None:
    """--dp-size and its placement flags (the GPU count is checked when the replicas start, so
    check-config can plan --dp-size 8 from any machine)."""
    if a.dp_size == 1:
        if (a.base_gpu_id, a.gpu_id_step) != (0, 1):
            p.append(
                "--base-gpu-id / --gpu-id-step place --dp-size replicas; one engine runs on the "
                "first --tp-size visible GPUs: drop them and set CUDA_VISIBLE_DEVICES"
            )
        if a.load_balance_method != "round_robin":
            logger.warning(
                "--load-balance-method %s ignored: it dispatches between --dp-size replicas "
                "(--dp-size is 1)",
                a.load_balance_method,
            )
        return
    if device.startswith("cuda") and device != "cuda":
        p.append(
            f"--device {device}: with --dp-size {a.dp_size} pass --device cuda (replicas are "
            "placed by --base-gpu-id / --gpu-id-step)"
        )
    if a.gpu_id_step == 0 and a.tp_size > 1:
        p.append(
            f"--gpu-id-step 0 with --tp-size {a.tp_size}: the ranks of one replica need "
            "distinct GPUs; pass --gpu-id-step 1"
        )
    if a.gpu_id_step == 0 and device != "cpu":
        total = a.dp_size * a.mem_fraction_static
        if total > SHARED_GPU_FRACTION:
            share = SHARED_GPU_FRACTION / a.dp_size
            p.append(
                f"--dp-size {a.dp_size} replicas share one GPU (--gpu-id-step 0), each taking "
                f"--mem-fraction-static {a.mem_fraction_static} of it ({total:.2f} in all); "
                f"pass --mem-fraction-static {int(share * 100) / 100:g} or less"
            )
    if a.load_balance_method == "cache_aware" and a.disable_radix_cache:
        p.append(
            "--load-balance-method cache_aware routes by the prefix cache, which "
            "--disable-radix-cache turns off; drop one of them (shortest_queue balances load alone)"
        )


def _resolve_attention_backend(a: ServerArgs, upd: dict, device: str, p: list[str]) -> None:
    """auto -> the fast path of the device at hand: triton on cuda (its launcher dispatches the
    Gluon kernels on sm_90), the torch reference on the CPU or where triton is not installed."""
    if a.attention_backend == "triton" and not triton_available():
        p.append(
            "--attention-backend triton: triton is not installed; pip install triton (CUDA "
            "torch wheels bring it), or pass --attention-backend torch"
        )
    if a.attention_backend != "auto":
        return
    if device != "cuda":
        backend, why = "torch", "the reference, on the CPU"
    elif triton_available():
        backend, why = "triton", "cuda with triton installed"
    else:
        backend, why = "torch", "triton is not installed (pip install triton); graphs need it"
    upd["attention_backend"] = backend
    logger.info("Attention backend is set to %s (%s).", backend, why)


def _resolve_cuda_graph(a: ServerArgs, upd: dict, device: str) -> None:
    if a.disable_cuda_graph:
        if a.cuda_graph_max_bs is not None:
            logger.warning("--cuda-graph-max-bs ignored: --disable-cuda-graph is set")
        return
    backend = upd.get("attention_backend", a.attention_backend)
    why = (
        "the device is cpu"
        if device != "cuda"
        else None
        if backend == "triton"
        else f"--attention-backend {backend} is not capturable; pass --attention-backend triton"
    )
    if why:
        upd["disable_cuda_graph"] = True
        logger.info("CUDA graphs are disabled: %s.", why)
        return
    running = upd.get("max_running_requests", a.max_running_requests)
    max_bs = min(a.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, running)
    if max_bs != a.cuda_graph_max_bs:
        upd["cuda_graph_max_bs"] = max_bs
        logger.info(
            "Cuda graph max bs is set to %d%s.",
            max_bs,
            " (--max-running-requests)"
            if a.cuda_graph_max_bs and a.cuda_graph_max_bs > running
            else "",
        )
    logger.info("CUDA graphs are enabled for verify and draft (batch sizes up to %d).", max_bs)


def _resolve_target_defaults(
    a: ServerArgs, t: TargetConfig, d: DrafterConfig | None, upd: dict, device: str, p: list[str]
) -> None:
    if a.dtype == "auto" and device == "cpu":
        # CPU bf16 matmuls are slow and round differently for different batch shapes, so a tree verify
        # could flip a near-tie that plain decoding resolves the other way.
        upd["dtype"] = "float32"
        logger.info("Dtype is set to float32 on the CPU (pass --dtype to override).")
    elif a.dtype == "auto":
        dtype = t.dtype.removeprefix("torch.")
        if dtype not in DTYPES:
            logger.warning("Target config dtype %r is not supported; using bfloat16", t.dtype)
            dtype = "bfloat16"
        upd["dtype"] = dtype
        logger.info("Dtype is set to %s from the target model config.", dtype)
    dtype = upd.get("dtype", a.dtype)
    if a.kv_cache_dtype == "auto":
        upd["kv_cache_dtype"] = dtype
    elif a.kv_cache_dtype != dtype:
        p.append(
            f"--kv-cache-dtype {a.kv_cache_dtype} differs from --dtype {dtype}: a separate KV "
            f"cache dtype is not implemented yet; drop --kv-cache-dtype or pass "
            f"--kv-cache-dtype {dtype}"
        )
    ctx = a.context_length
    if ctx is None:
        ctx = upd["context_length"] = t.max_position_embeddings
        logger.info("Context length is set to %d from the target model config.", ctx)
    elif ctx > t.max_position_embeddings:
        logger.warning(
            "--context-length %d exceeds the target's max_position_embeddings %d; outputs past it are "
            "unreliable",
            ctx,
            t.max_position_embeddings,
        )
    if d is not None and ctx > d.max_position_embeddings:
        logger.warning(
            "--context-length %d exceeds the drafter's max_position_embeddings %d; acceptance may drop "
            "on long requests",
            ctx,
            d.max_position_embeddings,
        )
