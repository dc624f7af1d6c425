"""Triton kernels for the decoder layer's elementwise work: residual add + RMSNorm, per-head q/k RMSNorm + RoPE,
SiLU-and-mul, the gated attention's sigmoid output gate. Same contracts as `reference.py`; they emulate its
roundings step by step (every op that PyTorch runs in the model dtype is rounded to it here too), so they differ
from the reference only by the fp32 reduction order and the device's rsqrt/exp.

Launch shapes depend only on tensor shapes and no call syncs with the host: CUDA-graph capturable (launch once
before capturing: the first call compiles). Call these through `ddtree.kernels.fused` (the dispatch), which
checks the layouts they take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree import envs
from ddtree.kernels.pdl import gdc_wait, pdl_launch

# TRITON_INTERPRET is read when a kernel is decorated; the dispatch reloads this module when it needs the other mode
_decorated_interpreted = envs.TRITON_INTERPRET.on()


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    N,
    x_rs,
    r_rs,
    out_rs,
    sum_rs,
    eps,
    HAS_RES: tl.constexpr,
    OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # before any load or store: the kernel ahead has ended (kernels/pdl.py)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_rs + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * r_rs + cols, mask=m, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(sum_ptr + row * sum_rs + cols, s, mask=m)
        h = s.to(tl.float32)
    else:
        h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    n = h * rstd
    if OFFSET:
        out = n * (1.0 + w)
    else:
        out = w * n.to(dt).to(tl.float32)
    tl.store(out_ptr + row * out_rs + cols, out.to(out_ptr.dtype.element_ty), mask=m)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., N] with unit stride in the last dim; returns (normed, x + residual) (x itself when
    residual is None)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    out_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if residual is None:
        r2, s, s2 = x2, x, x2
    else:
        r2 = residual.reshape(-1, n)
        s = torch.empty_like(x)
        s2 = s.view(-1, n)
    if rows:
        block = triton.next_power_of_2(n)
        _add_rmsnorm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            s2,
            n,
            x2.stride(0),
            r2.stride(0),
            n,
            n,
            eps,
            HAS_RES=residual is not None,
            OFFSET=offset,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
            **pdl_launch(x.device),
        )
    return out, s


@triton.jit
def _norm_scale(x, rstd, w, dt: tl.constexpr, OFFSET: tl.constexpr):
    n = x * rstd[:, None]
    if OFFSET:
        return (n * (1.0 + w[None, :])).to(dt).to(tl.float32)
    return (w[None, :] * n.to(dt).to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def _norm_rope_tile(
    x_ptr,
    o_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    t,
    h0,
    H,
    x_rs,
    x_hs,
    o_rs,
    o_hs,
    c_rs,
    eps,
    D: tl.constexpr,
    RD: tl.constexpr,
    HB: tl.constexpr,
    OFFSET: tl.constexpr,
):
    dt = o_ptr.dtype.element_ty
    heads = h0 + tl.arange(0, HB)
    cols = tl.arange(0, D)
    HALF: tl.constexpr = RD // 2
    m = (heads < H)[:, None] & (cols < D)[None, :]
    base = x_ptr + t * x_rs + heads[:, None] * x_hs
    x = tl.load(base + cols[None, :], mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    w = tl.load(w_ptr + cols).to(tl.float32)
    n = _norm_scale(x, rstd, w, dt, OFFSET)
    in_rot = cols < RD
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
    xp = tl.load(base + partner[None, :], mask=m & in_rot[None, :], other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
    rot = _norm_scale(xp, rstd, wp, dt, OFFSET)
    rot = tl.where((cols < HALF)[None, :], -rot, rot)
    c = tl.load(cos_ptr + t * c_rs + cols, mask=in_rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * c_rs + cols, mask=in_rot, other=0.0).to(tl.float32)
    a = (n * c[None, :]).to(dt).to(tl.float32)
    b = (rot * s[None, :]).to(dt).to(tl.float32)
    out = tl.where(in_rot[None, :], a + b, n)
    tl.store(o_ptr + t * o_rs + heads[:, None] * o_hs + cols[None, :], out.to(dt), mask=m)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    HQ,
    HK,
    NQP,
    q_rs,
    q_hs,
    k_rs,
    k_hs,
    qo_rs,
    ko_rs,
    c_rs,
    eps,
    D: tl.constexpr,
    RD: tl.constexpr,
    HB: tl.constexpr,
    OFFSET: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
    t = tl.program_id(0)
    pid = tl.program_id(1)
    if pid < NQP:
        _norm_rope_tile(
            q_ptr,
            qo_ptr,
            qw_ptr,
            cos_ptr,
            sin_ptr,
            t,
            pid * HB,
            HQ,
            q_rs,
            q_hs,
            qo_rs,
            D,
            c_rs,
            eps,
            D,
            RD,
            HB,
            OFFSET,
        )
    else:
        _norm_rope_tile(
            k_ptr,
            ko_ptr,
            kw_ptr,
            cos_ptr,
            sin_ptr,
            t,
            (pid - NQP) * HB,
            HK,
            k_rs,
            k_hs,
            ko_rs,
            D,
            c_rs,
            eps,
            D,
            RD,
            HB,
            OFFSET,
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., H, D] -> a [rows, H, D] view (a copy only when the leading dims do not flatten)."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def qk_norm_rope(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    q_weight,
    k_weight,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    offset: bool = False,
):
    """q [..., T, Hq, D], k [..., T, Hkv, D] (unit stride in D; may be column slices of a fused projection) ->
    new contiguous (q, k). cos/sin [..., T, rd] with unit stride; D a power of two."""
    ref = k if k is not None else q
    D = ref.shape[-1]
    rd = cos.shape[-1]
    c2, s2 = cos.reshape(-1, rd), sin.reshape(-1, rd)
    T = c2.shape[0]
    hb = max(1, min(16, 2048 // D))
    outs, args = [], []
    for x in (q, k):
        if x is None:
            outs.append(None)
            args.append(None)
            continue
        x3 = _rows(x)
        o = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        outs.append(o)
        args.append((x3, o, x3.shape[1]))
    qa = args[0] if args[0] is not None else args[1]
    ka = args[1] if args[1] is not None else args[0]
    nqp = triton.cdiv(qa[2], hb) if args[0] is not None else 0
    nkp = triton.cdiv(ka[2], hb) if args[1] is not None else 0
    qw = q_weight if q is not None else k_weight
    kw = k_weight if k is not None else q_weight
    if T and nqp + nkp:
        _qk_norm_rope_kernel[(T, nqp + nkp)](
            qa[0],
            ka[0],
            qa[1],
            ka[1],
            qw,
            kw,
            c2,
            s2,
            qa[2],
            ka[2],
            nqp,
            qa[0].stride(0),
            qa[0].stride(1),
            ka[0].stride(0),
            ka[0].stride(1),
            qa[2] * D,
            ka[2] * D,
            c2.stride(0),
            eps,
            D=D,
            RD=rd,
            HB=hb,
            OFFSET=offset,
            num_warps=4,
            **pdl_launch(c2.device),
        )
    return outs[0], outs[1]


@triton.jit
def _silu_mul_kernel(x_ptr, o_ptr, N, x_rs, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    dt = o_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * x_rs + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_rs + N + cols, mask=m, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(o_ptr + row * N + cols, (a * u).to(dt), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (unit stride in the last dim) -> silu(gate) * up [..., I], contiguous."""
    n = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * n)
    out = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
    rows = x2.shape[0]
    if rows and n:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](
            x2, out, n, x2.stride(0), BLOCK=block, num_warps=4, **pdl_launch(x2.device)
        )
    return out


@triton.jit
def _sigmoid_gate_kernel(
    x_ptr, g_ptr, o_ptr, D, H, sx_t, sx_h, sg_t, sg_h, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    # row = (token, head); the gate is read in place (a strided half of the q projection)
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    t, h = row // H, row % H
    cols = tl.arange(0, BLOCK)
    m = cols < D
    dt = o_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * sx_t + h * sx_h + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * sg_t + h * sg_h + cols, mask=m, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # torch.sigmoid rounds to the dtype
    tl.store(o_ptr + row * D + cols, (x * s).to(dt), mask=m)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate [T, H, D] (any token / head strides, unit last stride) -> x * sigmoid(gate) [T, H, D],
    contiguous."""
    T, H, D = x.shape
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T and H and D:
        _sigmoid_gate_kernel[(T * H,)](
            x,
            gate,
            out,
            D,
            H,
            x.stride(0),
            x.stride(1),
            gate.stride(0),
            gate.stride(1),
            BLOCK=triton.next_power_of_2(D),
            num_warps=4 if D >= 512 else 1,
            **pdl_launch(x.device),
        )
    return out
