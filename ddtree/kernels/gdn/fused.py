"""Fused elementwise ops of a Gated DeltaNet layer, one Triton launch each instead of 6-10 PyTorch
kernels (a 27B hybrid AR step is launch-bound: ~3.5k kernels, 48 GDN layers):
  - `gdn_gating`: g = -exp(A_log) * softplus(a + dt_bias) (fp32), beta = sigmoid(b) (b's dtype);
  - `gated_rmsnorm`: RMSNorm over the value head dim (plain weight), times silu(z).
`reference.gdn_gating` / `reference.gated_rmsnorm` beside them are the oracles (and the CPU path);
the same switches as ddtree/kernels/fused pick the kernel (`fused.use_triton`: CUDA, or the CPU
interpreter with DDTREE_FUSED_KERNELS_INTERPRET=1; DDTREE_FORCE_REFERENCE_KERNELS=1 and autograd
keep the reference). Same math in fp32; the reductions' order differs from PyTorch's (rounding
level).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.kernels.fused import use_triton
from ddtree.kernels.gdn import reference

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

_TL = None
if triton is not None:
    from ddtree.kernels.tree_attention.tuning import patch_interpreter_index

    if triton.knobs.runtime.interpret:
        patch_interpreter_index()
    _TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _gating_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, N, H, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        h = i % H
        x = tl.load(a_ptr + i, mask=m, other=0.0).to(tl.float32)
        x = x + tl.load(dtb_ptr + h, mask=m, other=0.0).to(tl.float32)
        # softplus = max(x, 0) + log1p(exp(-|x|)); log1p by its series where the argument is tiny
        y = tl.exp(-tl.abs(x))
        lp = tl.where(y < 1e-4, y - 0.5 * y * y, tl.log(1.0 + y))
        sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + lp)  # torch's threshold
        a_log = tl.load(alog_ptr + h, mask=m, other=0.0).to(tl.float32)
        tl.store(g_ptr + i, -tl.exp(a_log) * sp, mask=m)
        bv = tl.load(b_ptr + i, mask=m, other=0.0).to(tl.float32)
        tl.store(beta_ptr + i, (1.0 / (1.0 + tl.exp(-bv))).to(beta_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _gated_rmsnorm_kernel(
        x_ptr, z_ptr, w_ptr, o_ptr, D, eps, HW_DT: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < D
        x = tl.load(x_ptr + row * D + c, mask=m, other=0.0)
        xf = x.to(tl.float32)
        var = tl.reduce(xf * xf, 0, tl.standard._sum_combine) / D
        h = (xf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)  # h.to(dtype), as the reference
        w = tl.load(w_ptr + c, mask=m, other=0.0)
        hw = (w.to(tl.float32) * h.to(tl.float32)).to(HW_DT)  # weight * h in their common dtype
        z = tl.load(z_ptr + row * D + c, mask=m, other=0.0).to(tl.float32)
        o = hw.to(tl.float32) * (z / (1.0 + tl.exp(-z)))
        tl.store(o_ptr + row * D + c, o.to(o_ptr.dtype.element_ty), mask=m)


def gdn_gating(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """`reference.gdn_gating` (a, b [..., Hv]) in one launch where the fused kernels run."""
    if triton is None or not use_triton(a, b, A_log, dt_bias) or a.shape != b.shape:
        return reference.gdn_gating(a, b, A_log, dt_bias)
    a, b = a.contiguous(), b.contiguous()
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(b)
    N, BLOCK = a.numel(), 1024
    if N:
        _gating_kernel[(triton.cdiv(N, BLOCK),)](
            a, b, A_log, dt_bias, g, beta, N, a.shape[-1], BLOCK=BLOCK
        )
    return g, beta


def gated_rmsnorm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`reference.gated_rmsnorm` (x, z [..., D], weight [D]) in one launch where the fused kernels
    run."""
    dtype = x.dtype
    ok = triton is not None and use_triton(x, z, weight) and x.shape == z.shape
    if not ok or dtype not in _TL or weight.dtype not in _TL:
        return reference.gated_rmsnorm(x, z, weight, eps)
    D = x.shape[-1]
    xr, zr = x.reshape(-1, D).contiguous(), z.reshape(-1, D).contiguous()
    out = torch.empty(xr.shape, dtype=dtype, device=x.device)
    hw_dt = _TL[torch.promote_types(weight.dtype, dtype)]
    if xr.shape[0]:
        _gated_rmsnorm_kernel[(xr.shape[0],)](
            xr, zr, weight.contiguous(), out, D, eps, HW_DT=hw_dt, BLOCK=triton.next_power_of_2(D)
        )
    return out.view(x.shape)
