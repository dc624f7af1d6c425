"""`resolve_server_args`: ServerArgs as given -> resolved, against the target / drafter config.json
files; every problem reported at once in one `ConfigError`, before any weight loads. The
device-placement part (threads, tp / dp placement, attention backend, graphs, dtype and
context defaults) is `config.device`. `prepare_server_args`: argv -> resolved (SGLang's entry)."""

from __future__ import annotations

import dataclasses
import logging
import os

from ddtree import envs
from ddtree.config.args import (
    ATTENTION_BACKENDS,
    AUTO_BUDGET,
    DDTREE_FIELDS,
    DEFAULT_DDTREE_BUDGET,
    DEFAULT_MAX_RUNNING_REQUESTS,
    IMPLEMENTED_ATTENTION_BACKENDS,
    SPECULATIVE_FIELDS,
    SPECULATIVE_MAX_RUNNING_REQUESTS,
    ServerArgs,
    cli_fields,
    flag,
    make_parser,
)
from ddtree.config.checks import check_pair, check_quantization, check_tp, load_model_config
from ddtree.config.device import (
    check_dp,
    check_tp_devices,
    resolve_attention_backend,
    resolve_cpu_threads,
    resolve_cuda_graph,
    resolve_target_defaults,
)
from ddtree.engine.config import DEFAULT_MAMBA_STRATEGY, cuda_available, spec_config
from ddtree.models.configs import ConfigError, TargetConfig
from ddtree.models.sources import source_for

logger = logging.getLogger("ddtree")


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
        tree = a.speculative_ddtree_dflash2_tree
        if tree is not None and d is not None and not d.is_dflash2:
            p.append(
                f"--speculative-ddtree-dflash2-tree {tree}: the drafter is {d.architecture}, not "
                "DFlash2 (its tree has no other form); drop the flag"
            )
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


def prepare_server_args(argv: list[str]) -> ServerArgs:
    return resolve_server_args(ServerArgs(**vars(make_parser().parse_args(argv))))


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
        resolve_target_defaults(args, t, d, upd, upd.get("device", args.device), p)
    device = upd.get("device", args.device)
    paths = (upd.get("model_path", target_path), upd.get("speculative_draft_model_path"))
    t_fp8, d_fp8 = check_quantization(args, t, d, paths, device, capability, p)
    check_tp_devices(args.tp_size, device, p)
    resolve_cpu_threads(args, t, d, upd, device, p)
    check_dp(args, device, p)
    resolve_attention_backend(args, upd, device, p)
    resolve_cuda_graph(args, upd, device)
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
