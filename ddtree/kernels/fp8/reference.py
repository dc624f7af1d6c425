"""Block-FP8 linear algebra in plain PyTorch: the numbers every FP8 kernel must reproduce.

A block-FP8 weight W [N, K] is float8_e4m3fn values `q` and float32 scales `s` [ceil(N / g), ceil(K /
bk)]: W[n, k] = q[n, k] * s[n // g, k // bk], with g the scale's row group (the checkpoint's bn, or 1
when a fused projection's parts are not whole blocks: `models/quant.py` expands their scales to one
row each, exactly). An activation X [M, K] is quantized per token in groups of bk columns at run
time: scale = max(|x| over the group, EPS) / 448, q = round-to-nearest-even(x / scale) in e4m3 (the
value is <= 448 by construction; clamped anyway). The product dequantizes both and multiplies in
float32 (`block_matmul`); the kernels accumulate each bk-column block's fp8 dot in float32 and scale
it by the two scales, which is the same sum in another order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-10  # an all-zero group gets a tiny scale (its values quantize to 0), never a division by 0


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """max(amax, EPS) / 448, the IEEE quotient on every device: CUDA's division by a Python scalar
    multiplies by its reciprocal (off by an ulp in about half the cases, which moves the fp8
    values of the whole group), so the divisor is a tensor."""
    amax = amax.clamp(min=EPS)
    return amax / torch.full_like(amax, FP8_MAX)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32)."""
    M, K = x.shape
    xf = F.pad(x.float(), (0, -K % group)).view(M, -1, group)
    scale = _scale(xf.abs().amax(-1))
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(M, -1)[:, :K], scale


def expand_scales(scale: torch.Tensor, rows: int, cols: int, group_n: int, group_k: int):
    """[ceil(rows / group_n), ceil(cols / group_k)] -> [rows, cols] (each block's scale per element)."""
    return scale.repeat_interleave(group_n, 0)[:rows].repeat_interleave(group_k, 1)[:, :cols]


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int) -> torch.Tensor:
    """The float32 values of a block-FP8 tensor."""
    return q.float() * expand_scales(scale.float(), *q.shape, group_n, group_k)


def quantize_weight(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], float32 scales [ceil(N / bn), ceil(K / bk)]): each block's
    scale is its abs-max / 448 (how Qwen's and DeepSeek's checkpoints are made)."""
    bn, bk = block
    N, K = w.shape
    wf = F.pad(w.float(), (0, -K % bk, 0, -N % bn))
    blocks = wf.view(_cdiv(N, bn), bn, _cdiv(K, bk), bk)
    scale = _scale(blocks.abs().amax(dim=(1, 3)))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(wf.shape)[:N, :K].contiguous(), scale


def block_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    group_n: int,
    group_k: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantized xq [M, K] @ dequantized w [N, K]^T in float32 (+ bias), cast to out_dtype."""
    x = dequantize(xq, x_scale, 1, group_k)
    y = F.linear(x, dequantize(w, w_scale, group_n, group_k))
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    group_n: int,
    group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] in the model dtype -> [M, N] in it: activations quantized per token, then
    `block_matmul`."""
    xq, xs = group_quant(x, group_k)
    return block_matmul(xq, xs, w, w_scale, group_n, group_k, x.dtype, bias)
