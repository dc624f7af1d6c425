"""Server arguments: SGLang flag names, one frozen dataclass, resolved against config.json files only.

The dataclass is the single source of truth: argparse flags, defaults, choices and help are generated from its
fields. `resolve_server_args` fills derived defaults (logged the way SGLang logs them) and reports every problem
at once in one `ConfigError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field

from ddtree.engine.config import (
    DEFAULT_CUDA_GRAPH_MAX_BS,
    MAMBA_STRATEGIES,
    SpecConfig,
    spec_config,
)
from ddtree.models.checkpoint import Fp8Layout
from ddtree.models.configs import DrafterConfig, TargetConfig

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
    dp_replica_process: bool = _opt(
        False,
        "--dp-size 1: run the one engine in a replica process behind the dispatcher, as "
        "--dp-size N does (the process boundary alone, for its A/B: scripts/device/dp.sh)",
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
    speculative_ddtree_dflash2_tree: str | None = _opt(
        None,
        "DFlash2 drafters: path (default: the path-conditioned tree, children scored by the "
        "selector under their parent's token) or marginal (DDTree over the per-position "
        "marginals, the selector unused)",
        ("path", "marginal"),
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
        None,
        "hybrid targets: pin the state pool to this many requests (with the prefix cache, and "
        "their recurrent-state checkpoints)",
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
        "speculative_ddtree_dflash2_tree",
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
        "dp_replica_process",
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
