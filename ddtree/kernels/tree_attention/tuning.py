"""Launch parameters for the split-KV kernel: tile configs per shape and the split count (pure Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # rows (query token x GQA head) per program
    block_n: int  # KV positions per tile
    num_warps: int = 4
    num_stages: int = 3
    tail_m: int = 16  # a last row block with <= tail_m rows runs at this size; 0 = off

    def __post_init__(self):
        if self.tail_m >= self.block_m:
            object.__setattr__(self, "tail_m", 0)


def default_config(rows_per_request: int, head_dim: int = 128) -> KernelConfig:
    """rows = q tokens x GQA group. tl.dot needs M >= 16, so decode rows (1 token x G heads) pad to 16."""
    block_n = 64 if head_dim <= 128 else 32
    if rows_per_request <= 16:
        return KernelConfig(16, block_n, 4, 3)
    if rows_per_request <= 32:
        return KernelConfig(32, block_n, 4, 3)
    return KernelConfig(64, block_n, 4, 3)


def ctas_per_sm(n_regs: int, shared_bytes: int, num_warps: int, regs_per_sm: int = 65536,
                shared_per_sm: int = 233472) -> int:
    """Resident programs per SM from the compiled kernel's registers and shared memory (Hopper limits)."""
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_smem = shared_per_sm // (shared_bytes + 1024)
    by_threads = 2048 // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def choose_num_splits(programs_per_split: int, max_kv_len: int, block_n: int, slots: int,
                      min_tiles: int = 4, max_splits: int = 64, target: float = 0.85) -> int:
    """Fewest splits whose grid fills the GPU's resident slots (SMs x programs per SM) to >= `target` of its
    last wave, with no split shorter than `min_tiles` tiles; otherwise the best-filling count."""
    tiles = -(-max(max_kv_len, 1) // block_n)
    cap = max(1, min(max_splits, tiles // min_tiles))
    best, best_fill = 1, 0.0
    for s in range(1, cap + 1):
        waves = programs_per_split * s / slots
        fill = waves / math.ceil(waves)
        if fill >= target:
            return s
        if fill > best_fill + 1e-9:
            best, best_fill = s, fill
    return best
