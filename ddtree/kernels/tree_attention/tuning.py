"""Launch parameters for the split-KV kernel: tile configs per shape, resident programs, the split count."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ddtree import envs

_SLOTS: dict[tuple, int] = {}  # cache: resident programs per compiled variant (filled once per key)


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # rows (query token x GQA head) per program
    block_n: int  # KV positions per tile
    num_warps: int = 4
    num_stages: int = 3
    tail_m: int = 16  # a last row block with <= tail_m rows runs at this size; 0 = off
    tree_n: int = 16  # KV positions per tile over the new tokens (masked tiles); 16, 32 or 64
    tail_split: bool = (
        True  # with > 1 split, the last split does only the masked tiles (the new tokens)
    )
    combine_warps: int = (
        1  # warps per program of the split-merging kernel (a short reduction: more warps only wait)
    )

    def __post_init__(self):
        if self.tail_m >= self.block_m:
            object.__setattr__(self, "tail_m", 0)


def default_config(rows_per_request: int, head_dim: int = 128, max_kv_len: int = 0) -> KernelConfig:
    """rows = q tokens x GQA group. tl.dot needs M >= 16, so decode rows (1 token x G heads) pad to 16.
    num_stages 5: the K/V tile load hangs off the block-table load, which takes a pipeline stage of its own; at
    3 or 4 stages Triton 3.6 keeps one K/V tile in flight and waits for it at the top of every tile (the load
    latency is exposed once per tile), at 5 it keeps 2-3 in flight. The choices are the winners of the H200
    sweep in studies/gpu_tree_attention.py (BENCHMARKS.md); registers / shared memory per config on sm_90 are in
    studies/tree_attention_compile_report.py."""
    small_head = head_dim <= 128
    if rows_per_request <= 16:  # decode: memory-bound; 128-wide tiles halve the per-tile latencies
        block_n = (128 if max_kv_len >= 8192 else 64) if small_head else 32
        return KernelConfig(16, block_n, 4, 5, tail_split=False)
    if rows_per_request <= 32:
        return KernelConfig(32, 64 if small_head else 32, 4, 5)
    return KernelConfig(64, 64 if small_head else 32, 4, 5)


def wide_head_candidates(rows_per_request: int) -> list[KernelConfig]:
    """Tile configs for head dim 256 that studies/gpu_tree_attention.py --shape qwen3.6-27b times and
    tests/gpu/test_tree_attention_gpu.py checks against the reference (besides `default_config`'s).
    A K + V tile of 64 positions is 64 KB there, so 64-wide tiles fit at most 3 stages in the 227 KB
    of shared memory (studies/tree_attention_compile_report.py: registers, spills, programs per SM)."""
    if rows_per_request <= 16:
        return [
            KernelConfig(16, 64, 4, 3, tail_split=False),
            KernelConfig(16, 64, 4, 2, tail_split=False),
            KernelConfig(16, 32, 4, 3, tail_split=False),
            KernelConfig(16, 64, 8, 3, tail_split=False),
            KernelConfig(16, 16, 4, 6, tail_split=False),
        ]
    return [
        KernelConfig(64, 32, 4, 3),
        KernelConfig(64, 64, 4, 3),
        KernelConfig(64, 64, 8, 3),
        KernelConfig(64, 32, 8, 4),
        KernelConfig(32, 32, 4, 5),
        KernelConfig(64, 16, 4, 6),
        KernelConfig(128, 32, 8, 3),
    ]


def split_min_tiles(rows_per_request: int) -> int:
    """Fewest context tiles per split: tree / chain rows write a [rows, D] fp32 partial per split, so short
    splits cost more in partials and merging than they gain in parallelism (docs/design-numbers.md)."""
    return 4 if rows_per_request <= 16 else 6


def ctas_per_sm(
    n_regs: int,
    shared_bytes: int,
    num_warps: int,
    regs_per_sm: int = 65536,
    shared_per_sm: int = 233472,
) -> int:
    """Resident programs per SM from the compiled kernel's registers and shared memory (Hopper limits)."""
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_smem = shared_per_sm // (shared_bytes + 1024)
    by_threads = 2048 // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def choose_num_splits(
    programs_per_split: int,
    max_kv_len: int,
    block_n: int,
    slots: int,
    min_tiles: int = 4,
    max_splits: int = 64,
    target: float = 0.85,
    tail_split: bool = False,
) -> int:
    """Fewest splits whose grid fills the GPU's resident slots (SMs x programs per SM) to >= `target` of its
    last wave, with no split shorter than `min_tiles` tiles; otherwise the best-filling count. With
    `tail_split` (the kernel's last split then does only the new tokens' masked tiles) the count is chosen for
    the context tiles and one split is added, unless one split suffices."""
    tiles = -(-max(max_kv_len, 1) // block_n)
    cap = max(1, min(max_splits - int(tail_split), tiles // min_tiles))
    best, best_fill = 1, 0.0
    for s in range(1, cap + 1):
        waves = programs_per_split * s / slots
        fill = waves / math.ceil(waves)
        if fill >= target:
            best = s
            break
        if fill > best_fill + 1e-9:
            best, best_fill = s, fill
    return best + 1 if tail_split and best > 1 else best


def resident_slots(device: torch.device, key: tuple, compile_fn: Callable) -> int:
    """SMs x resident programs per SM for the compiled kernel variant `key`; `compile_fn` returns Triton's
    compiled kernel (called once per key). Off the GPU (interpreter) a nominal H200: 132 SMs x 2."""
    if device.type != "cuda" or envs.TRITON_INTERPRET.on():
        return 2 * 132
    key = (device.index,) + key
    if key not in _SLOTS:
        props = torch.cuda.get_device_properties(device)
        kernel = compile_fn()
        kernel._init_handles()
        ctas = ctas_per_sm(
            kernel.n_regs,
            kernel.metadata.shared,
            kernel.metadata.num_warps,
            getattr(props, "regs_per_multiprocessor", 65536),
            getattr(props, "shared_memory_per_multiprocessor", 233472),
        )
        _SLOTS[key] = props.multi_processor_count * ctas
    return _SLOTS[key]


def patch_interpreter_index() -> None:
    """Triton 3.6's CPU interpreter converts 1-element scalars with int(ndarray), an error on numpy >= 2.4;
    loops with tensor bounds need it. Only called under TRITON_INTERPRET=1."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_ddtree", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._ddtree = True
    interpreter._patch_lang_tensor = patched
