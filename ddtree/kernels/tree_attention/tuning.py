"""Launch parameters for the split-KV kernel: tile configs per shape, resident programs, the split count."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ddtree.envs import env_flag

_SLOTS: dict[tuple, int] = {}
last_launch: dict = {}  # host-side record of the latest launch (config, num_splits, grid), for benchmarks


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # rows (query token x GQA head) per program
    block_n: int  # KV positions per tile
    num_warps: int = 4
    num_stages: int = 3
    tail_m: int = 16  # a last row block with <= tail_m rows runs at this size; 0 = off
    tree_n: int = 16  # KV positions per tile over the new tokens (masked tiles); 16, 32 or 64
    tail_split: bool = True  # with > 1 split, the last split does only the masked tiles (the new tokens)

    def __post_init__(self):
        if self.tail_m >= self.block_m:
            object.__setattr__(self, "tail_m", 0)


def default_config(rows_per_request: int, head_dim: int = 128, max_kv_len: int = 0) -> KernelConfig:
    """rows = q tokens x GQA group. tl.dot needs M >= 16, so decode rows (1 token x G heads) pad to 16.
    Register/shared-memory reports for sm_90 (bench/tree_attention_compile_report.py) of the tree (mask) variant:
    m64 n64 w4 s3 t16 219 regs (2 programs/SM), m64 n32 w4 s3 t16 152 regs + 49 KB (3/SM), m128 n64 w8 s2 t16 202
    regs (1/SM); none spill (the old kernel's tree-mask gather over 64-wide tiles spilled 224 B at 255 regs)."""
    block_n = 64 if head_dim <= 128 else 32
    if rows_per_request <= 16:
        return KernelConfig(16, block_n, 4, 3)
    if rows_per_request <= 32:
        return KernelConfig(32, block_n, 4, 3)
    # H200 sweep (bench/gpu_tree_attention.py, 65 nodes): n32 wins at 1k-8k (3 programs/SM hide latency), n64 at
    # 16k-32k (84 vs 98 us at 16k; fewer, longer tiles once every SM has many tiles to stream)
    return KernelConfig(64, 64 if max_kv_len >= 16384 and head_dim <= 128 else 32, 4, 3)


def ctas_per_sm(n_regs: int, shared_bytes: int, num_warps: int, regs_per_sm: int = 65536,
                shared_per_sm: int = 233472) -> int:
    """Resident programs per SM from the compiled kernel's registers and shared memory (Hopper limits)."""
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_smem = shared_per_sm // (shared_bytes + 1024)
    by_threads = 2048 // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def choose_num_splits(programs_per_split: int, max_kv_len: int, block_n: int, slots: int,
                      min_tiles: int = 4, max_splits: int = 64, target: float = 0.85,
                      tail_split: bool = False) -> int:
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
    if device.type != "cuda" or env_flag("TRITON_INTERPRET"):
        return 2 * 132
    key = (device.index,) + key
    if key not in _SLOTS:
        props = torch.cuda.get_device_properties(device)
        kernel = compile_fn()
        kernel._init_handles()
        ctas = ctas_per_sm(kernel.n_regs, kernel.metadata.shared, kernel.metadata.num_warps,
                           getattr(props, "regs_per_multiprocessor", 65536),
                           getattr(props, "shared_memory_per_multiprocessor", 233472))
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
