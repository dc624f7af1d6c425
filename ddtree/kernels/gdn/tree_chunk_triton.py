"""The no_buffer tree verify: the chunk-form tree rule (`tree_chunk.py`, its plain PyTorch
reference) in two Triton launches, the solve once per (request, value head), then the outputs per
value-column tile.

Nodes in topological order (parents[i] < i), so node 0 is always a root. It is taken out of the
block, so a B=64 tree (65 nodes) is one 64-row block, not a padded 128. For the block rows
i = 1..n-1 (r_i: node 0 is an ancestor of i; G = (A + I) g the log decay summed over
ancestors-and-self; Γ_ij = e^{G_i - G_j} on ancestors-and-self; L = diag(β) (K Kᵀ ⊙ Γ) strictly
below the diagonal; ik / iq the rows' inverse norms, d0 the root column of Γ):
    u_0 = β_0 (v_0 - e^{g_0} S0ᵀ k_0),   o_0 = e^{g_0} S0ᵀ q_0 + (q_0·k_0) u_0
    (I + L) U = diag(β) X,   X = V - a ⊙ K S0 - c u_0ᵀ    (a = e^G ik, c = d0 ik (K k_0))
    O = e ⊙ Q S0 + f u_0ᵀ + M X,   M = A (I + L)⁻¹ diag(β)  (e = e^G iq, f = d0 iq (Q k_0))
with A = Q Kᵀ ⊙ Γ on ancestors-and-self.
1. `_solve_kernel`, grid (b, Hv): the decay gate g = -e^{A_log} softplus(a + dt_bias) and
   β = sigmoid(b) from the layer's raw gate inputs (`fused.gdn_gating`'s numbers: no gating launch),
   the q / k dots over dk, the tree's decays, T = (I + L)⁻¹ = Σ_j (-L)^j by repeated squaring (L is
   nilpotent along the tree: powers past `max(depth - r)` vanish, so ⌈log2(rounds + 1)⌉ - 1 steps
   of two [BT, BT] dots), M = A T diag(β) and the row coefficients a, c, e, f and the root's, into a
   per-(request, head) scratch; with `stash`, g and β go to the state pool's no_buffer stash rows
   (the commit's replay inputs).
2. `_output_kernel`, grid (b, Hv, cdiv(dv, BV)): K S0 and Q S0 over dk, u_0 and o_0, then one
   [BT, BT] @ [BT, BV] dot for the block's outputs.
The output kernel overlaps the solve (programmatic dependent launch, kernels/pdl.py): the solve
lets it launch as soon as its own wait has returned, and its programs load q, k, v and the
committed state and run the K S0 / Q S0 dots before they wait for the solve's scratch. At batch 1
the solve is 48 programs on 132 SMs: the outputs' loads and dots run on the idle ones.

The ancestor mask is the round's `DraftTree.tree_mask` (built once per round by the tree build, not
per layer); rows and columns are ANDed with valid, the diagonal forced. Padding nodes (valid False)
read none of their inputs and output zeros. The solve differs from the PyTorch form in rounding
only (a product of powers instead of a triangular solve). No host syncs: capturable.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

# widest block of non-root nodes: n <= MAX_BLOCK + 1 (B=64 trees). A 128-row block spills on
# sm_90: longer trees and chains take the Triton recurrence (dispatch.tree_rule)
MAX_BLOCK = 64
# auto: tf32 for 16-bit inputs (what fla's chunk kernels use; the outputs are rounded to 16 bits
# after), tf32x3 (~fp32) for fp32 inputs
PRECISIONS = ("auto", "tf32x3", "ieee", "tf32")

if triton is not None:
    from ddtree.kernels.gdn.fused import decay_gate
    from ddtree.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_launch
    from ddtree.kernels.tree_attention.tuning import patch_interpreter_index

    if triton.knobs.runtime.interpret:
        patch_interpreter_index()

    # tl.sum / tl.max are @jit helpers the interpreter cannot call when triton was imported
    # before TRITON_INTERPRET was set (as in triton_tree.py): tl.reduce with the combine functions
    @triton.jit
    def _sum(x, axis: tl.constexpr):
        return tl.reduce(x, axis, tl.standard._sum_combine)

    @triton.jit
    def _inv_norms(nk, nq, nk0, nq0, scale, BT: tl.constexpr, L2NORM: tl.constexpr):
        """The block rows' inverse norms of k and q (q's times `scale`) and the root's; ones
        (times `scale` for q) without the l2 norm."""
        if L2NORM:
            ik = 1.0 / tl.sqrt(nk + 1e-6)
            iq = scale / tl.sqrt(nq + 1e-6)
            ik0 = 1.0 / tl.sqrt(nk0 + 1e-6)
            iq0 = scale / tl.sqrt(nq0 + 1e-6)
        else:
            ik = tl.full((BT,), 1.0, tl.float32)
            iq = tl.full((BT,), 1.0, tl.float32) * scale
            ik0 = tl.full((1,), 1.0, tl.float32)
            iq0 = tl.full((1,), 1.0, tl.float32) * scale
        return ik, iq, ik0, iq0

    @triton.jit
    def _gate(g_ptr, beta_ptr, alog_ptr, dtb_ptr, t, h, sg, sb, m, RAW_GATE: tl.constexpr):
        """(g fp32, β as fp32 of β's dtype) of tokens t (mask m; 0 where masked) in head h: loaded,
        or with RAW_GATE computed from the raw inputs a (in g_ptr), b (in beta_ptr), A_log, dt_bias
        as `fused.gdn_gating` computes and stores them."""
        if RAW_GATE:
            a = tl.load(g_ptr + t * sg + h, mask=m, other=0.0).to(tl.float32)
            dtb = tl.load(dtb_ptr + h).to(tl.float32)
            g = decay_gate(a, dtb, tl.load(alog_ptr + h).to(tl.float32))
            b = tl.load(beta_ptr + t * sb + h, mask=m, other=0.0).to(tl.float32)
            beta = (1.0 / (1.0 + tl.exp(-b))).to(beta_ptr.dtype.element_ty).to(tl.float32)
        else:
            g = tl.load(g_ptr + t * sg + h, mask=m, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + t * sb + h, mask=m, other=0.0).to(tl.float32)
        return tl.where(m, g, 0.0), tl.where(m, beta, 0.0)

    @triton.jit
    def _solve_kernel(
        q_ptr, k_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, valid_ptr, depth_ptr, mask_ptr,
        m_ptr, coef_ptr, gs_ptr, bs_ptr, st_rows_ptr,
        n, HV, DK, GROUP, sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sg, sb, sm_b, sm_i,
        sgs_b, sgs_n, sbs_b, sbs_n, scale,
        BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, L2NORM: tl.constexpr,
        RAW_GATE: tl.constexpr, STASH: tl.constexpr, PREC: tl.constexpr, PREC_IN: tl.constexpr,
        PDL: tl.constexpr, EARLY: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_wait()  # before any memory access: the kernel ahead has ended (kernels/pdl.py)
            if EARLY:  # after the wait: the output kernel may start its loads (see there)
                gdc_launch_dependents()
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

        # the gates (g, β of the block's nodes and the root), the stash, the tree
        g, beta = _gate(g_ptr, beta_ptr, alog_ptr, dtb_ptr, row + node, h, sg, sb, ok, RAW_GATE)
        g0, beta0 = _gate(g_ptr, beta_ptr, alog_ptr, dtb_ptr, row, h, sg, sb, ok0, RAW_GATE)
        if STASH:  # the replay's inputs, in the pool's stash rows
            srow = tl.load(st_rows_ptr + pid_b).to(tl.int64)
            gs = gs_ptr + srow * sgs_b + h
            bs = bs_ptr + srow * sbs_b + h
            tl.store(gs, g0)
            tl.store(bs, beta0.to(bs_ptr.dtype.element_ty))
            tl.store(gs + node * sgs_n, g, mask=in_n)
            tl.store(bs + node * sbs_n, beta.to(bs_ptr.dtype.element_ty), mask=in_n)
        mrow = mask_ptr + pid_b * sm_b + node * sm_i
        anc = tl.load(mrow[:, None] + node[None, :], mask=ok[:, None] & ok[None, :], other=0)
        lower = rt[None, :] < rt[:, None]
        eye = rt[:, None] == rt[None, :]
        full = ((anc != 0) & lower) | (eye & ok[:, None])
        r = (tl.load(mrow, mask=ok, other=0) != 0) & ok & ok0  # node 0 is i's ancestor
        # G = (A + I) g: the log decay summed over ancestors-and-self (node 0 through r)
        G = _sum(tl.where(full, g[None, :], 0.0), 1) + tl.where(r, g0, 0.0)
        # a row's chain inside the block has depth + 1 - r nodes: exact after depth - r rounds
        dep = tl.load(depth_ptr + row + node, mask=ok, other=0).to(tl.int32)
        rounds = tl.reduce(tl.where(ok, dep - r.to(tl.int32), 0), 0, tl.standard._elementwise_max)
        decay = tl.exp(tl.where(full, G[:, None] - G[None, :], float("-inf")))  # Γ ⊙ (A + I)

        P = -(tl.where(lower, KK * decay, 0.0) * (beta * ik)[:, None] * ik[None, :])  # -L
        Am = QK * decay * iq[:, None] * ik[None, :]
        # row coefficients [a, c, e, f] and the root's [e0 ik0, beta0, e0 iq0, iq0 ik0 q0.k0],
        # stored before the squarings: the vectors they take die here (registers)
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

    @triton.jit
    def _output_kernel(
        q_ptr, k_ptr, v_ptr, valid_ptr, s0_ptr, s0_rows_ptr, m_ptr, coef_ptr, o_ptr,
        n, HV, DK, DV, GROUP, sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h,
        so_b, so_n, so_h, s0_b,
        BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr,
        S0_ROWS: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    ):  # fmt: skip
        if PDL and not EARLY:
            gdc_wait()
        # EARLY: launched while the solve runs (it triggers this launch after its own wait, so
        # every kernel before the solve has ended and its writes are visible: kernels/pdl.py).
        # Until the wait below only their outputs are read (q, k, v, valid, the committed state
        # rows), and nothing is written.
        pid_b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        hk = h // GROUP
        rt = tl.arange(0, BT)
        node = 1 + rt
        in_n = node < n
        row = pid_b * n
        ok = (tl.load(valid_ptr + row + node, mask=in_n, other=0) != 0) & in_n
        ok0 = tl.load(valid_ptr + row) != 0
        rv = tl.program_id(2) * BV + tl.arange(0, BV)
        mv = rv < DV
        s0_row = pid_b
        if S0_ROWS:
            s0_row = tl.load(s0_rows_ptr + pid_b).to(tl.int64)
        s0_base = s0_ptr + s0_row * s0_b + h * DK * DV
        q_base = q_ptr + pid_b * sq_b + hk * sq_h
        k_base = k_ptr + pid_b * sk_b + hk * sk_h
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
        v0 = tl.load(v_ptr + pid_b * sv_b + h * sv_h + rv, mask=mv & ok0, other=0.0)
        v_blk = tl.load(
            v_ptr + pid_b * sv_b + node[:, None] * sv_n + h * sv_h + rv[None, :],
            mask=ok[:, None] & mv[None, :],
            other=0.0,
        ).to(tl.float32)
        if PDL and EARLY:
            gdc_wait()  # the solve has ended: its scratch is written
        cb = coef_ptr + (pid_b * HV + h) * (4 * BT + 4)
        a = tl.load(cb + rt)
        cc = tl.load(cb + BT + rt)
        e = tl.load(cb + 2 * BT + rt)
        f = tl.load(cb + 3 * BT + rt)
        ra = tl.load(cb + 4 * BT)
        rb = tl.load(cb + 4 * BT + 1)
        rc = tl.load(cb + 4 * BT + 2)
        rd = tl.load(cb + 4 * BT + 3)
        u0 = rb * (v0.to(tl.float32) - ra * kS0)
        o0 = tl.where(ok0, rc * qS0 + rd * u0, 0.0)
        tl.store(o_ptr + pid_b * so_b + h * so_h + rv, o0.to(o_ptr.dtype.element_ty), mask=mv)
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


def block_rows(n: int) -> int:
    """The kernels' block: the n - 1 non-root nodes padded to a power of two >= 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(max(n - 1, 1)))


def supported(n: int) -> bool:
    return triton is not None and n - 1 <= MAX_BLOCK


def input_precision(elem_bytes: int, precision: str) -> str:
    """The q·k dots' precision for inputs of `elem_bytes`: one tf32 pass is exact for 16-bit
    inputs (<= 10 mantissa bits each) unless ieee was asked for; fp32 inputs keep `precision`."""
    return "tf32" if elem_bytes == 2 and precision != "ieee" else precision


def launch_config(
    n: int,
    dk: int,
    dv: int,
    block_v: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    solve_warps: int | None = None,
) -> dict[str, dict[str, int]]:
    """Both launches' tiles for n nodes: the solve (BT, BK, its dk chunk BKC, warps) and the
    outputs (the same BT / BK / BKC, the column tile BV, warps). The defaults: what
    studies/gpu_gdn_tree.py (e) timed best on the H200; studies/gdn_tree_chunk_compile_report.py
    checks them for spills (a 64-row block's solve sits at ~254 registers at 8 warps)."""
    bt = block_rows(n)
    BK = max(16, triton.next_power_of_2(dk))
    chunk = max(16, min(block_k or 32, BK))
    solve = dict(BT=bt, BK=BK, BKC=chunk, num_warps=solve_warps or (8 if bt >= 64 else 4))
    bv = block_v or (32 if dv >= 32 else 16)  # tl.dot's minimum is 16
    output = dict(BT=bt, BK=BK, BKC=chunk, BV=bv, num_warps=num_warps or 4)
    return dict(solve=solve, output=output)


def _raw_gate(gate, n_tokens: int):
    """(a, b, A_log, dt_bias) checked: a, b [T, Hv] token rows with a unit last stride."""
    a, b, a_log, dt_bias = gate
    a, b = (t.reshape(n_tokens, t.shape[-1]) for t in (a, b))
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("gate inputs a / b must have a unit stride over heads")
    return a, b, a_log.contiguous(), dt_bias.contiguous()


def tree_chunk_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    depths: Tensor,
    initial_state: Tensor,
    tree_mask: Tensor,
    valid: Tensor | None = None,
    initial_rows: Tensor | None = None,
    stash: tuple[Tensor, Tensor, Tensor] | None = None,
    gate: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    block_v: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    solve_warps: int | None = None,
    precision: str = "auto",
    early: bool = True,
) -> Tensor:
    """`tree_chunk.tree_chunk_gated_delta_rule`'s outputs (no node state): q, k [b, n, Hk, dk]; v
    [b, n, Hv, dv]; g (fp32 log decay), beta [b, n, Hv], or gate = (a, b [b * n, Hv] at any token
    stride, A_log, dt_bias [Hv]): the layer's raw gate inputs, gated in the solve (g and beta are
    then unused: pass None); depths [b, n]; initial_state [b, Hv, dk, dv] or, with initial_rows
    [b], a pool [R, Hv, dk, dv]; tree_mask [b, >= n, >= n] bool ancestors-and-self
    (`DraftTree.tree_mask`, any row / column strides with unit last stride). Nodes topological
    (parents[i] < i), n <= MAX_BLOCK + 1. stash (optional): (node_g [R, W >= n, Hv], node_beta
    [R, W, Hv], rows [b]): g and beta also land in rows[i]'s first n stash rows.
    block_v / block_k / num_warps / solve_warps / precision: launch overrides
    (studies/gpu_gdn_tree.py), the same math; early: the output kernel's loads overlap the solve
    (see the module docstring). Returns o [b, n, Hv, dv] in q's dtype. No host syncs."""
    b, n, Hk, dk = k.shape
    Hv, dv = v.shape[-2], v.shape[-1]
    if Hv % Hk:
        raise ValueError(f"value heads {Hv} not a multiple of key heads {Hk}")
    if not supported(n):
        raise ValueError(f"tree of {n} nodes: the kernel takes at most {MAX_BLOCK + 1}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {PRECISIONS}")
    if precision == "auto":
        precision = "tf32" if q.element_size() == 2 else "tf32x3"
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if gate is not None:
        g, beta, a_log, dt_bias = _raw_gate(gate, b * n)
    else:
        g, beta = g.reshape(b * n, Hv).contiguous(), beta.reshape(b * n, Hv).contiguous()
        a_log = dt_bias = g  # dummy pointers when unused
    depths = depths.contiguous()
    valid = (depths >= 0) if valid is None else valid
    valid = (
        valid.contiguous().view(torch.int8) if valid.dtype == torch.bool else valid.to(torch.int8)
    )
    if tree_mask.stride(-1) != 1:
        tree_mask = tree_mask.contiguous()
    mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    s0 = initial_state if initial_rows is not None else initial_state.contiguous()
    if s0.stride(-1) != 1 or s0.stride(-2) != dv or s0.stride(-3) != dk * dv:
        raise ValueError("initial_state must be contiguous over its last three dims [Hv, dk, dv]")
    stashed = stash is not None
    if stashed:
        gs, bs, st_rows = stash
        if gs.stride(-1) != 1 or bs.stride(-1) != 1:
            raise ValueError("stash rows must be contiguous over Hv")
    else:
        gs, bs, st_rows = g, beta, depths  # dummy pointers when unused
    out = torch.empty(b, n, Hv, dv, dtype=q.dtype, device=v.device)
    if not (b and n):
        return out
    cfg = launch_config(n, dk, dv, block_v, block_k, num_warps, solve_warps)
    bt = cfg["solve"]["BT"]
    m = torch.empty(b, Hv, bt, bt, dtype=torch.float32, device=v.device)
    coef = torch.empty(b, Hv, 4 * bt + 4, dtype=torch.float32, device=v.device)
    pdl = pdl_launch(v.device)
    _solve_kernel[(b, Hv)](
        q, k, g, beta, a_log, dt_bias, valid, depths, mask, m, coef, gs, bs, st_rows,
        n, Hv, dk, Hv // Hk, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), g.stride(0), beta.stride(0),
        mask.stride(0), mask.stride(1),
        gs.stride(0), gs.stride(1) if stashed else 0, bs.stride(0), bs.stride(1) if stashed else 0,
        float(dk**-0.5 if scale is None else scale),
        L2NORM=bool(use_qk_l2norm), RAW_GATE=gate is not None, STASH=stashed, PREC=precision,
        PREC_IN=input_precision(q.element_size(), precision), EARLY=early,
        **cfg["solve"], **pdl,
    )  # fmt: skip
    out_cfg = cfg["output"]
    _output_kernel[(b, Hv, triton.cdiv(dv, out_cfg["BV"]))](
        q, k, v, valid, s0, initial_rows if initial_rows is not None else depths, m, coef, out,
        n, Hv, dk, dv, Hv // Hk, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2), s0.stride(0),
        S0_ROWS=initial_rows is not None, PREC=precision, EARLY=early, **out_cfg, **pdl,
    )  # fmt: skip
    return out
