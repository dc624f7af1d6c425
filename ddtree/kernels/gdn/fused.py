"""Fused elementwise ops of a Gated DeltaNet layer, one Triton launch each instead of 6-10 PyTorch
kernels (a 27B hybrid AR step is launch-bound: ~3.5k kernels, 48 GDN layers):
  - `gdn_gating`: g = -exp(A_log) * softplus(a + dt_bias) (fp32), beta = sigmoid(b) (b's dtype)
    (`GateInputs.values`: where a state context's rule needs them);
  - `gated_rmsnorm`: RMSNorm over the value head dim (plain weight), times silu(z).
`reference.gdn_gating` / `reference.gated_rmsnorm` beside them are the oracles (and the CPU path);
the same switches as ddtree/kernels/fused pick the kernel (`fused.use_triton`: CUDA, or the CPU
interpreter with DDTREE_FUSED_KERNELS_INTERPRET=1; DDTREE_REFERENCE=kernels and autograd
keep the reference). Same math in fp32; the reductions' order differs from PyTorch's (rounding
level).
"""

from __future__ import annotations

from typing import NamedTuple

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
    from ddtree.kernels.pdl import gdc_wait, pdl_launch
    from ddtree.kernels.tree_attention.tuning import patch_interpreter_index

    if triton.knobs.runtime.interpret:
        patch_interpreter_index()
    _TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def decay_gate(a, dt_bias, a_log):
        """g = -exp(A_log) * softplus(a + dt_bias) from fp32 operands (shared with the one-token
        rule kernel, kernels/gdn/decode_triton.py, which gates inside)."""
        x = a + dt_bias
        # softplus = max(x, 0) + log1p(exp(-|x|)); log1p by its series where the argument is tiny
        y = tl.exp(-tl.abs(x))
        lp = tl.where(y < 1e-4, y - 0.5 * y * y, tl.log(1.0 + y))
        sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + lp)  # torch's threshold
        return -tl.exp(a_log) * sp

    @triton.jit
    def _gating_kernel(
        a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, N, H, sa, sb,
        BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # a, b: rows of H with row strides sa / sb (slices of the fused in_proj output: no copy)
        if PDL:
            gdc_wait()  # before any memory access: the kernel ahead has ended (kernels/pdl.py)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        t = i // H
        h = i % H
        x = tl.load(a_ptr + t * sa + h, mask=m, other=0.0).to(tl.float32)
        dtb = tl.load(dtb_ptr + h, mask=m, other=0.0).to(tl.float32)
        a_log = tl.load(alog_ptr + h, mask=m, other=0.0).to(tl.float32)
        tl.store(g_ptr + i, decay_gate(x, dtb, a_log), mask=m)
        bv = tl.load(b_ptr + t * sb + h, mask=m, other=0.0).to(tl.float32)
        tl.store(beta_ptr + i, (1.0 / (1.0 + tl.exp(-bv))).to(beta_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _gated_rmsnorm_kernel(
        x_ptr,
        z_ptr,
        w_ptr,
        o_ptr,
        D,
        H,
        sx_t,
        sx_h,
        sz_t,
        sz_h,
        eps,
        HW_DT: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # row = (token, head); x / z rows at their own strides (z: a slice of the fused in_proj)
        if PDL:
            gdc_wait()  # before any memory access: the kernel ahead has ended (kernels/pdl.py)
        row = tl.program_id(0).to(tl.int64)
        t, hh = row // H, row % H
        c = tl.arange(0, BLOCK)
        m = c < D
        x = tl.load(x_ptr + t * sx_t + hh * sx_h + c, mask=m, other=0.0)
        xf = x.to(tl.float32)
        var = tl.reduce(xf * xf, 0, tl.standard._sum_combine) / D
        h = (xf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)  # h.to(dtype), as the reference
        w = tl.load(w_ptr + c, mask=m, other=0.0)
        hw = (w.to(tl.float32) * h.to(tl.float32)).to(HW_DT)  # weight * h in their common dtype
        z = tl.load(z_ptr + t * sz_t + hh * sz_h + c, mask=m, other=0.0).to(tl.float32)
        o = hw.to(tl.float32) * (z / (1.0 + tl.exp(-z)))
        tl.store(o_ptr + row * D + c, o.to(o_ptr.dtype.element_ty), mask=m)


def _rows(t: Tensor, inner: int) -> Tensor:
    """t [..., *inner dims] as [rows, *inner dims] with a unit last stride: a view where strides
    allow (slices of a fused projection), else a copy."""
    t = t.reshape(-1, *t.shape[t.dim() - inner :])
    return t if t.stride(-1) == 1 else t.contiguous()


def gdn_gating(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """`reference.gdn_gating` (a, b [..., Hv], any row stride) in one launch where the fused kernels
    run; g and beta come back contiguous."""
    if triton is None or not use_triton(a, b, A_log, dt_bias) or a.shape != b.shape:
        # contiguous: PyTorch's CPU elementwise kernels round differently on strided inputs
        # (scalar vs vectorised exp), and the CPU path must give the unfused layer's numbers
        return reference.gdn_gating(a.contiguous(), b.contiguous(), A_log, dt_bias)
    shape, H = a.shape, a.shape[-1]
    ar, br = _rows(a, 1), _rows(b, 1)
    g = torch.empty(shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(shape, dtype=b.dtype, device=b.device)
    N, BLOCK = a.numel(), 1024
    if N:
        _gating_kernel[(triton.cdiv(N, BLOCK),)](
            ar, br, A_log, dt_bias, g, beta, N, H, ar.stride(0), br.stride(0), BLOCK=BLOCK,
            **pdl_launch(a.device),
        )  # fmt: skip
    return g, beta


class GateInputs(NamedTuple):
    """A GDN layer's decay gate as its inputs, handed to the state context's rule: a, b [T, Hv]
    (strided slices of the in_proj output), A_log, dt_bias [Hv]. `values()` = `gdn_gating` (one
    launch where the fused kernels run) for the rules that take g / beta; the one-token in-place
    rule gates inside its own kernel instead (`dispatch.decode_step`): a launch fewer per layer."""

    a: Tensor
    b: Tensor
    A_log: Tensor
    dt_bias: Tensor

    def values(self) -> tuple[Tensor, Tensor]:
        return gdn_gating(self.a, self.b, self.A_log, self.dt_bias)

    def inputs(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(a, b, A_log, dt_bias), for a kernel that gates inside (`dispatch.decode_step` asks
        for this method, not the class: a reloaded module's GateInputs is another class)."""
        return (self.a, self.b, self.A_log, self.dt_bias)


def gated_rmsnorm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`reference.gated_rmsnorm` (x, z [..., H, D] at any token / head strides, weight [D]) in one
    launch where the fused kernels run; the output is contiguous."""
    dtype = x.dtype
    ok = triton is not None and use_triton(x, z, weight) and x.shape == z.shape and x.dim() >= 2
    if not ok or dtype not in _TL or weight.dtype not in _TL:
        return reference.gated_rmsnorm(x, z.contiguous(), weight, eps)  # as in gdn_gating
    H, D = x.shape[-2], x.shape[-1]
    xr, zr = _rows(x, 2), _rows(z, 2)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    hw_dt = _TL[torch.promote_types(weight.dtype, dtype)]
    R = xr.shape[0] * H
    if R:
        _gated_rmsnorm_kernel[(R,)](
            xr,
            zr,
            weight.contiguous(),
            out,
            D,
            H,
            xr.stride(0),
            xr.stride(1),
            zr.stride(0),
            zr.stride(1),
            eps,
            HW_DT=hw_dt,
            BLOCK=triton.next_power_of_2(D),
            **pdl_launch(x.device),
        )
    return out
