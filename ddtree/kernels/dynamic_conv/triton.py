"""DFlash2's grouped dynamic causal convolution as one Triton launch (contract: `reference.py`).

One program per (row, channel tile): the row's k taps reach back at most k - 1 rows inside its
block, so every output is a short fp32 dot over taps, rounded once. Launch shapes depend only on
tensor shapes (CUDA-graph capturable; the first call compiles, so launch once before capturing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree import envs

# TRITON_INTERPRET is read when a kernel is decorated; the dispatch reloads this module when it
# needs the other mode
_decorated_interpreted = envs.TRITON_INTERPRET.on()


@triton.jit
def _dynamic_conv_kernel(
    x_ptr,
    dyn_ptr,
    base_ptr,
    y_ptr,
    H,
    x_rs,
    dyn_rs,
    y_rs,
    BLOCK_SIZE: tl.constexpr,
    TAPS: tl.constexpr,
    GROUP: tl.constexpr,
    G: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    m = cols < H
    group = cols // GROUP
    pos = row % BLOCK_SIZE
    acc = tl.zeros([TILE], dtype=tl.float32)
    for o in tl.static_range(TAPS):
        if o < BLOCK_SIZE:
            ok = m & (pos >= o)
            x = tl.load(x_ptr + (row - o) * x_rs + cols, mask=ok, other=0.0).to(tl.float32)
            b = tl.load(base_ptr + o * H + cols, mask=m, other=0.0).to(tl.float32)
            d = tl.load(dyn_ptr + row * dyn_rs + o * G + group, mask=m, other=0.0).to(tl.float32)
            acc += (b + d) * x
    tl.store(y_ptr + row * y_rs + cols, acc.to(y_ptr.dtype.element_ty), mask=m)


def dynamic_conv(
    x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, group_size: int, block_size: int
) -> torch.Tensor:
    """`reference.dynamic_conv_reference`'s contract; x and dyn with unit last stride (rows may be
    strided: a view of the kernel projection's output)."""
    H = x.shape[-1]
    k = base.shape[0]
    x2, d2 = x.reshape(-1, H), dyn.reshape(-1, dyn.shape[-1])
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    tile = min(1024, triton.next_power_of_2(H))
    grid = (x2.shape[0], triton.cdiv(H, tile))
    _dynamic_conv_kernel[grid](
        x2,
        d2,
        base.contiguous(),
        y,
        H,
        x2.stride(0),
        d2.stride(0),
        y.stride(0),
        BLOCK_SIZE=block_size,
        TAPS=k,
        GROUP=group_size,
        G=H // group_size,
        TILE=tile,
    )
    return y.view(x.shape)
