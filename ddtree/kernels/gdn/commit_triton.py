"""no_buffer commit in place: the accepted path replayed straight from the stash into the pool rows.

`HybridStatePool._replay` (the reference: gathers of the pool rows and the stash per group of layers,
fla's fused recurrent or `reference.replay_path`, an index_put back) moves each state through memory
about six times and launches ~15 ops per group. Here one launch per state kind, every layer at once:
- `_replay_ssm_kernel`, grid (L * b, Hv, cdiv(dv, BV)): a program loads its [dk, BV] tile of
  ssm[l, slots[i], h], runs the delta rule over the accepted steps path[i, 0..acc[i]] (k, v from
  the post-conv stash node_y, g / beta from theirs; k l2-normalised as the verify did)
      S <- e^g S,   u = β (v - Sᵀ k),   S <- S + k uᵀ
  and stores the tile back (the state read and written once);
- `_replay_conv_kernel`, grid (L * b, cdiv(C, BC)): the conv window after the path, the last K-1
  of [the old window, node_x at the accepted steps], read before it is overwritten.
Entries of path past acc are never read. Each program owns disjoint rows: in place is safe, and
the launch is CUDA-graph capturable (no host syncs).
"""

from __future__ import annotations

from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    # tree_chunk_triton's _sum: tl.reduce (the interpreter cannot call tl.sum); its import also
    # patches the interpreter's indexing
    from ddtree.kernels.gdn.tree_chunk_triton import _sum
    from ddtree.kernels.pdl import gdc_wait, pdl_launch

    @triton.jit
    def _replay_ssm_kernel(
        ssm_ptr, y_ptr, g_ptr, beta_ptr, slots_ptr, path_ptr, acc_ptr,
        B, P, DK, DV, GROUP, KD, s_l, s_r, s_h, y_l, y_r, y_w, g_l, g_r, g_w, b_l, b_r, b_w,
        BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_wait()  # before any memory access: the kernel ahead has ended (kernels/pdl.py)
        pid = tl.program_id(0)
        layer = (pid // B).to(tl.int64)
        i = pid % B
        h = tl.program_id(1).to(tl.int64)
        pid_v = tl.program_id(2)
        hk = h // GROUP
        slot = tl.load(slots_ptr + i).to(tl.int64)
        acc = tl.load(acc_ptr + i).to(tl.int32)
        rk = tl.arange(0, BK)
        mk = rk < DK
        rv = pid_v * BV + tl.arange(0, BV)
        mv = rv < DV
        sp = ssm_ptr + layer * s_l + slot * s_r + h * s_h + rk[:, None] * DV + rv[None, :]
        m2 = mk[:, None] & mv[None, :]
        S = tl.load(sp, mask=m2, other=0.0).to(tl.float32)
        y_row = y_ptr + layer * y_l + slot * y_r
        g_row = g_ptr + layer * g_l + slot * g_r + h
        b_row = beta_ptr + layer * b_l + slot * b_r + h
        for t in range(acc + 1):
            node = tl.load(path_ptr + i * P + t).to(tl.int64)
            k = tl.load(y_row + node * y_w + KD + hk * DK + rk, mask=mk, other=0.0).to(tl.float32)
            if L2NORM:
                k = k / tl.sqrt(_sum((k * k)[None, :], 1) + 1e-6)
            v = tl.load(y_row + node * y_w + 2 * KD + h * DV + rv, mask=mv, other=0.0)
            g = tl.load(g_row + node * g_w).to(tl.float32)
            beta = tl.load(b_row + node * b_w).to(tl.float32)
            S = S * tl.exp(g)
            u = beta * (v.to(tl.float32) - _sum(S * k[:, None], 0))
            S = S + k[:, None] * u[None, :]
        tl.store(sp, S.to(ssm_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _replay_conv_kernel(
        conv_ptr, x_ptr, slots_ptr, path_ptr, acc_ptr, B, P, C, c_l, c_r, x_l, x_r, x_w,
        KM1: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_wait()  # before any memory access: the kernel ahead has ended (kernels/pdl.py)
        pid = tl.program_id(0)
        layer = (pid // B).to(tl.int64)
        i = pid % B
        slot = tl.load(slots_ptr + i).to(tl.int64)
        acc = tl.load(acc_ptr + i).to(tl.int32)
        rc = tl.program_id(1) * BC + tl.arange(0, BC)
        mc = rc < C
        rj = tl.arange(0, BJ)
        mj = rj < KM1
        # new column j = ext[acc + 1 + j], ext = [old window (K-1), inputs at steps 0..acc]
        src = acc + 1 + rj
        from_old = src < KM1
        base = conv_ptr + layer * c_l + slot * c_r + rc[:, None] * KM1
        m_old = mc[:, None] & (mj & from_old)[None, :]
        old = tl.load(base + src[None, :], mask=m_old, other=0.0)
        m_new = mj & (src >= KM1)
        node = tl.load(path_ptr + i * P + (src - KM1), mask=m_new, other=0).to(tl.int64)
        xp = x_ptr + layer * x_l + slot * x_r + node[None, :] * x_w + rc[:, None]
        xv = tl.load(xp, mask=mc[:, None] & m_new[None, :], other=0.0)
        new = tl.where(from_old[None, :], old, xv.to(old.dtype))
        tl.store(base + rj[None, :], new, mask=mc[:, None] & mj[None, :])


def commit_replay_triton(
    ssm: Tensor,
    conv: Tensor,
    node_x: Tensor,
    node_y: Tensor,
    node_g: Tensor,
    node_beta: Tensor,
    slots: Tensor,
    path: Tensor,
    acc: Tensor,
    hk: int,
    use_qk_l2norm: bool = True,
    block_v: int | None = None,
    block_c: int = 256,
) -> None:
    """In place: ssm [L, R, Hv, dk, dv], conv [L, R, C, K-1] rows slots [b] become the states after
    path[i, :acc[i] + 1] (node indices, root first) from the stash node_x / node_y [L, R, W, C] (C =
    2 hk dk + Hv dv: q | k | v), node_g / node_beta [L, R, W, Hv]. No host syncs."""
    L, _, hv, dk, dv = ssm.shape
    b, P = path.shape
    C, km1 = conv.shape[-2], conv.shape[-1]
    if ssm.stride(-1) != 1 or ssm.stride(-2) != dv or ssm.stride(-3) != dk * dv:
        raise ValueError("ssm must be contiguous over its last three dims [Hv, dk, dv]")
    if conv.stride(-1) != 1 or conv.stride(-2) != km1:
        raise ValueError("conv must be contiguous over its last two dims [C, K-1]")
    if any(t.stride(-1) != 1 for t in (node_x, node_y, node_g, node_beta)):
        raise ValueError("stash rows must have a unit last stride")
    if not (L and b):
        return
    path, slots, acc = path.contiguous(), slots.contiguous(), acc.contiguous()
    BK = max(16, triton.next_power_of_2(dk))
    BV = block_v or min(32, max(16, triton.next_power_of_2(dv)))
    y, g, bt = node_y, node_g, node_beta
    _replay_ssm_kernel[(L * b, hv, triton.cdiv(dv, BV))](
        ssm, y, g, bt, slots, path, acc, b, P, dk, dv, hv // hk, hk * dk,
        ssm.stride(0), ssm.stride(1), ssm.stride(2), y.stride(0), y.stride(1), y.stride(2),
        g.stride(0), g.stride(1), g.stride(2), bt.stride(0), bt.stride(1), bt.stride(2),
        BK=BK, BV=BV, L2NORM=bool(use_qk_l2norm), num_warps=4, **pdl_launch(ssm.device),
    )  # fmt: skip
    x = node_x
    _replay_conv_kernel[(L * b, triton.cdiv(C, block_c))](
        conv, x, slots, path, acc, b, P, C, conv.stride(0), conv.stride(1),
        x.stride(0), x.stride(1), x.stride(2),
        KM1=km1, BJ=max(2, triton.next_power_of_2(km1)), BC=block_c, num_warps=4,
        **pdl_launch(conv.device),
    )  # fmt: skip
