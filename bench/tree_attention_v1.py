"""FROZEN BASELINE (the kernel as of commit 1f054d8, timed on the H200 in BENCHMARKS.md), kept only so that
bench/gpu_tree_attention.py can time old against new in one run; not used by the engine.

Split-KV paged attention for decode, chain/tree verify, causal extend and drafter blocks (Triton).

Contract (same as `reference.paged_attention_reference`): q [T, Hq, D] holds request i's q_len_i new tokens at
rows qo_indptr[i]..qo_indptr[i+1]; they sit at logical KV positions kv_len_i - q_len_i .. kv_len_i - 1, whose
K/V are in the paged pools (or, with `new_kv`, in dense rows aligned with q). Every cached position
(< kv_len_i - q_len_i) is visible; among the new tokens visibility is causal, all-to-all (causal=False), or
`tree_mask[i, t, c]` (bool [b, n, n], n >= max q_len, ancestors-and-self).

Grid (q_block, request * kv_head, split). A program's M rows are (token, query head of the kv head's GQA group)
pairs, row = t * G + g, so every K/V tile is read once for the whole group. The KV range of a request is cut
into `num_splits` contiguous runs of tiles; each program streams its run with an fp32 online softmax (base 2).
Tiles wholly before the first position any row of the block can lose run with no mask at all (pipelined);
only the few trailing tiles (the new tokens) evaluate causality or load the tree mask, in an unpipelined loop.
With one split the program writes the output; otherwise it writes a normalised partial and its log-sum-exp,
and `_combine` merges them. The mask stays a plain bool tensor (read as uint8): it is gathered only on those
trailing tiles, and the main loop compiles spill-free on sm_90 with it, so bit-packing would buy little.
All launch shapes depend only on host ints (batch, max q_len, num_splits); per-request lengths are read on the
device, so the calls are CUDA-graph capturable with static metadata tensors (launch once before capturing:
the first call compiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels.tree_attention.tuning import (
    KernelConfig,
    choose_num_splits,
    last_launch,
    patch_interpreter_index,
    resident_slots,
)


if triton.knobs.runtime.interpret:
    patch_interpreter_index()


def default_config(rows_per_request: int, head_dim: int = 128) -> KernelConfig:
    """v1's own config table (frozen; the package's default_config has moved on)."""
    block_n = 64 if head_dim <= 128 else 32
    if rows_per_request <= 16:
        return KernelConfig(16, block_n, 4, 3)
    if rows_per_request <= 32:
        return KernelConfig(32, block_n, 4, 3)
    return KernelConfig(64, block_n, 4, 3)

# Reductions use tl.reduce with the standard combine functions, and tl.full instead of tl.zeros: tl.max,
# tl.sum and tl.zeros are @jit functions that the interpreter cannot call when triton was imported before
# TRITON_INTERPRET was set (it recognises these combine functions and reduces with numpy); same IR on GPU.
_NEG_INIT = tl.constexpr(-1.0e30)  # finite running max: a row with nothing visible yet keeps p = 0 instead of NaN
_LOG2E = 1.4426950408889634


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
def _kv_step(acc, m_i, l_i, q, k_pool, v_pool, bt_row, kv_off, d, j, qk_scale, row_t, ctx, kv_len,
             mask_ptr, mask_row, q_len, stride_s, k_ext, v_ext, stride_es, PAGE: tl.constexpr,
             MASKED: tl.constexpr, MODE: tl.constexpr, EXTRA: tl.constexpr, DOT: tl.constexpr):
    if MASKED:
        j_ok = j < kv_len
        in_pool = j_ok
        if EXTRA:
            in_pool = j < ctx  # positions ctx.. come from the dense k_ext / v_ext rows
        page = tl.load(bt_row + j // PAGE, mask=in_pool, other=0)
    else:
        page = tl.load(bt_row + j // PAGE)
    slot = page * PAGE + j % PAGE
    off = slot[:, None] * stride_s + kv_off + d[None, :]  # K and V pools share strides (host-checked)
    k_ptrs = k_pool + off
    v_ptrs = v_pool + off
    if MASKED:
        k = tl.load(k_ptrs, mask=in_pool[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=in_pool[:, None], other=0.0)
        if EXTRA:
            e_ok = (j >= ctx) & j_ok
            e_off = j[:, None] * stride_es + d[None, :]
            k = tl.where(e_ok[:, None], tl.load(k_ext + e_off, mask=e_ok[:, None], other=0.0), k)
            v = tl.where(e_ok[:, None], tl.load(v_ext + e_off, mask=e_ok[:, None], other=0.0), v)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = _dot(q, tl.trans(k), DOT)
    if MASKED:
        c = j[None, :] - ctx
        if MODE == 1:
            in_tree = (c >= 0) & (c < q_len) & j_ok[None, :]
            bits = tl.load(mask_ptr + (mask_row[:, None] + c), mask=in_tree, other=0)
            vis = ((c < 0) | (bits != 0)) & j_ok[None, :]
        elif MODE == 0:
            vis = (c <= row_t[:, None]) & j_ok[None, :]
        else:
            vis = j_ok[None, :] & (row_t >= 0)[:, None]  # (always-true row term: broadcast to the tile)
        s = tl.where(vis, s, float("-inf"))
    # qk_scale > 0 commutes with max: scale the row max, then one fused multiply-add per score
    m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT)
    return acc, m_new, l_i


@triton.jit
def _attend_rows(
    row0, q_ptr, k_pool, v_pool, bt_row, mask_ptr, out_ptr, part_o, part_lse, k_ext, v_ext, qk_scale,
    num_splits, split, b, kvh, q_start, q_len, kv_len,
    stride_qt, stride_qh, stride_s, stride_h, stride_ot, stride_oh, stride_mb, stride_mt,
    stride_eh, stride_es,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BM: tl.constexpr,
    BLOCK_N: tl.constexpr, MODE: tl.constexpr, EXTRA: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
):
    n_rows = q_len * G
    ctx = kv_len - q_len
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < n_rows
    row_t = rows // G
    head = kvh * G + rows % G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (q_start + row_t)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)

    t_lo = row0 // G
    t_hi = (tl.minimum(row0 + BM, n_rows) - 1) // G
    if MODE == 0:
        free_end = ctx + t_lo
        kv_end = ctx + t_hi + 1
        if EXTRA:
            free_end = ctx
    else:
        free_end = ctx
        kv_end = kv_len
    n_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N
    per_split = (n_tiles + num_splits - 1) // num_splits
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    free_tiles = free_end // BLOCK_N

    kv_off = kvh * stride_h
    mask_ptr += b * stride_mb
    mask_row = row_t * stride_mt  # int32 offsets: a [BM, BLOCK_N] tensor of 64-bit pointers costs registers
    acc = tl.full([BM, D], 0.0, dtype=tl.float32)
    m_i = tl.full([BM], _NEG_INIT, dtype=tl.float32)
    l_i = tl.full([BM], 0.0, dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    ext_off = (q_start - ctx) * stride_es + kvh * stride_eh  # k_ext + ext_off + j * stride_es: position j
    k_ext += ext_off
    v_ext += ext_off

    for tile in range(tile_lo, tl.minimum(tile_hi, free_tiles)):
        acc, m_i, l_i = _kv_step(acc, m_i, l_i, q, k_pool, v_pool, bt_row, kv_off, d,
                                 tile * BLOCK_N + cols, qk_scale, row_t, ctx, kv_len, mask_ptr, mask_row, q_len,
                                 stride_s, k_ext, v_ext, stride_es, PAGE, False, MODE, EXTRA, DOT)
    for tile in tl.range(tl.maximum(tile_lo, free_tiles), tile_hi, num_stages=1):
        acc, m_i, l_i = _kv_step(acc, m_i, l_i, q, k_pool, v_pool, bt_row, kv_off, d,
                                 tile * BLOCK_N + cols, qk_scale, row_t, ctx, kv_len, mask_ptr, mask_row, q_len,
                                 stride_s, k_ext, v_ext, stride_es, PAGE, True, MODE, EXTRA, DOT)

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tok = q_start + row_t
    if SPLIT:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        base = (tok * (HKV * G) + head) * num_splits + split
        tl.store(part_lse + base, lse, mask=row_ok)
        tl.store(part_o + base[:, None] * D + d[None, :], o, mask=row_ok[:, None])
    else:
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _split_kv_attn(
    q_ptr, k_pool, v_pool, block_table, qo_indptr, kv_lens, mask_ptr, out_ptr, part_o, part_lse, k_ext, v_ext,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_s, stride_h, stride_bt, stride_ot, stride_oh,
    stride_mb, stride_mt, stride_eh, stride_es,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, EXTRA: tl.constexpr, SPLIT: tl.constexpr,
    DOT: tl.constexpr,
):
    qb = tl.program_id(0)
    b = tl.program_id(1) // HKV
    kvh = tl.program_id(1) % HKV
    split = tl.program_id(2)
    q_start = tl.load(qo_indptr + b)
    q_len = (tl.load(qo_indptr + b + 1) - q_start).to(tl.int32)
    row0 = qb * BLOCK_M
    if row0 >= q_len * G:
        return
    kv_len = tl.load(kv_lens + b).to(tl.int32)
    bt_row = block_table + b * stride_bt
    # A last block with few rows (65 tree nodes x 4 heads = 4 x 64 + 4) runs at TAIL_M rows instead of
    # BLOCK_M: the same KV stream for a fraction of the MMA work.
    if TAIL_M > 0 and q_len * G - row0 <= TAIL_M:
        _attend_rows(row0, q_ptr, k_pool, v_pool, bt_row, mask_ptr, out_ptr, part_o, part_lse, k_ext, v_ext,
                     qk_scale, num_splits, split, b, kvh, q_start, q_len, kv_len, stride_qt, stride_qh, stride_s,
                     stride_h, stride_ot, stride_oh, stride_mb, stride_mt,
                     stride_eh, stride_es,
                     HKV, G, D, PAGE, TAIL_M, BLOCK_N, MODE, EXTRA, SPLIT, DOT)
    else:
        _attend_rows(row0, q_ptr, k_pool, v_pool, bt_row, mask_ptr, out_ptr, part_o, part_lse, k_ext, v_ext,
                     qk_scale, num_splits, split, b, kvh, q_start, q_len, kv_len, stride_qt, stride_qh, stride_s,
                     stride_h, stride_ot, stride_oh, stride_mb, stride_mt,
                     stride_eh, stride_es,
                     HKV, G, D, PAGE, BLOCK_M, BLOCK_N, MODE, EXTRA, SPLIT, DOT)


@triton.jit
def _combine(part_o, part_lse, out_ptr, num_splits, stride_ot, stride_oh,
             HQ: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    tok = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    base = (tok * HQ + h) * num_splits
    lse = tl.load(part_lse + base + s, mask=s_ok, other=float("-inf"))
    top = tl.reduce(lse, 0, tl.standard._elementwise_max)
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    d = tl.arange(0, D)
    o = tl.load(part_o + (base + s)[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    res = tl.reduce(o * w[:, None], 0, tl.standard._sum_combine) / tl.reduce(w, 0, tl.standard._sum_combine)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty))


def _dot_mode(dtype: torch.dtype) -> int:
    if triton.knobs.runtime.interpret:
        return 2
    return 1 if dtype == torch.float32 else 0


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
    qo_indptr: torch.Tensor, kv_lens: torch.Tensor, page_size: int, scale: float, *,
    max_q_len: int, max_kv_len: int, tree_mask: torch.Tensor | None = None, causal: bool = True,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, num_splits: int | None = None,
    config: KernelConfig | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See the module docstring. `max_q_len` and `max_kv_len` are host ints bounding the batch (they size the
    grid and the split count only; pass the captured maxima under a CUDA graph). Without a tree mask the new
    tokens see each other causally, or all of them when `causal` is False. `new_kv` = (k, v) [T, Hkv, D] rows
    aligned with q: the new tokens' K/V are read from there instead of the pools (the drafter's block K/V,
    which is never stored). Returns [T, Hq, D]."""
    T, hq, dim = q.shape
    hkv = k_pool.shape[1]
    assert hq % hkv == 0 and dim == k_pool.shape[2] and dim >= 16 and dim & (dim - 1) == 0
    assert k_pool.stride(-1) == 1 and k_pool.stride() == v_pool.stride()
    group = hq // hkv
    b = qo_indptr.shape[0] - 1
    if out is None:
        out = torch.empty(T, hq, dim, dtype=q.dtype, device=q.device)
    if T == 0 or b == 0:
        return out
    if q.dtype != k_pool.dtype or q.stride(-1) != 1:
        q = q.to(k_pool.dtype).contiguous()
    cfg = config or default_config(max_q_len * group, dim)
    q_blocks = -(-(max_q_len * group) // cfg.block_m)
    mode = 1 if tree_mask is not None else 0 if causal else 2
    if tree_mask is not None:
        mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
        assert mask.stride(-1) == 1
        smb, smt = mask.stride(0), mask.stride(1)
    else:
        mask, smb, smt = kv_lens, 0, 0
    if new_kv is not None:
        k_ext, v_ext = (t.to(k_pool.dtype).contiguous() for t in new_kv)
        assert k_ext.shape == (T, hkv, dim) and v_ext.shape == (T, hkv, dim)
    else:
        k_ext = v_ext = k_pool
    consts = dict(HKV=hkv, G=group, D=dim, PAGE=page_size, BLOCK_M=cfg.block_m, TAIL_M=cfg.tail_m,
                  BLOCK_N=cfg.block_n, MODE=mode, EXTRA=new_kv is not None, DOT=_dot_mode(k_pool.dtype),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def args(split_count, part_o, part_lse):
        return (q, k_pool, v_pool, block_table, qo_indptr, kv_lens, mask, out, part_o, part_lse, k_ext, v_ext,
                scale * _LOG2E, split_count,
                q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), block_table.stride(0),
                out.stride(0), out.stride(1), smb, smt, k_ext.stride(1), k_ext.stride(0))

    if num_splits is None:
        key = tuple(sorted((k, str(v)) for k, v in consts.items())) + (str(k_pool.dtype),)
        f32 = torch.empty(1, dtype=torch.float32, device=q.device)
        slots = resident_slots(q.device, key, lambda: _split_kv_attn.warmup(
            *args(2, f32, f32), grid=(1,), SPLIT=True, **consts))
        num_splits = choose_num_splits(q_blocks * b * hkv, max_kv_len, cfg.block_n, slots)
    split = num_splits > 1
    if split:
        part_o = torch.empty(T, hq, num_splits, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(T, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out
    last_launch.update(config=cfg, num_splits=num_splits, grid=(q_blocks, b * hkv, num_splits))
    _split_kv_attn[(q_blocks, b * hkv, num_splits)](*args(num_splits, part_o, part_lse), SPLIT=split, **consts)
    if split:
        _combine[(T, hq)](
            part_o, part_lse, out, num_splits, out.stride(0), out.stride(1),
            HQ=hq, D=dim, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), num_warps=4,
        )
    return out
