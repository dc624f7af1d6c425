"""One-token gated delta rule in place: the GDN step of a one-node round (AR, and auto's width-1
rounds) straight on the state pool's committed rows.

Why: a one-node round run as a tree verify + commit reads the fp32 state three times per GDN layer
(the chunk-form solve and output kernels, then no_buffer's replay of the root from the stash; or
extra_buffer's node-state write and copy) over ~5 launches. Here the state is read and written once,
in one launch, and the round's commit leaves the GDN state alone (`HybridStatePool.in_place`).

Grid (b, Hv, cdiv(dv, BV)). A program owns the [dk, BV] column tile of value head h of request i's
row ssm[rows[i], h]: it loads the tile, l2-normalises q / k of key head h // (Hv / Hk) (GVA),
scales q by dk**-0.5, and runs `reference.gated_delta_rule_recurrent` for T = 1:
    S <- e^g S,   u = beta (v - S^T k),   S <- S + k u^T,   o = S^T q
then stores the tile back in the pool's dtype (fp32, or bf16 / fp16 under --mamba-ssm-dtype) and o.
Column tiles are independent (S^T k and S^T q reduce over dk only) and no two programs of one
launch share a tile of a live row, so reading and writing the row in place is race-free. Padded
rows of a CUDA graph point at the pool's scratch row; several programs then write the same
scratch tiles, whose contents nobody reads (finite whatever the interleaving: |e^g (I - beta k
k^T)| <= 1). No host syncs: capturable.

With the raw gate (`gate=(a, b, A_log, dt_bias)`), g = -exp(A_log) softplus(a + dt_bias) and
beta = sigmoid(b) (rounded to b's dtype, as `fused.gdn_gating` stores it) are computed inside
(`fused.decay_gate`): the layer's separate gating launch is saved.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    from ddtree.kernels.gdn.fused import decay_gate

    # tree_chunk_triton's _sum: tl.reduce (the interpreter cannot call tl.sum); its import also
    # patches the interpreter's indexing
    from ddtree.kernels.gdn.tree_chunk_triton import _sum
    from ddtree.kernels.pdl import gdc_wait, pdl_launch

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, ssm_ptr, rows_ptr, o_ptr,
        sq, sk, sv, sg, sb, s_r, s_h, GROUP, DK, DV, scale,
        BK: tl.constexpr, BV: tl.constexpr, RAW_GATE: tl.constexpr, L2NORM: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_wait()  # before any memory access: the kernel ahead has ended (kernels/pdl.py)
        i = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        hv = tl.num_programs(1)
        hk = h // GROUP
        rk = tl.arange(0, BK)
        mk = rk < DK
        rv = tl.program_id(2) * BV + tl.arange(0, BV)
        mv = rv < DV
        row = tl.load(rows_ptr + i).to(tl.int64)
        sp = ssm_ptr + row * s_r + h * s_h + rk[:, None] * DV + rv[None, :]
        m2 = mk[:, None] & mv[None, :]
        S = tl.load(sp, mask=m2, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + i * sq + hk * DK + rk, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + i * sk + hk * DK + rk, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + i * sv + h * DV + rv, mask=mv, other=0.0).to(tl.float32)
        if L2NORM:
            k = k / tl.sqrt(_sum((k * k)[None, :], 1) + 1e-6)
            q = q / tl.sqrt(_sum((q * q)[None, :], 1) + 1e-6)
        q = q * scale
        if RAW_GATE:  # g_ptr / beta_ptr hold the gate's inputs a / b
            a = tl.load(g_ptr + i * sg + h).to(tl.float32)
            dtb = tl.load(dtb_ptr + h).to(tl.float32)
            g = decay_gate(a, dtb, tl.load(alog_ptr + h).to(tl.float32))
            b = tl.load(beta_ptr + i * sb + h)
            beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
            beta = beta.to(beta_ptr.dtype.element_ty).to(tl.float32)
        else:
            g = tl.load(g_ptr + i * sg + h).to(tl.float32)
            beta = tl.load(beta_ptr + i * sb + h).to(tl.float32)
        S = S * tl.exp(g)
        u = beta * (v - _sum(S * k[:, None], 0))
        S = S + k[:, None] * u[None, :]
        o = _sum(S * q[:, None], 0)
        tl.store(sp, S.to(ssm_ptr.dtype.element_ty), mask=m2)
        tl.store(o_ptr + (i * hv + h) * DV + rv, o.to(o_ptr.dtype.element_ty), mask=mv)


def _rows(t: Tensor, name: str) -> Tensor:
    """t [b, H, d] (or [b, H]) with contiguous heads: a strided slice of the layer's projections
    passes as it is (only its token stride varies)."""
    inner = t.shape[2] if t.dim() == 3 else 1
    if t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) != inner):
        raise ValueError(f"{name}: heads must be contiguous within a token (got {t.stride()})")
    return t


def gated_delta_decode_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gate: tuple[Tensor, ...],
    ssm: Tensor,
    rows: Tensor,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
) -> Tensor:
    """In place: ssm [R, Hv, dk, dv] rows `rows` [b] take one step of the rule; returns o [b, Hv,
    dv] in v's dtype. q, k [b, Hk, dk], v [b, Hv, dv] (token rows at any stride, heads contiguous);
    gate = (g fp32, beta) [b, Hv], or the raw (a, b [b, Hv], A_log, dt_bias [Hv]) gated inside."""
    b, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    if ssm.stride(-1) != 1 or ssm.stride(-2) != dv or ssm.stride(-3) != dk * dv:
        raise ValueError("ssm must be contiguous over its last three dims [Hv, dk, dv]")
    q, k, v = _rows(q, "q"), _rows(k, "k"), _rows(v, "v")
    raw = len(gate) == 4
    g, beta = _rows(gate[0], "g"), _rows(gate[1], "beta")
    a_log, dt_bias = (gate[2], gate[3]) if raw else (g, g)  # dummy pointers when unused
    o = torch.empty(b, hv, dv, dtype=v.dtype, device=v.device)
    if not b:
        return o
    BK = max(16, triton.next_power_of_2(dk))
    # the commit kernel's tile: [dk, 32] per program, 4 warps (tested there at the 27B shape)
    BV = block_v or min(32, max(16, triton.next_power_of_2(dv)))
    _decode_kernel[(b, hv, triton.cdiv(dv, BV))](
        q, k, v, g, beta, a_log.contiguous(), dt_bias.contiguous(), ssm, rows.contiguous(), o,
        q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
        ssm.stride(0), ssm.stride(1), hv // hk, dk, dv,
        dk**-0.5 if scale is None else scale,
        BK=BK, BV=BV, RAW_GATE=raw, L2NORM=bool(use_qk_l2norm), num_warps=num_warps,
        **pdl_launch(v.device),
    )  # fmt: skip
    return o
