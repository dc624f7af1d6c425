"""The math warpgroup of the Hopper tree-attention kernel (`hopper.py`, which holds the kernel, its TMA
producer warp and the launch): the online softmax over the K/V tiles the producer lands in the ring, written
as a normalised partial + base-2 log-sum-exp per split.

`consume` first gathers the block's Q rows into shared memory (in this partition, so the producer's first loads
do not wait for it), then takes one of two paths by the rows the block holds: `_consume_rows` (64 rows, S = Q K^T
as m64n64 wgmma with Q, and P V with P, from registers) and `_consume_swapped` for a last block of <= TN rows
(S^T = K Q^T, the KV positions as M, and O^T = V^T P^T with P^T through shared memory), whose 64-row product
would be almost all padding.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAVE_GLUON = True
except Exception:  # noqa: BLE001  (hopper.py reports why and leaves everything to the Triton kernel)
    HAVE_GLUON = False

if HAVE_GLUON:

    @gluon.jit
    def _visible(
        rows, j, n_rows, ctx, kv_len, mask_row, stride_mt, G: gl.constexpr, MODE: gl.constexpr
    ):
        # rows (token * G + head) and KV positions j as broadcastable 2-D index tensors, either orientation
        row_t = rows // G
        if MODE == 0:
            vis = j <= ctx + row_t
        elif MODE == 1:
            c = j - ctx
            bits = gl.load(
                mask_row + row_t * stride_mt + c,
                mask=(rows < n_rows) & (c >= 0) & (j < kv_len),
                other=0,
            )
            vis = (j < ctx) | (bits != 0)
        else:
            vis = (j < kv_len) & (rows >= 0)
        return vis

    @gluon.jit
    def _partial_index(rows, q_start, kvh, split, num_splits, HKV: gl.constexpr, G: gl.constexpr):
        # rows (token * G + head-in-group) of KV head kvh -> their split's slot in part_lse ([T, Hq, S]; part_o * D)
        return ((q_start + rows // G) * (HKV * G) + kvh * G + rows % G) * num_splits + split

    @gluon.jit
    def _log2_sum_exp(m_i, l_i):
        # base-2 log-sum-exp of a row's partial, -inf for a row that saw nothing in this split
        has = l_i > 0.0
        return gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))

    @gluon.jit
    def _mask_tile(
        s,
        tile,
        blk,
        G: gl.constexpr,
        BM: gl.constexpr,
        BN: gl.constexpr,
        MODE: gl.constexpr,
        s_layout: gl.constexpr,
    ):
        row0, n_rows, ctx, kv_len, mask_row, stride_mt = blk
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        j = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        vis = _visible(rows[:, None], j[None, :], n_rows, ctx, kv_len, mask_row, stride_mt, G, MODE)
        return gl.where(vis, s, float("-inf"))

    @gluon.jit
    def consume(
        q_ptr,
        stride_qt,
        stride_qh,
        q_smem,
        ring,
        turns,
        job,
        blk,
        dest,
        HKV: gl.constexpr,
        G: gl.constexpr,
        D: gl.constexpr,
        BM: gl.constexpr,
        BN: gl.constexpr,
        NS: gl.constexpr,
        MODE: gl.constexpr,
        TN: gl.constexpr,
        PP: gl.constexpr,
        FIRST: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        # the bundles `hopper._split_attn` builds once for every partition: ring = the K / V slots
        # and their full / empty barriers; turns = this warpgroup's and the other's ping-pong
        # barriers; job = (first tile, tiles, masked split, scale); blk = the row block and what
        # it sees (first row, rows, context, KV length, tree-mask row, its stride); dest = where
        # the partial goes (part_o, part_lse, first token, KV head, split, splits)
        row0, n_rows, q_start, kvh = blk[0], blk[1], dest[2], dest[3]
        if PP:  # a ping-pong warpgroup whose rows are all past the request's end keeps only the slot / turn protocol
            if row0 >= n_rows:
                full, empty, n_tiles = ring[2], ring[3], job[1]
                turn_mine, turn_other = turns
                for j in range(n_tiles - 1):
                    mbarrier.wait(full.index((j + 1) % NS), ((j + 1) // NS) & 1)
                    mbarrier.wait(turn_mine, (j & 1) ^ FIRST)
                    mbarrier.arrive(turn_other)
                    mbarrier.arrive(empty.index(j % NS))
                return
        # Q rows (row = token * G + head-in-group) gathered from [T, Hq, D] into shared memory
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ld_layout))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
        q = gl.load(
            q_ptr
            + (q_start + rows // G)[:, None] * stride_qt
            + (kvh * G + rows % G)[:, None] * stride_qh
            + d[None, :],
            mask=(rows < n_rows)[:, None],
            other=0.0,
        )
        q_smem.store(q)
        fence_async_shared()
        gl.thread_barrier()  # this partition's warps only: every row is in shared memory
        # TN is tested at compile time on its own: with TN = 0 the swapped path (N = 0) must not be built at all,
        # which a run-time test folded into one condition would not ensure
        if TN > 0:
            if n_rows - row0 <= TN:
                _consume_swapped(
                    q_smem, ring, job, blk, dest, HKV, G, D, BN, TN, NS, MODE, num_warps
                )
            else:
                _consume_rows(
                    q_smem, ring, turns, job, blk, dest, HKV, G, D, BM, BN, NS, MODE, PP, FIRST,
                    num_warps,
                )  # fmt: skip
        else:
            _consume_rows(
                q_smem, ring, turns, job, blk, dest, HKV, G, D, BM, BN, NS, MODE, PP, FIRST,
                num_warps,
            )  # fmt: skip

    @gluon.jit
    def _softmax_cols(
        s_t,
        m_i,
        l_acc,
        tile,
        masked,
        qk_scale,
        blk,
        G: gl.constexpr,
        BN: gl.constexpr,
        TN: gl.constexpr,
        MODE: gl.constexpr,
        st_layout: gl.constexpr,
    ):
        # the online softmax of a swapped tile S^T [BN, TN]: one column per row
        if masked:
            row0, n_rows, ctx, kv_len, mask_row, stride_mt = blk
            rows = row0 + gl.arange(0, TN, layout=gl.SliceLayout(0, st_layout))
            kv = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, st_layout))
            vis = _visible(
                rows[None, :], kv[:, None], n_rows, ctx, kv_len, mask_row, stride_mt, G, MODE
            )
            s_t = gl.where(vis, s_t, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_t, axis=0) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p_t = gl.exp2(s_t * qk_scale - m_new[None, :])
        return p_t, m_new, alpha, l_acc * alpha[None, :] + p_t

    @gluon.jit
    def _consume_swapped(
        q_smem,
        ring,
        job,
        blk,
        dest,
        HKV: gl.constexpr,
        G: gl.constexpr,
        D: gl.constexpr,
        BN: gl.constexpr,
        TN: gl.constexpr,
        NS: gl.constexpr,
        MODE: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        k_bufs, v_bufs, full, empty = ring
        tile_lo, n_tiles, masked, qk_scale = job
        row0, n_rows = blk[0], blk[1]
        part_o, part_lse, q_start, kvh, split, num_splits = dest
        # <= TN rows (the one-node tail of a 4k+1-node tree, or a decode token's GQA group): a 64-row wgmma would
        # be >= 87% padding, so the product is swapped: S^T = K Q^T ([BN, TN], KV positions as wgmma's M) and
        # O^T = V^T P^T ([D, TN], P^T through shared memory); the softmax runs down the columns
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, TN, 16]
        )
        q_t = q_smem.slice(0, TN).permute((1, 0))  # [D, TN]
        # P^T double-buffered in Q's unused rows (this block has <= TN of its 64): P(j+1) is written while P V(j)
        # reads P(j)
        p_bufs = (
            q_smem.slice(TN, TN).slice(0, BN, dim=1),
            q_smem.slice(2 * TN, TN).slice(0, BN, dim=1),
        )
        m_i = gl.full([TN], -1.0e30, gl.float32, gl.SliceLayout(0, st_layout))
        # column sums deferred to the end: no reduction per tile
        l_acc = gl.zeros([BN, TN], gl.float32, st_layout)
        o_acc = gl.zeros([D, TN], gl.float32, st_layout)
        if n_tiles > 0:
            mbarrier.wait(full.index(0), 0)
            s_t = warpgroup_mma(
                k_bufs.index(0), q_t, gl.zeros([BN, TN], gl.float32, st_layout), use_acc=False
            )
            p_t, m_i, alpha, l_acc = _softmax_cols(
                s_t,
                m_i,
                l_acc,
                tile_lo,
                masked,
                qk_scale,
                blk,
                G,
                BN,
                TN,
                MODE,
                st_layout,
            )
            p_bufs[0].store(gl.permute(p_t.to(q_smem.dtype), (1, 0)))
            for j in range(n_tiles - 1):
                slot = j % NS
                nxt = (j + 1) % NS
                fence_async_shared()
                gl.thread_barrier()  # every warp's part of P(j) is in shared memory
                mbarrier.wait(full.index(nxt), ((j + 1) // NS) & 1)
                s_tok = warpgroup_mma(
                    k_bufs.index(nxt),
                    q_t,
                    gl.zeros([BN, TN], gl.float32, st_layout),
                    use_acc=False,
                    is_async=True,
                )
                if j % 2 == 0:
                    o_tok = warpgroup_mma(
                        v_bufs.index(slot).permute((1, 0)),
                        p_bufs[0].permute((1, 0)),
                        o_acc,
                        is_async=True,
                    )
                else:
                    o_tok = warpgroup_mma(
                        v_bufs.index(slot).permute((1, 0)),
                        p_bufs[1].permute((1, 0)),
                        o_acc,
                        is_async=True,
                    )
                s_t = warpgroup_mma_wait(1, deps=(s_tok,))
                p_t, m_i, alpha, l_acc = _softmax_cols(
                    s_t,
                    m_i,
                    l_acc,
                    tile_lo + j + 1,
                    masked,
                    qk_scale,
                    blk,
                    G,
                    BN,
                    TN,
                    MODE,
                    st_layout,
                )
                # the other buffer: P V(j - 1), its last reader, was waited for last iteration
                if j % 2 == 0:
                    p_bufs[1].store(gl.permute(p_t.to(q_smem.dtype), (1, 0)))
                else:
                    p_bufs[0].store(gl.permute(p_t.to(q_smem.dtype), (1, 0)))
                o_acc = warpgroup_mma_wait(0, deps=(o_tok,))
                mbarrier.arrive(empty.index(slot))
                o_acc = o_acc * alpha[None, :]
            last = (n_tiles - 1) % NS
            fence_async_shared()
            gl.thread_barrier()
            if (n_tiles - 1) % 2 == 0:
                o_acc = warpgroup_mma(
                    v_bufs.index(last).permute((1, 0)), p_bufs[0].permute((1, 0)), o_acc
                )
            else:
                o_acc = warpgroup_mma(
                    v_bufs.index(last).permute((1, 0)), p_bufs[1].permute((1, 0)), o_acc
                )
        l_i = gl.sum(l_acc, axis=0)

        lse = _log2_sum_exp(m_i, l_i)
        o = o_acc / gl.where(l_i > 0.0, l_i, 1.0)[None, :]
        rows = row0 + gl.arange(0, TN, layout=gl.SliceLayout(0, st_layout))
        d = gl.arange(0, D, layout=gl.SliceLayout(1, st_layout))
        base = _partial_index(rows, q_start, kvh, split, num_splits, HKV, G)
        gl.store(part_o + base[None, :] * D + d[:, None], o, mask=(rows < n_rows)[None, :])
        gl.store(part_lse + base, lse, mask=rows < n_rows)

    @gluon.jit
    def _consume_rows(
        q_smem,
        ring,
        turns,
        job,
        blk,
        dest,
        HKV: gl.constexpr,
        G: gl.constexpr,
        D: gl.constexpr,
        BM: gl.constexpr,
        BN: gl.constexpr,
        NS: gl.constexpr,
        MODE: gl.constexpr,
        PP: gl.constexpr,
        FIRST: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        k_bufs, v_bufs, full, empty = ring
        turn_mine, turn_other = turns
        tile_lo, n_tiles, masked, qk_scale = job
        row0, n_rows = blk[0], blk[1]
        part_o, part_lse, q_start, kvh, split, num_splits = dest
        # online softmax over the tiles as they land in `full` slots; each slot goes back through `empty`
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        # Q in registers: each tile's Q K^T reads only K from shared memory (with 128-wide tiles the registers go to
        # S and P instead, as in FA3)
        QREG: gl.constexpr = BN == 64
        if QREG:
            q_op = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        else:
            q_op = q_smem
        # finite running max: a row with nothing visible yet keeps p = 0 instead of NaN
        m_i = gl.full([BM], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.full([BM], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
        o_acc = gl.zeros([BM, D], gl.float32, o_layout)
        if n_tiles > 0:
            mbarrier.wait(full.index(0), 0)
            s_tok = warpgroup_mma(
                q_op,
                k_bufs.index(0).permute((1, 0)),
                gl.zeros([BM, BN], gl.float32, s_layout),
                use_acc=False,
                is_async=True,
            )
            if QREG:
                s, q_op = warpgroup_mma_wait(0, deps=(s_tok, q_op))
            else:
                s = warpgroup_mma_wait(0, deps=(s_tok,))
            if masked:
                s = _mask_tile(
                    s,
                    tile_lo,
                    blk,
                    G,
                    BM,
                    BN,
                    MODE,
                    s_layout,
                )
            m_i = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            p = gl.exp2(s * qk_scale - m_i[:, None])
            l_i = gl.sum(p, axis=1)
            p_op = gl.convert_layout(p.to(k_bufs.dtype), p_layout)
            for j in range(n_tiles - 1):
                slot = j % NS
                nxt = (j + 1) % NS
                mbarrier.wait(full.index(nxt), ((j + 1) // NS) & 1)
                if PP:
                    # a fresh barrier passes parity 1: FIRST goes first
                    mbarrier.wait(turn_mine, (j & 1) ^ FIRST)
                s_tok = warpgroup_mma(
                    q_op,
                    k_bufs.index(nxt).permute((1, 0)),
                    gl.zeros([BM, BN], gl.float32, s_layout),
                    use_acc=False,
                    is_async=True,
                )
                o_tok = warpgroup_mma(p_op, v_bufs.index(slot), o_acc, is_async=True)
                if PP:
                    mbarrier.arrive(turn_other)
                if QREG:  # FIFO: S(j+1) done; P V(j) may still run
                    s, q_op = warpgroup_mma_wait(1, deps=(s_tok, q_op))
                else:
                    s = warpgroup_mma_wait(1, deps=(s_tok,))
                if masked:
                    s = _mask_tile(
                        s,
                        tile_lo + j + 1,
                        blk,
                        G,
                        BM,
                        BN,
                        MODE,
                        s_layout,
                    )
                m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
                alpha = gl.exp2(m_i - m_new)
                p = gl.exp2(s * qk_scale - m_new[:, None])
                l_i = l_i * alpha + gl.sum(p, axis=1)
                m_i = m_new
                # ptxas hoists this above the softmax
                o_acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
                # after a partition barrier: every warp is past tile j
                mbarrier.arrive(empty.index(slot))
                p_op = gl.convert_layout(p.to(k_bufs.dtype), p_layout)
                o_acc = o_acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            last = (n_tiles - 1) % NS
            o_tok = warpgroup_mma(p_op, v_bufs.index(last), o_acc, is_async=True)
            o_acc = warpgroup_mma_wait(0, deps=(o_tok,))

        # normalised partial + log-sum-exp (base 2), as the Triton kernel's SPLIT store
        lse = _log2_sum_exp(m_i, l_i)
        l_o = gl.convert_layout(gl.where(l_i > 0.0, l_i, 1.0), gl.SliceLayout(1, o_layout))
        o = o_acc / l_o[:, None]
        rows_o = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
        d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        base = _partial_index(rows_o, q_start, kvh, split, num_splits, HKV, G)
        gl.store(part_o + base[:, None] * D + d_o[None, :], o, mask=(rows_o < n_rows)[:, None])
        rows_s = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        base_s = _partial_index(rows_s, q_start, kvh, split, num_splits, HKV, G)
        gl.store(part_lse + base_s, lse, mask=rows_s < n_rows)
