"""The chunk-form tree rule (`tree_chunk.py`, its plain PyTorch reference) as one Triton launch.

Grid (b, Hv, cdiv(dv, BV)): a program owns one value head of one request and a BV-column tile of
its value dim (the solve's right-hand sides are independent per column). Nodes in topological
order (parents[i] < i), so node 0 is always a root. It is taken out of the block, so a B=64 tree
(65 nodes) is one 64-row block, not a padded 128:
    u_0 = β_0 (v_0 - e^{g_0} S0ᵀ k_0),   o_0 = e^{g_0} S0ᵀ q_0 + (q_0·k_0) u_0
and for the block rows i = 1..n-1 (r_i: node 0 is an ancestor of i; Γ_ij = e^{G_i - G_j} on
ancestors-and-self; L = diag(β) (K Kᵀ ⊙ Γ) strictly below the diagonal):
    (I + L) U = β ⊙ (V - e^G ⊙ K S0 - r e^{G - g_0} ⊙ (K k_0) u_0ᵀ)
    O = e^G ⊙ Q S0 + r e^{G - g_0} ⊙ (Q k_0) u_0ᵀ + (Q Kᵀ ⊙ Γ) U
The unitriangular solve runs as U <- R - L U: L is nilpotent along the tree (L^m = 0 past the
longest chain in the block), rows of depth d are exact after d - 1 rounds (they read only their
ancestors, exact one round earlier), so `max(depth - r)` rounds (the request's own tree, read in
the kernel: no host sync) give forward substitution's exact arithmetic in one [BT, BT] @ [BT, BV]
tensor-core dot per round, instead of n dependent row steps. q/k are l2-normalised after the
dots (raw dots times the rows' inverse norms: one pass over dk in chunks of BKC).

The ancestor mask is the round's `DraftTree.tree_mask` (built once per round by the tree build,
not per layer); rows and columns are ANDed with valid, the diagonal forced. Padding nodes (valid
False) read none of their inputs and output zeros. With `stash` the program of column tile 0
also writes its head's g and beta into the state pool's no_buffer stash rows (the commit's
replay inputs), so the layer issues no index_put for them.
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
# sm_90 (2.8 KB of stack at 8 warps): longer trees / chains keep the PyTorch chunk form
MAX_BLOCK = 64
# auto: tf32 for 16-bit inputs (what fla's chunk kernels use; the outputs are rounded to 16 bits
# after: studies/gpu_gdn_tree.py (e) measures the added error), tf32x3 (~fp32) for fp32 inputs
PRECISIONS = ("auto", "tf32x3", "ieee", "tf32")

if triton is not None:
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
        (times `scale` for q) without the l2 norm. Shared with tree_chunk_split_triton."""
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
    def _tree_gates(
        mask_ptr, g_ptr, beta_ptr, depth_ptr, gs_ptr, bs_ptr, st_rows_ptr,
        pid_b, h, row, node, rt, in_n, ok, ok0, HV, sm_b, sm_i, sgs_b, sgs_n, sbs_b, sbs_n,
        write_stash, STASH: tl.constexpr,
    ):  # fmt: skip
        """The block's tree (ancestors from the round's mask: valid rows and columns, the
        diagonal forced), gates and decays: (lower, beta, g0, beta0, r, G, rounds, decay); with
        STASH and write_stash, g and beta also go to the pool's no_buffer stash rows. Shared
        with tree_chunk_split_triton."""
        mrow = mask_ptr + pid_b * sm_b + node * sm_i
        anc = tl.load(mrow[:, None] + node[None, :], mask=ok[:, None] & ok[None, :], other=0)
        lower = rt[None, :] < rt[:, None]
        full = ((anc != 0) & lower) | ((rt[:, None] == rt[None, :]) & ok[:, None])
        r = (tl.load(mrow, mask=ok, other=0) != 0) & ok & ok0  # node 0 is i's ancestor
        gb = (row + node) * HV + h
        g = tl.load(g_ptr + gb, mask=ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + gb, mask=ok, other=0.0).to(tl.float32)
        g0 = tl.where(ok0, tl.load(g_ptr + row * HV + h).to(tl.float32), 0.0)
        beta0 = tl.where(ok0, tl.load(beta_ptr + row * HV + h).to(tl.float32), 0.0)
        if STASH:
            if write_stash:  # the replay's inputs, in the pool's stash rows (once per head)
                srow = tl.load(st_rows_ptr + pid_b).to(tl.int64)
                gs = gs_ptr + srow * sgs_b + h
                bs = bs_ptr + srow * sbs_b + h
                tl.store(gs, g0)
                tl.store(bs, beta0.to(bs_ptr.dtype.element_ty))
                tl.store(gs + node * sgs_n, g, mask=in_n)
                tl.store(bs + node * sbs_n, beta.to(bs_ptr.dtype.element_ty), mask=in_n)
        # G = (A + I) g: the log decay summed over ancestors-and-self (node 0 through r)
        G = _sum(tl.where(full, g[None, :], 0.0), 1) + tl.where(r, g0, 0.0)
        # a row's chain inside the block has depth + 1 - r nodes: exact after depth - r rounds
        dep = tl.load(depth_ptr + row + node, mask=ok, other=0).to(tl.int32)
        rounds = tl.reduce(tl.where(ok, dep - r.to(tl.int32), 0), 0, tl.standard._elementwise_max)
        decay = tl.exp(tl.where(full, G[:, None] - G[None, :], float("-inf")))  # Γ ⊙ (A + I)
        return lower, beta, g0, beta0, r, G, rounds, decay

    @triton.jit
    def _program_rows(
        q_ptr, k_ptr, valid_ptr, s0_ptr, s0_rows_ptr, n, DK, DV, GROUP,
        sq_b, sq_h, sk_b, sk_h, s0_b, BT: tl.constexpr, BV: tl.constexpr, S0_ROWS: tl.constexpr,
    ):  # fmt: skip
        """A (request, value head, column tile) program's rows: block row r is node 1 + r, the
        valid masks (block, root), its value columns, and its S0 / q / k bases. Shared with
        tree_chunk_split_triton's output kernel."""
        pid_b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        pid_v = tl.program_id(2)
        hk = h // GROUP
        rt = tl.arange(0, BT)
        node = 1 + rt
        in_n = node < n
        row = pid_b * n
        ok = (tl.load(valid_ptr + row + node, mask=in_n, other=0) != 0) & in_n
        ok0 = tl.load(valid_ptr + row) != 0
        rv = pid_v * BV + tl.arange(0, BV)
        mv = rv < DV
        s0_row = pid_b
        if S0_ROWS:
            s0_row = tl.load(s0_rows_ptr + pid_b).to(tl.int64)
        s0_base = s0_ptr + s0_row * s0_b + h * DK * DV
        q_base = q_ptr + pid_b * sq_b + hk * sq_h
        k_base = k_ptr + pid_b * sk_b + hk * sk_h
        return pid_b, h, pid_v, rt, node, in_n, row, ok, ok0, rv, mv, s0_base, q_base, k_base

    @triton.jit
    def _tree_chunk_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        valid_ptr,
        depth_ptr,
        mask_ptr,
        s0_ptr,
        s0_rows_ptr,
        o_ptr,
        gs_ptr,
        bs_ptr,
        st_rows_ptr,
        n,
        HV,
        DK,
        DV,
        GROUP,
        sq_b,
        sq_n,
        sq_h,
        sk_b,
        sk_n,
        sk_h,
        sv_b,
        sv_n,
        sv_h,
        so_b,
        so_n,
        so_h,
        sm_b,
        sm_i,
        s0_b,
        sgs_b,
        sgs_n,
        sbs_b,
        sbs_n,
        scale,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BKC: tl.constexpr,
        BV: tl.constexpr,
        L2NORM: tl.constexpr,
        S0_ROWS: tl.constexpr,
        STASH: tl.constexpr,
        PREC: tl.constexpr,
        PREC_IN: tl.constexpr,
    ):
        pid_b, h, pid_v, rt, node, in_n, row, ok, ok0, rv, mv, s0_base, q_base, k_base = (
            _program_rows(
                q_ptr, k_ptr, valid_ptr, s0_ptr, s0_rows_ptr, n, DK, DV, GROUP,
                sq_b, sq_h, sk_b, sk_h, s0_b, BT, BV, S0_ROWS,
            )
        )  # fmt: skip

        # raw dots over dk in chunks (q / k normalised after: the rows' inverse norms); only the
        # accumulators live across the loop, the masks and decays come after it (registers).
        # PREC_IN: q·k of 16-bit inputs is exact in one tf32 pass (<= 10 mantissa bits each)
        KK = tl.full((BT, BT), 0.0, tl.float32)
        QK = tl.full((BT, BT), 0.0, tl.float32)
        KS = tl.full((BT, BV), 0.0, tl.float32)
        QS = tl.full((BT, BV), 0.0, tl.float32)
        nk = tl.full((BT,), 0.0, tl.float32)
        nq = tl.full((BT,), 0.0, tl.float32)
        kk0 = tl.full((BT,), 0.0, tl.float32)
        qk0 = tl.full((BT,), 0.0, tl.float32)
        kS0 = tl.full((BV,), 0.0, tl.float32)
        qS0 = tl.full((BV,), 0.0, tl.float32)
        nk0 = tl.full((1,), 0.0, tl.float32)
        nq0 = tl.full((1,), 0.0, tl.float32)
        q0k0 = tl.full((1,), 0.0, tl.float32)
        for c in range(0, BK, BKC):
            rk = c + tl.arange(0, BKC)
            mk = rk < DK
            m2 = ok[:, None] & mk[None, :]
            kc = tl.load(k_base + node[:, None] * sk_n + rk[None, :], mask=m2, other=0.0)
            qc = tl.load(q_base + node[:, None] * sq_n + rk[None, :], mask=m2, other=0.0)
            kc, qc = kc.to(tl.float32), qc.to(tl.float32)
            k0 = tl.load(k_base + rk, mask=mk & ok0, other=0.0).to(tl.float32)
            q0 = tl.load(q_base + rk, mask=mk & ok0, other=0.0).to(tl.float32)
            S0 = tl.load(
                s0_base + rk[:, None] * DV + rv[None, :], mask=mk[:, None] & mv[None, :], other=0.0
            ).to(tl.float32)
            KK += tl.dot(kc, tl.trans(kc), input_precision=PREC_IN)
            QK += tl.dot(qc, tl.trans(kc), input_precision=PREC_IN)
            KS += tl.dot(kc, S0, input_precision=PREC)
            QS += tl.dot(qc, S0, input_precision=PREC)
            nk += _sum(kc * kc, 1)
            nq += _sum(qc * qc, 1)
            kk0 += _sum(kc * k0[None, :], 1)
            qk0 += _sum(qc * k0[None, :], 1)
            kS0 += _sum(k0[:, None] * S0, 0)
            qS0 += _sum(q0[:, None] * S0, 0)
            nk0 += _sum((k0 * k0)[None, :], 1)
            nq0 += _sum((q0 * q0)[None, :], 1)
            q0k0 += _sum((q0 * k0)[None, :], 1)
        ik, iq, ik0, iq0 = _inv_norms(nk, nq, nk0, nq0, scale, BT, L2NORM)
        lower, beta, g0, beta0, r, G, rounds, decay = _tree_gates(
            mask_ptr, g_ptr, beta_ptr, depth_ptr, gs_ptr, bs_ptr, st_rows_ptr,
            pid_b, h, row, node, rt, in_n, ok, ok0, HV, sm_b, sm_i, sgs_b, sgs_n, sbs_b, sbs_n,
            pid_v == 0, STASH,
        )  # fmt: skip
        Lm = tl.where(lower, KK * decay, 0.0) * (beta * ik)[:, None] * ik[None, :]
        Am = QK * decay * iq[:, None] * ik[None, :]

        # node 0: the root's correction and output (its state is e^{g_0} S0 + k_0 u_0ᵀ)
        v0 = tl.load(v_ptr + pid_b * sv_b + h * sv_h + rv, mask=mv & ok0, other=0.0)
        e0 = tl.exp(g0)
        u0 = beta0 * (v0.to(tl.float32) - e0 * ik0 * kS0)
        o0 = tl.where(ok0, e0 * iq0 * qS0 + iq0 * ik0 * q0k0 * u0, 0.0)
        tl.store(o_ptr + pid_b * so_b + h * so_h + rv, o0.to(o_ptr.dtype.element_ty), mask=mv)

        # the block: right-hand sides, the solve, the outputs
        eG = tl.exp(G)
        d0 = tl.where(r, tl.exp(G - g0), 0.0) * ik0  # the root column of Γ (k_0's norm folded)
        v_blk = tl.load(
            v_ptr + pid_b * sv_b + node[:, None] * sv_n + h * sv_h + rv[None, :],
            mask=ok[:, None] & mv[None, :],
            other=0.0,
        ).to(tl.float32)
        R = beta[:, None] * (
            v_blk - (eG * ik)[:, None] * KS - (d0 * ik * kk0)[:, None] * u0[None, :]
        )
        U = R
        for _ in range(rounds):  # rows with no ancestor in the block are exact in R already
            U = R - tl.dot(Lm, U, input_precision=PREC)
        o = (eG * iq)[:, None] * QS + (d0 * iq * qk0)[:, None] * u0[None, :]
        o += tl.dot(Am, U, input_precision=PREC)
        o = tl.where(ok[:, None], o, 0.0)
        tl.store(
            o_ptr + pid_b * so_b + node[:, None] * so_n + h * so_h + rv[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=in_n[:, None] & mv[None, :],
        )


def block_rows(n: int) -> int:
    """The kernel's block: the n - 1 non-root nodes padded to a power of two >= 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(max(n - 1, 1)))


def supported(n: int) -> bool:
    return triton is not None and n - 1 <= MAX_BLOCK


def input_precision(elem_bytes: int, precision: str) -> str:
    """The q·k dots' precision for inputs of `elem_bytes`: one tf32 pass is exact for 16-bit
    inputs (<= 10 mantissa bits each) unless ieee was asked for; fp32 inputs keep `precision`."""
    return "tf32" if elem_bytes == 2 and precision != "ieee" else precision


def pick_bv(dv: int) -> int:
    """Value-column tile: 32 (sm_90, 64-row block: 255 registers, no spills at 8 warps; at 64 it
    spills), 16 for narrower heads (tl.dot's minimum)."""
    return 32 if dv >= 32 else 16


def launch_config(
    n: int, dk: int, dv: int, block_v=None, block_k: int = 16, num_warps=None
) -> dict[str, int]:
    """The launch for n nodes: block rows BT, padded dk BK, its chunk BKC, column tile BV, warps
    (the defaults: what studies/gdn_tree_chunk_compile_report.py checks for spills)."""
    bt = block_rows(n)
    BK = max(16, triton.next_power_of_2(dk))  # tl.dot takes >= 16 (zero-padded loads)
    return dict(
        BT=bt,
        BK=BK,
        BKC=max(16, min(block_k, BK)),
        BV=block_v or pick_bv(dv),
        num_warps=num_warps or (4 if bt <= 16 else 8),
    )


def checked_inputs(
    q, k, v, g, beta, depths, initial_state, tree_mask, valid, initial_rows, stash, precision
):
    """The chunk kernels' arguments checked and laid out for a launch (both forms, this one and
    `tree_chunk_split_triton`): unit last strides, int8 valid, uint8 mask, the stash's three
    tensors (dummies when there is none), the dot precision ("auto" resolved by q's dtype). Raises
    what a kernel cannot run."""
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
    g, beta, depths = g.contiguous(), beta.contiguous(), depths.contiguous()
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
    if stash is not None:
        gs, bs, st_rows = stash
        if gs.stride(-1) != 1 or bs.stride(-1) != 1:
            raise ValueError("stash rows must be contiguous over Hv")
    else:
        gs, bs, st_rows = g, beta, depths  # dummy pointers when unused
    return q, k, v, g, beta, depths, valid, mask, s0, gs, bs, st_rows, precision


def tree_chunk_triton(
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
    block_k: int = 16,
    num_warps: int | None = None,
    precision: str = "auto",
) -> Tensor:
    """`tree_chunk.tree_chunk_gated_delta_rule`'s outputs (no node state): q, k [b, n, Hk, dk]; v
    [b, n, Hv, dv]; g, beta [b, n, Hv]; depths [b, n]; initial_state [b, Hv, dk, dv] or, with
    initial_rows [b], a pool [R, Hv, dk, dv]; tree_mask [b, >= n, >= n] bool ancestors-and-self
    (`DraftTree.tree_mask`, any row / column strides with unit last stride). Nodes topological
    (parents[i] < i), n <= MAX_BLOCK + 1. stash (optional): (node_g [R, W >= n, Hv], node_beta
    [R, W, Hv], rows [b]): g and beta also land in rows[i]'s first n stash rows.
    block_v / block_k / num_warps / precision: launch overrides (studies/gpu_gdn_tree.py), the
    same math. Returns o [b, n, Hv, dv] in q's dtype. No host syncs."""
    q, k, v, g, beta, depths, valid, mask, s0, gs, bs, st_rows, precision = checked_inputs(
        q, k, v, g, beta, depths, initial_state, tree_mask, valid, initial_rows, stash, precision
    )
    b, n, Hk, dk = k.shape
    Hv, dv = v.shape[-2], v.shape[-1]
    out = torch.empty(b, n, Hv, dv, dtype=q.dtype, device=v.device)
    if not (b and n):
        return out
    cfg = launch_config(n, dk, dv, block_v, block_k, num_warps)
    _tree_chunk_kernel[(b, Hv, triton.cdiv(dv, cfg["BV"]))](
        q,
        k,
        v,
        g,
        beta,
        valid,
        depths,
        mask,
        s0,
        initial_rows if initial_rows is not None else depths,
        out,
        gs,
        bs,
        st_rows,
        n,
        Hv,
        dk,
        dv,
        Hv // Hk,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        mask.stride(0),
        mask.stride(1),
        s0.stride(0),
        gs.stride(0),
        gs.stride(1) if stash is not None else 0,
        bs.stride(0),
        bs.stride(1) if stash is not None else 0,
        float(dk**-0.5 if scale is None else scale),
        L2NORM=bool(use_qk_l2norm),
        S0_ROWS=initial_rows is not None,
        STASH=stash is not None,
        PREC=precision,
        PREC_IN=input_precision(q.element_size(), precision),
        **cfg,
    )
    return out
