"""Weight bytes from the model configs alone (parameter counts, the FP8 layouts, one tensor-parallel
rank's shard): what the memory plan counts and what the engine checks before it loads anything."""

from __future__ import annotations

import dataclasses

from ddtree.models.checkpoint import Fp8Layout, fp8_weight_bytes
from ddtree.models.configs import (
    DrafterConfig,
    TargetConfig,
    drafter_param_count,
    target_param_count,
)
from ddtree.models.tp_layout import ShardMap, shard_drafter, shard_target, vocab_rows

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype name ("bfloat16") or a torch dtype (an int passes through)."""
    if isinstance(dtype, int):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def served_fp8(args) -> tuple[Fp8Layout | None, Fp8Layout | None]:
    """The (target, drafter) FP8 layouts the engine serves (an FP8 drafter dequantized by
    --speculative-draft-quantization unquant is served in --dtype)."""
    drafter = None if args.speculative_draft_quantization == "unquant" else args.drafter_fp8
    return args.target_fp8, drafter if args.is_speculative else None


def _fp8_saving(cfg, layout: Fp8Layout | None, n: int, tp: int) -> int:
    if layout is None:
        return 0
    local = None
    if tp > 1:
        shards = ShardMap(cfg, tp, 0)
        local = lambda name, shape: shards.local_shape(name + ".weight", shape)  # noqa: E731
    return fp8_weight_bytes(layout.shapes, layout.block, n, local)


def weight_bytes(
    t: TargetConfig, d: DrafterConfig | None, dtype, fp8=(None, None)
) -> tuple[int, int]:
    """(target, drafter) weight bytes of the whole model (all ranks); `fp8`: their FP8 layouts."""
    n = dtype_bytes(dtype)
    tw = target_param_count(t) * n - _fp8_saving(t, fp8[0], n, 1)
    dw = drafter_param_count(d) * n - _fp8_saving(d, fp8[1], n, 1) if d is not None else 0
    return tw, dw


def rank_weight_bytes(
    t: TargetConfig, d: DrafterConfig | None, tp: int, dtype, fp8=(None, None)
) -> int:
    """Weight bytes one tensor-parallel rank loads (target + drafter shards)."""
    if tp == 1:
        return sum(weight_bytes(t, d, dtype, fp8))
    n = dtype_bytes(dtype)
    local = dataclasses.replace(shard_target(t, tp), vocab_size=vocab_rows(t.vocab_size, tp))
    total = sum(weight_bytes(local, None if d is None else shard_drafter(d, tp), dtype))
    total -= _fp8_saving(t, fp8[0], n, tp)
    return total - (_fp8_saving(d, fp8[1], n, tp) if d is not None else 0)
