"""The chunk-form tree rule (`tree_chunk.py`) in two launches: the solve once per head, then outputs.

`tree_chunk_triton` (one launch) solves (I + L) U = R per column tile: every (request, head) program
of its grid repeats the q/k dots and runs `max(depth - r)` dependent [BT, BT] @ [BT, BV] rounds, with
~250 registers (one program per SM). Here the solve leaves the column tiles. With the same block
notation (node 0 out of the block, rows i = 1..n-1, a = e^G ik, c = d0 ik (K k_0),
e = e^G iq, f = d0 iq (Q k_0); ik / iq the rows' inverse norms, d0 the root column of Γ):
    R = diag(β) X,  X = V - a ⊙ K S0 - c u_0ᵀ        U = (I + L)⁻¹ diag(β) X
    O = e ⊙ Q S0 + f u_0ᵀ + A U = e ⊙ Q S0 + f u_0ᵀ + M X,   M = A (I + L)⁻¹ diag(β)
1. `_solve_kernel`, grid (b, Hv): the q/k dots over dk, the tree's decays and gates (and the
   no_buffer stash writes of g / beta), T = (I + L)⁻¹ = Σ_j (-L)^j by repeated squaring (L is
   nilpotent along the tree: powers past `max(depth - r)` vanish, so ⌈log2(rounds + 1)⌉ - 1 steps
   of two [BT, BT] dots), M = A T diag(β) and the row coefficients a, c, e, f and the root's, into
   a per-(request, head) scratch.
2. `_output_kernel`, grid (b, Hv, cdiv(dv, BV)): K S0 and Q S0 over dk, u_0 and o_0, then one
   [BT, BT] @ [BT, BV] dot for the block's outputs. 225 registers at 4 warps: two programs per SM
   (studies/gdn_tree_chunk_compile_report.py --split). Folding K S0 into the solve's scratch instead
   (Z = e Q - (M a) K, outputs Z S0 + M V: 140 registers, three per SM) measured 5-15% slower on
   the H200, the longer solve outweighing it.
Same inputs, outputs and padding rules as `tree_chunk_triton` (its wrapper's checks are shared);
the solve differs in rounding only (a product of powers instead of forward rounds).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.kernels.gdn.tree_chunk_triton import (
    block_rows,
    checked_inputs,
    input_precision,
    pick_bv,
    triton,
)

if triton is not None:
    import triton.language as tl

    from ddtree.kernels.gdn.tree_chunk_triton import _inv_norms, _program_rows, _sum, _tree_gates
    from ddtree.kernels.pdl import gdc_wait, pdl_launch

    @triton.jit
    def _solve_kernel(
        q_ptr, k_ptr, g_ptr, beta_ptr, valid_ptr, depth_ptr, mask_ptr,
        m_ptr, coef_ptr, gs_ptr, bs_ptr, st_rows_ptr,
        n, HV, DK, GROUP, sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sm_b, sm_i,
        sgs_b, sgs_n, sbs_b, sbs_n, scale,
        BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, L2NORM: tl.constexpr,
        STASH: tl.constexpr, PREC: tl.constexpr, PREC_IN: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_wait()  # before any memory access: the kernel ahead has ended (kernels/pdl.py)
        pid_b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        hk = h // GROUP
        rt = tl.arange(0, BT)
        node = 1 + rt  # block row r is node 1 + r
        in_n = node < n
        row = pid_b * n
        ok = (tl.load(valid_ptr + row + node, mask=in_n, other=0) != 0) & in_n
        ok0 = tl.load(valid_ptr + row) != 0
        q_base = q_ptr + pid_b * sq_b + hk * sq_h
        k_base = k_ptr + pid_b * sk_b + hk * sk_h
        KK = tl.full((BT, BT), 0.0, tl.float32)
        QK = tl.full((BT, BT), 0.0, tl.float32)
        nk = tl.full((BT,), 0.0, tl.float32)
        nq = tl.full((BT,), 0.0, tl.float32)
        kk0 = tl.full((BT,), 0.0, tl.float32)
        qk0 = tl.full((BT,), 0.0, tl.float32)
        nk0 = tl.full((1,), 0.0, tl.float32)
        nq0 = tl.full((1,), 0.0, tl.float32)
        q0k0 = tl.full((1,), 0.0, tl.float32)
        for c in range(0, BK, BKC):  # raw dots (16-bit inputs: exact in one tf32 pass)
            rk = c + tl.arange(0, BKC)
            mk = rk < DK
            m2 = ok[:, None] & mk[None, :]
            kc = tl.load(k_base + node[:, None] * sk_n + rk[None, :], mask=m2, other=0.0)
            qc = tl.load(q_base + node[:, None] * sq_n + rk[None, :], mask=m2, other=0.0)
            kc, qc = kc.to(tl.float32), qc.to(tl.float32)
            k0 = tl.load(k_base + rk, mask=mk & ok0, other=0.0).to(tl.float32)
            q0 = tl.load(q_base + rk, mask=mk & ok0, other=0.0).to(tl.float32)
            KK += tl.dot(kc, tl.trans(kc), input_precision=PREC_IN)
            QK += tl.dot(qc, tl.trans(kc), input_precision=PREC_IN)
            nk += _sum(kc * kc, 1)
            nq += _sum(qc * qc, 1)
            kk0 += _sum(kc * k0[None, :], 1)
            qk0 += _sum(qc * k0[None, :], 1)
            nk0 += _sum((k0 * k0)[None, :], 1)
            nq0 += _sum((q0 * q0)[None, :], 1)
            q0k0 += _sum((q0 * k0)[None, :], 1)
        ik, iq, ik0, iq0 = _inv_norms(nk, nq, nk0, nq0, scale, BT, L2NORM)
        lower, beta, g0, beta0, r, G, rounds, decay = _tree_gates(
            mask_ptr, g_ptr, beta_ptr, depth_ptr, gs_ptr, bs_ptr, st_rows_ptr,
            pid_b, h, row, node, rt, in_n, ok, ok0, HV, sm_b, sm_i, sgs_b, sgs_n, sbs_b, sbs_n,
            True, STASH,
        )  # fmt: skip
        eye = rt[:, None] == rt[None, :]
        P = -(tl.where(lower, KK * decay, 0.0) * (beta * ik)[:, None] * ik[None, :])  # -L
        Am = QK * decay * iq[:, None] * ik[None, :]

        # T = Σ_{j <= 2^(s+1) - 1} (-L)^j after s squarings; L^(rounds + 1) = 0
        T = tl.where(eye, 1.0, 0.0) + P
        steps = (
            (rounds > 1).to(tl.int32)
            + (rounds > 3).to(tl.int32)
            + (rounds > 7).to(tl.int32)
            + (rounds > 15).to(tl.int32)
            + (rounds > 31).to(tl.int32)
            + (rounds > 63).to(tl.int32)
        )
        for _ in range(steps):
            P = tl.dot(P, P, input_precision=PREC)
            T += tl.dot(T, P, input_precision=PREC)
        M = tl.dot(Am, T, input_precision=PREC) * beta[None, :]
        base = (pid_b * HV + h) * BT
        tl.store(m_ptr + (base + rt[:, None]) * BT + rt[None, :], M)

        # row coefficients [a, c, e, f] and the root's [e0 ik0, beta0, e0 iq0, iq0 ik0 q0.k0]
        eG = tl.exp(G)
        d0 = tl.where(r, tl.exp(G - g0), 0.0) * ik0
        cb = coef_ptr + (pid_b * HV + h) * (4 * BT + 4)
        tl.store(cb + rt, tl.where(ok, eG * ik, 0.0))
        tl.store(cb + BT + rt, tl.where(ok, d0 * ik * kk0, 0.0))
        tl.store(cb + 2 * BT + rt, tl.where(ok, eG * iq, 0.0))
        tl.store(cb + 3 * BT + rt, tl.where(ok, d0 * iq * qk0, 0.0))
        e0 = tl.exp(g0)
        four = tl.arange(0, 4)
        root = tl.where(
            four == 0,
            e0 * ik0,
            tl.where(four == 1, beta0, tl.where(four == 2, e0 * iq0, iq0 * ik0 * q0k0)),
        )
        tl.store(cb + 4 * BT + four, tl.where(ok0, root, 0.0))

    @triton.jit
    def _output_kernel(
        q_ptr, k_ptr, v_ptr, valid_ptr, s0_ptr, s0_rows_ptr, m_ptr, coef_ptr, o_ptr,
        n, HV, DK, DV, GROUP, sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h,
        so_b, so_n, so_h, s0_b,
        BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr,
        S0_ROWS: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_wait()  # before any memory access: the kernel ahead has ended (kernels/pdl.py)
        pid_b, h, pid_v, rt, node, in_n, row, ok, ok0, rv, mv, s0_base, q_base, k_base = (
            _program_rows(
                q_ptr, k_ptr, valid_ptr, s0_ptr, s0_rows_ptr, n, DK, DV, GROUP,
                sq_b, sq_h, sk_b, sk_h, s0_b, BT, BV, S0_ROWS,
            )
        )  # fmt: skip
        KS = tl.full((BT, BV), 0.0, tl.float32)
        QS = tl.full((BT, BV), 0.0, tl.float32)
        kS0 = tl.full((BV,), 0.0, tl.float32)
        qS0 = tl.full((BV,), 0.0, tl.float32)
        for c in range(0, BK, BKC):
            rk = c + tl.arange(0, BKC)
            mk = rk < DK
            m2 = ok[:, None] & mk[None, :]
            kc = tl.load(k_base + node[:, None] * sk_n + rk[None, :], mask=m2, other=0.0)
            qc = tl.load(q_base + node[:, None] * sq_n + rk[None, :], mask=m2, other=0.0)
            k0 = tl.load(k_base + rk, mask=mk & ok0, other=0.0).to(tl.float32)
            q0 = tl.load(q_base + rk, mask=mk & ok0, other=0.0).to(tl.float32)
            S0 = tl.load(
                s0_base + rk[:, None] * DV + rv[None, :], mask=mk[:, None] & mv[None, :], other=0.0
            ).to(tl.float32)
            KS += tl.dot(kc.to(tl.float32), S0, input_precision=PREC)
            QS += tl.dot(qc.to(tl.float32), S0, input_precision=PREC)
            kS0 += _sum(k0[:, None] * S0, 0)
            qS0 += _sum(q0[:, None] * S0, 0)
        cb = coef_ptr + (pid_b * HV + h) * (4 * BT + 4)
        a = tl.load(cb + rt)
        cc = tl.load(cb + BT + rt)
        e = tl.load(cb + 2 * BT + rt)
        f = tl.load(cb + 3 * BT + rt)
        ra = tl.load(cb + 4 * BT)
        rb = tl.load(cb + 4 * BT + 1)
        rc = tl.load(cb + 4 * BT + 2)
        rd = tl.load(cb + 4 * BT + 3)
        v0 = tl.load(v_ptr + pid_b * sv_b + h * sv_h + rv, mask=mv & ok0, other=0.0)
        u0 = rb * (v0.to(tl.float32) - ra * kS0)
        o0 = tl.where(ok0, rc * qS0 + rd * u0, 0.0)
        tl.store(o_ptr + pid_b * so_b + h * so_h + rv, o0.to(o_ptr.dtype.element_ty), mask=mv)
        v_blk = tl.load(
            v_ptr + pid_b * sv_b + node[:, None] * sv_n + h * sv_h + rv[None, :],
            mask=ok[:, None] & mv[None, :],
            other=0.0,
        ).to(tl.float32)
        X = v_blk - a[:, None] * KS - cc[:, None] * u0[None, :]
        base = (pid_b * HV + h) * BT
        M = tl.load(m_ptr + (base + rt[:, None]) * BT + rt[None, :])
        o = e[:, None] * QS + f[:, None] * u0[None, :] + tl.dot(M, X, input_precision=PREC)
        o = tl.where(ok[:, None], o, 0.0)
        tl.store(
            o_ptr + pid_b * so_b + node[:, None] * so_n + h * so_h + rv[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=in_n[:, None] & mv[None, :],
        )


def launch_config(
    n: int, dk: int, dv: int, block_v=None, block_k=None, num_warps=None
) -> dict[str, dict[str, int]]:
    """Both launches' tiles for n nodes: the solve (BT, BK, its dk chunk BKC, warps) and the
    outputs (the same BT / BK, its own BKC, the column tile BV, warps); the defaults are what
    studies/gpu_gdn_tree.py (e) timed best on the H200."""
    bt = block_rows(n)
    BK = max(16, triton.next_power_of_2(dk))
    chunk = max(16, min(block_k or 32, BK))
    solve = dict(BT=bt, BK=BK, BKC=chunk, num_warps=8 if bt >= 64 else 4)
    bv = block_v or pick_bv(dv)
    output = dict(BT=bt, BK=BK, BKC=chunk, BV=bv, num_warps=num_warps or 4)
    return dict(solve=solve, output=output)


def tree_chunk_split_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    depths: Tensor,
    initial_state: Tensor,
    tree_mask: Tensor,
    valid: Tensor | None = None,
    initial_rows: Tensor | None = None,
    stash: tuple[Tensor, Tensor, Tensor] | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    block_v: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    precision: str = "auto",
) -> Tensor:
    """`tree_chunk_triton`'s contract (arguments, outputs, padding, stash) in two launches; block_v
    / num_warps are the output launch's, block_k both launches' dk chunk. No host syncs."""
    q, k, v, g, beta, depths, valid, mask, s0, gs, bs, st_rows, precision = checked_inputs(
        q, k, v, g, beta, depths, initial_state, tree_mask, valid, initial_rows, stash, precision
    )
    b, n, Hk, dk = k.shape
    Hv, dv = v.shape[-2], v.shape[-1]
    out = torch.empty(b, n, Hv, dv, dtype=q.dtype, device=v.device)
    if not (b and n):
        return out
    cfg = launch_config(n, dk, dv, block_v, block_k, num_warps)
    bt = cfg["solve"]["BT"]
    m = torch.empty(b, Hv, bt, bt, dtype=torch.float32, device=v.device)
    coef = torch.empty(b, Hv, 4 * bt + 4, dtype=torch.float32, device=v.device)
    prec_in = input_precision(q.element_size(), precision)
    stashed = stash is not None
    _solve_kernel[(b, Hv)](
        q, k, g, beta, valid, depths, mask, m, coef, gs, bs, st_rows,
        n, Hv, dk, Hv // Hk, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), mask.stride(0), mask.stride(1),
        gs.stride(0), gs.stride(1) if stashed else 0, bs.stride(0), bs.stride(1) if stashed else 0,
        float(dk**-0.5 if scale is None else scale),
        L2NORM=bool(use_qk_l2norm), STASH=stashed, PREC=precision, PREC_IN=prec_in,
        **cfg["solve"], **pdl_launch(v.device),
    )  # fmt: skip
    out_cfg = cfg["output"]
    _output_kernel[(b, Hv, triton.cdiv(dv, out_cfg["BV"]))](
        q, k, v, valid, s0, initial_rows if initial_rows is not None else depths, m, coef, out,
        n, Hv, dk, dv, Hv // Hk, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2), s0.stride(0),
        S0_ROWS=initial_rows is not None, PREC=precision, **out_cfg, **pdl_launch(v.device),
    )  # fmt: skip
    return out
