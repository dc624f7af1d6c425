"""The split-KV paged attention kernel (Triton) for decode, chain/tree verify, causal extend and drafter
blocks, beside its oracle `reference.py`; `launch.py` builds its arguments, plans and launches it (the
contract is there).

Grid (q_block, request * kv_head, split). A program's M rows are (token, query head of the kv head's GQA group)
pairs, row = t * G + g, so every K/V tile is read once for the whole group. Each program streams KV tiles with an
fp32 online softmax (base 2). The positions every row of the block sees ([0, ctx), more under causal) run as
full BLOCK_N tiles with no mask at all (pipelined), split into contiguous runs, one per split; the partial last
context tile and the new tokens (TREE_N-wide tiles starting at ctx, so tree-mask columns start at 0) run masked
in the last split, unpipelined. With `tail_split` (default) and > 1 split, that last split does only the masked
tiles, beside the context splits instead of after one of them. With one split the program writes the output;
otherwise it writes a normalised partial and its log-sum-exp, and `merge.combine` merges them. The mask stays a
plain bool tensor (read as uint8), gathered only on the TREE_N-wide tiles: gathered on 64-wide masked tiles it
made the kernel spill on sm_90, on 16-wide ones it does not (studies/tree_attention_compile_report.py).
All launch shapes depend only on host ints (batch, max q_len, num_splits); per-request lengths are read on the
device, so the calls are CUDA-graph capturable with static metadata tensors (launch once before capturing:
the first call compiles).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ddtree.kernels.tree_attention.merge import gdc_launch_dependents
from ddtree.kernels.tree_attention.tuning import patch_interpreter_index

if triton.knobs.runtime.interpret:
    patch_interpreter_index()

# Reductions use tl.reduce with the standard combine functions, and tl.full instead of tl.zeros: tl.max,
# tl.sum and tl.zeros are @jit functions that the interpreter cannot call when triton was imported before
# TRITON_INTERPRET was set (it recognises these combine functions and reduces with numpy); same IR on GPU.
# finite running max: a row with nothing visible yet keeps p = 0 instead of NaN
_NEG_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    # DOT 0: native tensor-core dot; 1: fp32 inputs, exact ("ieee", not tf32); 2: upcast first (the CPU
    # interpreter mis-multiplies bf16; bf16 products are exact in fp32, so this is the same function)
    if DOT == 0:
        return tl.dot(a, b)
    elif DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _load_kv(
    j,
    hi,
    k_pool,
    v_pool,
    bt_row,
    kv_off,
    d,
    ctx,
    stride_s,
    k_ext,
    v_ext,
    stride_es,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    EXTRA: tl.constexpr,
):
    # MASKED 0: a full context tile, every position visible (no masks: pipelined); 1: the partial context tile
    # j < hi (hi <= ctx: pool only, visible to every row); 2: a tile of the new tokens, j < hi = kv_len.
    if MASKED == 0:
        page = tl.load(bt_row + j // PAGE)
        j_ok = j >= 0
    else:
        j_ok = j < hi
        in_pool = j_ok
        if EXTRA and MASKED == 2:
            in_pool = j_ok & (j < ctx)  # positions ctx.. come from the dense k_ext / v_ext rows
        page = tl.load(bt_row + j // PAGE, mask=in_pool, other=0)
    slot = page * PAGE + j % PAGE
    off = (
        slot[:, None] * stride_s + kv_off + d[None, :]
    )  # K and V pools share strides (host-checked)
    if MASKED == 0:
        k = tl.load(k_pool + off)
        v = tl.load(v_pool + off)
    else:
        k = tl.load(k_pool + off, mask=in_pool[:, None], other=0.0)
        v = tl.load(v_pool + off, mask=in_pool[:, None], other=0.0)
        if EXTRA and MASKED == 2:
            e_ok = (j >= ctx) & j_ok
            e_off = j[:, None] * stride_es + d[None, :]
            k = tl.where(e_ok[:, None], tl.load(k_ext + e_off, mask=e_ok[:, None], other=0.0), k)
            v = tl.where(e_ok[:, None], tl.load(v_ext + e_off, mask=e_ok[:, None], other=0.0), v)
    return k, v, j_ok


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    k,
    v,
    j_ok,
    c,
    j_abs,
    q,
    row_t,
    mask_ptr,
    mask_row,
    qk_scale,
    win_lo,
    win_hi,
    MASKED: tl.constexpr,
    MODE: tl.constexpr,
    DOT: tl.constexpr,
    WINDOW: tl.constexpr,
):
    # One online-softmax step of a row block over a loaded K/V tile; masked tiles apply the MODE's visibility
    # among the new tokens (tree mask / causal / all). c = j - ctx: the new token's index, so the mask columns
    # stay aligned.
    s = _dot(q, tl.trans(k), DOT)
    if MASKED == 1:
        s = tl.where(j_ok[None, :], s, float("-inf"))
    elif MASKED == 2:
        if MODE == 1:
            bits = tl.load(mask_ptr + (mask_row[:, None] + c[None, :]), mask=j_ok[None, :], other=0)
            vis = (bits != 0) & j_ok[None, :]
        elif MODE == 0:
            vis = (c[None, :] <= row_t[:, None]) & j_ok[None, :]
        else:
            # (always-true row term: broadcast to the tile)
            vis = j_ok[None, :] & (row_t >= 0)[:, None]
        s = tl.where(vis, s, float("-inf"))
    if WINDOW:
        # sliding window: key positions j_abs in [win_lo, win_hi] per row (an all-masked tile adds
        # p = 0: the running max stays finite)
        in_win = (j_abs[None, :] >= win_lo[:, None]) & (j_abs[None, :] <= win_hi[:, None])
        s = tl.where(in_win, s, float("-inf"))
    # qk_scale > 0 commutes with max: scale the row max, then one fused multiply-add per score
    m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT)
    return acc, m_new, l_i


@triton.jit
def _load_q(q_ptr, q_start, rows, n_rows, kvh, d, stride_qt, stride_qh, G: tl.constexpr):
    row_ok = rows < n_rows
    row_t = rows // G
    head = kvh * G + rows % G
    q = tl.load(
        q_ptr + (q_start + row_t)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    return q, row_ok, row_t, head


@triton.jit
def _store_rows(
    acc,
    m_i,
    l_i,
    row_ok,
    row_t,
    head,
    out_ptr,
    part_o,
    part_lse,
    num_splits,
    split,
    q_start,
    d,
    stride_ot,
    stride_oh,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tok = q_start + row_t
    if SPLIT:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        base = (tok * (HKV * G) + head) * num_splits + split
        tl.store(part_lse + base, lse, mask=row_ok)
        tl.store(part_o + base[:, None] * D + d[None, :], o, mask=row_ok[:, None])
    else:
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )


@triton.jit
def _attend_rows(
    row0,
    q_ptr,
    k_pool,
    v_pool,
    bt_row,
    mask_ptr,
    out_ptr,
    part_o,
    part_lse,
    k_ext,
    v_ext,
    qk_scale,
    num_splits,
    split,
    b,
    kvh,
    q_start,
    q_len,
    kv_len,
    stride_qt,
    stride_qh,
    stride_s,
    stride_h,
    stride_ot,
    stride_oh,
    stride_mb,
    stride_mt,
    stride_eh,
    stride_es,
    window,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TREE_N: tl.constexpr,
    MODE: tl.constexpr,
    EXTRA: tl.constexpr,
    SPLIT: tl.constexpr,
    TAIL_SPLIT: tl.constexpr,
    DOT: tl.constexpr,
    WINDOW: tl.constexpr,
):
    n_rows = q_len * G
    ctx = kv_len - q_len
    d = tl.arange(0, D)
    q, row_ok, row_t, head = _load_q(
        q_ptr, q_start, row0 + tl.arange(0, BM), n_rows, kvh, d, stride_qt, stride_qh, G
    )

    t_lo = row0 // G
    t_hi = (tl.minimum(row0 + BM, n_rows) - 1) // G
    # [0, free_end): visible to every row of the block; [free_end, kv_end): the new tokens that need a mask
    if MODE == 0:
        free_end = ctx + t_lo
        kv_end = ctx + t_hi + 1
        if EXTRA:
            free_end = ctx
    else:
        free_end = ctx
        kv_end = kv_len
    # Tiles: n_full unmasked BLOCK_N tiles from 0; one partial context tile if free_end % BLOCK_N; then the
    # new tokens in TREE_N tiles that start at free_end (so tree-mask columns start at 0, 16-aligned).
    n_full = free_end // BLOCK_N
    n_rem = (free_end % BLOCK_N != 0).to(tl.int32)
    # sliding window (positions by index): row t sees keys [ctx + t - window + 1, ctx + t + window - 1];
    # full tiles wholly before the block's first row's window are skipped, the rest masked per row
    first_tile = 0
    qpos = ctx + row_t
    win_lo = qpos - window + 1
    win_hi = qpos + window - 1
    if WINDOW:
        first_tile = tl.minimum(tl.maximum(ctx + t_lo - window + 1, 0) // BLOCK_N, n_full)
    n_new = (kv_end - free_end + TREE_N - 1) // TREE_N
    # Splits: with TAIL_SPLIT (and num_splits > 1) the last split does only the masked tiles and the others
    # share the full tiles, so the unpipelined tail runs beside the context instead of after it; otherwise the
    # last split does its share of full tiles and then the masked tiles.
    ctx_splits = num_splits
    if TAIL_SPLIT:
        ctx_splits = tl.maximum(num_splits - 1, 1)
    per_split = (n_full - first_tile + ctx_splits - 1) // ctx_splits
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_full)
    last = split == num_splits - 1
    n_masked = tl.where(last, n_new, 0)
    n_rem = tl.where(last, n_rem, 0)

    kv_off = kvh * stride_h
    mask_ptr += b * stride_mb
    # int32 offsets: a [BM, TREE_N] tensor of 64-bit pointers costs registers
    mask_row = row_t * stride_mt
    acc = tl.full([BM, D], 0.0, dtype=tl.float32)
    m_i = tl.full([BM], _NEG_INIT, dtype=tl.float32)
    l_i = tl.full([BM], 0.0, dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    tcols = tl.arange(0, TREE_N)
    # k_ext + ext_off + j * stride_es: position j
    ext_off = (q_start - ctx) * stride_es + kvh * stride_eh
    k_ext += ext_off
    v_ext += ext_off

    # what every tile's load and softmax step share
    src = (k_pool, v_pool, bt_row, kv_off, d, ctx, stride_s, k_ext, v_ext, stride_es)
    rows = (q, row_t, mask_ptr, mask_row, qk_scale, win_lo, win_hi)
    for tile in range(tile_lo, tile_hi):
        j = tile * BLOCK_N + cols
        k, v, j_ok = _load_kv(j, kv_len, *src, PAGE, 0, EXTRA)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, k, v, j_ok, j, j, *rows, 0, MODE, DOT, WINDOW)
    for tile in tl.range(n_full, n_full + n_rem, num_stages=1):
        j = tile * BLOCK_N + cols
        k, v, j_ok = _load_kv(j, free_end, *src, PAGE, 1, EXTRA)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, k, v, j_ok, j, j, *rows, 1, MODE, DOT, WINDOW)
    for kk in tl.range(0, n_masked, num_stages=1):
        c = (free_end - ctx) + kk * TREE_N + tcols
        k, v, j_ok = _load_kv(ctx + c, kv_len, *src, PAGE, 2, EXTRA)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, k, v, j_ok, c, ctx + c, *rows, 2, MODE, DOT, WINDOW
        )

    _store_rows(
        acc,
        m_i,
        l_i,
        row_ok,
        row_t,
        head,
        out_ptr,
        part_o,
        part_lse,
        num_splits,
        split,
        q_start,
        d,
        stride_ot,
        stride_oh,
        HKV,
        G,
        D,
        SPLIT,
    )


@triton.jit
def split_kv_attn(
    q_ptr,
    k_pool,
    v_pool,
    block_table,
    qo_indptr,
    kv_lens,
    mask_ptr,
    out_ptr,
    part_o,
    part_lse,
    k_ext,
    v_ext,
    qk_scale,
    num_splits,
    stride_qt,
    stride_qh,
    stride_s,
    stride_h,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_mb,
    stride_mt,
    stride_eh,
    stride_es,
    window,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TAIL_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TREE_N: tl.constexpr,
    MODE: tl.constexpr,
    EXTRA: tl.constexpr,
    SPLIT: tl.constexpr,
    TAIL_SPLIT: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()  # the merge's programs may start; they wait for this grid in gdc_wait
    qb = tl.program_id(0)
    b = tl.program_id(1) // HKV
    kvh = tl.program_id(1) % HKV
    split = tl.program_id(2)
    q_start = tl.load(qo_indptr + b)
    q_len = (tl.load(qo_indptr + b + 1) - q_start).to(tl.int32)
    n_rows = q_len * G
    row0 = qb * BLOCK_M
    kv_len = tl.load(kv_lens + b).to(tl.int32)
    bt_row = block_table + b * stride_bt
    args = (
        q_ptr,
        k_pool,
        v_pool,
        bt_row,
        mask_ptr,
        out_ptr,
        part_o,
        part_lse,
        k_ext,
        v_ext,
        qk_scale,
        num_splits,
        split,
        b,
        kvh,
        q_start,
        q_len,
        kv_len,
        stride_qt,
        stride_qh,
        stride_s,
        stride_h,
        stride_ot,
        stride_oh,
        stride_mb,
        stride_mt,
        stride_eh,
        stride_es,
        window,
    )
    if row0 >= n_rows:
        return
    # A last block with few rows (65 tree nodes x 4 heads = 4 x 64 + 4) runs at TAIL_M rows instead of
    # BLOCK_M: the same KV stream for a fraction of the MMA work.
    if TAIL_M > 0 and n_rows - row0 <= TAIL_M:
        _attend_rows(
            row0,
            *args,
            HKV,
            G,
            D,
            PAGE,
            TAIL_M,
            BLOCK_N,
            TREE_N,
            MODE,
            EXTRA,
            SPLIT,
            TAIL_SPLIT,
            DOT,
            WINDOW,
        )
    else:
        _attend_rows(
            row0,
            *args,
            HKV,
            G,
            D,
            PAGE,
            BLOCK_M,
            BLOCK_N,
            TREE_N,
            MODE,
            EXTRA,
            SPLIT,
            TAIL_SPLIT,
            DOT,
            WINDOW,
        )
