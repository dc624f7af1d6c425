"""`ddtree check-config <server flags>`: resolve the flags against config.json files and print the memory plan.

Never loads weights (and imports torch only on a GPU machine, to read its memory size), so it answers in a
fraction of a second. It plans for the device the flags resolve to: the local GPU, or host RAM
in float32 on a machine without one; `--device cuda --device-memory-gib 140` plans for a 140 GiB
GPU (an H200) from any machine, in the target config's dtype. Exit status:
  0  the plan serves at least one request at the context length;
  1  the configuration resolves but cannot serve (weights exceed the pool, or not one request fits),
     with the fix on stderr;
  2  invalid configuration or bad flags.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ddtree.config.args import ServerArgs, cli_fields, make_parser
from ddtree.config.memory_plan import (
    MemoryPlan,
    describe_placement,
    memory_plan,
    placement,
    shared,
)
from ddtree.config.resolve import resolve_server_args
from ddtree.engine.config import cuda_available
from ddtree.models.configs import ConfigError
from ddtree.models.sources import weight_problems

logger = logging.getLogger("ddtree")


def _log_handler(level: str) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[ddtree] %(levelname)s %(message)s"))
    handler.setLevel(level.upper())
    return handler


def format_resolved(args: ServerArgs) -> str:
    lines = ["resolved configuration (non-default fields):"]
    for f in cli_fields():
        value = getattr(args, f.name)
        if value != f.default:
            lines.append(f"  {f.name:<34} {value}")
    t, d = args.target_config, args.drafter_config
    if t is not None:
        kind = (
            f"hybrid ({len(t.linear_layer_ids)} GDN + {len(t.attention_layer_ids)} attention layers)"
            if t.is_hybrid
            else f"dense ({t.num_hidden_layers} layers)"
        )
        lines.append(
            f"target:  {t.architecture}, {kind}, hidden {t.hidden_size}, vocab {t.vocab_size}"
        )
    if d is not None:
        lines.append(
            f"drafter: {d.num_hidden_layers} layers, block {d.block_size}, taps "
            f"{list(d.target_layer_ids)}, mask {d.mask_token_id}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check-config"]:
        argv = argv[1:]
    parser = make_parser("ddtree check-config")
    parser.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        help="plan for a device of this many GiB instead of the local GPU / "
        "host RAM; with --device cuda, for a GPU from a machine without "
        "one (H200: 140)",
    )
    parser.add_argument(
        "--device-capability",
        type=_capability,
        default=None,
        help="plan for a GPU of this compute capability (e.g. 9.0 for an H200, 8.0 for an A100: "
        "FP8 needs >= 8.9); default: the local GPU's",
    )
    try:
        ns = vars(parser.parse_args(argv))
    except SystemExit as e:
        return int(e.code or 0)
    device_gib = ns.pop("device_memory_gib")
    capability = ns.pop("device_capability")
    handler, old_level = _log_handler(ns["log_level"]), logger.level
    logger.addHandler(handler)
    logger.setLevel(min(handler.level, logger.getEffectiveLevel()))
    try:
        args = resolve_server_args(ServerArgs(**ns), capability)
    except ConfigError as e:
        print("error: invalid configuration:", file=sys.stderr)
        for line in e.problems:
            print(f"  - {line}", file=sys.stderr)
        return 2
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    if args.device == "cuda" and device_gib is None and not cuda_available():
        print(
            "error: --device cuda: this machine has no GPU to measure; pass "
            "--device-memory-gib N to plan for a GPU of N GiB (e.g. --device-memory-gib 140 for "
            "an H200)",
            file=sys.stderr,
        )
        return 2
    plan = memory_plan(args, None if device_gib is None else int(device_gib * 2**30))
    print(format_resolved(args))
    print(planned_for(args, plan, device_gib))
    print(plan.format())
    if args.dp_size > 1 or args.tp_size > 1:
        print(parallel_plan(args, plan))
    for line in weight_problems(args):  # planned from config.json; serving will need them
        print(f"note: {line}")
    problems = cannot_serve(plan)
    if problems:
        print("error: this configuration resolves but cannot serve:", file=sys.stderr)
        for line in problems:
            print(f"  - {line}", file=sys.stderr)
        return 1
    return 0


def _capability(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(v) for v in text.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: pass MAJOR.MINOR, e.g. 9.0") from None
    return major, minor


def planned_for(args: ServerArgs, plan: MemoryPlan, device_gib: float | None) -> str:
    """What the plan assumed, so that a planning run on the CPU is never read as a GPU plan."""
    if device_gib is not None:
        size = f"{device_gib:g} GiB given by --device-memory-gib"
    else:
        size = f"{plan.device_name}, {plan.device_bytes / 2**30:.1f} GiB"
    line = (
        f"planned for: device {args.device} ({size}), dtype {args.dtype}, "
        f"KV cache {args.kv_cache_dtype}, attention {args.attention_backend}"
    )
    if args.device == "cpu":
        line += (
            "\n  (a CPU plan; to plan for a GPU from this machine pass --device cuda "
            "--device-memory-gib 140 for an H200)"
        )
    return line


def parallel_plan(args: ServerArgs, plan: MemoryPlan) -> str:
    """The replicas and their GPUs (--dp-size), what all of them hold together, and, on GPUs, the
    other split of the same GPUs (tensor-parallel groups vs one-GPU replicas) with its capacity:
    the trade between --tp-size N and --dp-size N."""
    dp, tp = args.dp_size, args.tp_size
    gpus = placement(args)
    lines = []
    if dp > 1:
        n_gpus = len({g for ranks in gpus for g in ranks}) if gpus else 0
        on = f", {n_gpus} GPU{'s' if n_gpus != 1 else ''}" if gpus else ""
        lines.append(
            f"data parallel: {dp} replicas x tp {tp}{on}, --load-balance-method "
            f"{args.load_balance_method}"
        )
        lines += [f"  {line}" for line in describe_placement(gpus, dp)]
        if shared(gpus):
            lines.append(
                f"  replicas share GPUs: each takes --mem-fraction-static "
                f"{args.mem_fraction_static} of its GPU"
            )
        lines.append(
            f"  each replica: the memory plan above; all {dp}: {dp * plan.requests_at_context} "
            f"requests at context, {dp * plan.kv_tokens:,} KV tokens"
        )
    if args.device != "cpu" and not shared(gpus):
        lines += _split_trade(args, plan)
    return "\n".join(lines)


def _split_trade(args: ServerArgs, plan: MemoryPlan) -> list[str]:
    """On dp x tp GPUs: when the model fits one GPU, the other extreme of the same GPUs."""
    import dataclasses

    from ddtree.models.tp_layout import tp_problems

    dp, tp = args.dp_size, args.tp_size
    n = dp * tp
    one = memory_plan(dataclasses.replace(args, tp_size=1), plan.device_bytes)
    if not one.fits:
        return [f"the model does not fit one GPU at tp 1: it needs --tp-size > 1 on {n} GPUs"]
    per_gpu = f"{one.requests_at_context} requests at context, {one.kv_tokens:,} KV tokens"
    lines = [f"the model fits one GPU (tp 1: {per_gpu})"]
    here = f"{dp * plan.requests_at_context} requests at context in all"
    replicas = (
        f"--dp-size {n} --tp-size 1: {n} replicas, {n * one.requests_at_context} requests at "
        "context in all, no all-reduce per layer (usually the most throughput)"
    )
    if tp == 1:  # this plan is the replicas; the other extreme is one group over the n GPUs
        t, d = args.target_config, args.drafter_config
        if tp_problems(n, t, d):
            lines.append(f"  this plan, {replicas}; --tp-size {n} cannot split this model's heads")
            return lines
        group = memory_plan(dataclasses.replace(args, tp_size=n, dp_size=1), plan.device_bytes)
        lines += [
            f"  this plan, {replicas}",
            f"  --tp-size {n} instead: one group, {group.requests_at_context} requests at "
            f"context, the lowest latency per request (each GPU reads 1/{n} of the weights)",
        ]
    else:
        lines += [
            f"  this plan, {dp} group{'s' if dp > 1 else ''} of tp {tp}: {here}, the lower "
            "latency per request",
            f"  {replicas}",
        ]
    return lines


def cannot_serve(plan: MemoryPlan) -> list[str]:
    """The verdict from the plan's own outputs: one line per reason, each naming the fix."""
    if plan.fits:
        return []
    return list(plan.warnings) or [
        f"not one request of --context-length {plan.context_length:,} "
        "fits; lower --context-length or free memory"
    ]


if __name__ == "__main__":
    sys.exit(main())
