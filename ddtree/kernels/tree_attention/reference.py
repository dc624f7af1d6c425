"""Plain PyTorch oracle for `paged_attention`: dense per-request gather, softmax in fp32 (or float64)."""

from __future__ import annotations

import math

import torch

from ddtree.kernels.paged import gather_slots


def visibility(
    n: int,
    kv_len: int,
    tree_mask: torch.Tensor | None,
    causal: bool,
    device,
    window: int | None = None,
) -> torch.Tensor:
    """[n, kv_len] bool: which positions each of a request's n new tokens (at kv_len - n ..) sees: every cached
    position, and among the new tokens the tree mask's ancestors-and-self ([n, n]), or causally, or all.
    A sliding `window` W keeps only keys with |query position - key position| < W (positions by index:
    chains, blocks and decode; never with a tree mask, whose node positions are depths)."""
    vis = torch.ones(n, kv_len, dtype=torch.bool, device=device)
    if tree_mask is not None:
        vis[:, kv_len - n :] = tree_mask.bool()
    elif causal:
        vis[:, kv_len - n :] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if window:
        if tree_mask is not None:
            raise ValueError("a sliding window with a tree mask: node positions are depths")
        dq = torch.arange(kv_len - n, kv_len, device=device)[:, None] - torch.arange(
            kv_len, device=device
        )
        vis &= (dq < window) & (-dq < window)
    return vis


def paged_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    scale: float,
    *,
    tree_mask: torch.Tensor | None = None,
    causal: bool = True,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    acc_dtype: torch.dtype = torch.float32,
    **_unused,
) -> torch.Tensor:
    """Same contract as `ddtree.kernels.tree_attention.launch.paged_attention` (extra kwargs such as
    max_q_len / num_splits are accepted and ignored). Syncs with the device: for tests and the CPU."""
    T, hq, _ = q.shape
    group = hq // k_pool.shape[1]
    out = torch.empty_like(q)
    indptr = qo_indptr.tolist()
    for i, kv_len in enumerate(kv_lens.tolist()):
        s, e = indptr[i], indptr[i + 1]
        n = e - s
        if n == 0:
            continue
        ctx = kv_len - n
        # new_kv: the new tokens' K/V are not in the pools
        stored = ctx if new_kv is not None else kv_len
        slots = gather_slots(block_table[i], stored, page_size)
        k, v = k_pool[slots].to(acc_dtype), v_pool[slots].to(acc_dtype)  # [L, Hkv, D]
        if new_kv is not None:
            k = torch.cat([k, new_kv[0][s:e].to(acc_dtype)])
            v = torch.cat([v, new_kv[1][s:e].to(acc_dtype)])
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        tree = None if tree_mask is None else tree_mask[i, :n, :n]
        vis = visibility(n, kv_len, tree, causal, q.device, window)
        scores = torch.einsum("thd,lhd->htl", q[s:e].to(acc_dtype), k) * scale
        scores = scores.masked_fill(~vis[None], float("-inf"))
        out[s:e] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v).to(q.dtype)
    return out


def split_partials_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    scale: float,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    num_splits: int,
    max_q_len: int,
    mode: int,
    mask: torch.Tensor,
    stride_mb: int,
    stride_mt: int,
    cfg,
    pdl: bool = False,
) -> None:
    """Oracle for `hopper.launch_splits` (same signature; `pdl` is a launch detail, ignored here). A row block
    of cfg.block_m rows (token r // G, query head r % G of its KV head) splits [0, free_end) into block_n tiles,
    free_end = ctx (+ the block's first token under causal mode 0), and split s < num_splits - 1 takes tiles
    [s * per, min((s + 1) * per, n_full)), per = ceil(n_full / (num_splits - 1)), and the last split takes
    [n_full * block_n, kv_len) under the mode's visibility (0 causal, 1 the tree `mask`, 2 all).
    Writes the normalised partial [T, Hq, S, D] and its base-2 log-sum-exp (-inf and zeros where a split sees
    nothing), as the kernels' split stores. A block of <= cfg.tail_n rows, which the kernel computes swapped
    (S^T = K Q^T), has the same splits."""
    hq, hkv = q.shape[1], k_pool.shape[1]
    group, bn, bm = hq // hkv, cfg.block_n, cfg.block_m
    indptr = qo_indptr.tolist()
    for i, kv_len in enumerate(kv_lens.tolist()):
        s0, n = indptr[i], indptr[i + 1] - indptr[i]
        ctx = kv_len - n
        slots = gather_slots(block_table[i], kv_len, page_size)
        t = torch.arange(n, device=q.device)
        tree = (
            mask.view(-1)[i * stride_mb + t[:, None] * stride_mt + t[None, :]]
            if mode == 1
            else None
        )
        vis_req = visibility(n, kv_len, tree, mode == 0, q.device)
        for row0 in range(0, n * group, bm):
            free_end = ctx + (row0 // group if mode == 0 else 0)
            n_full = free_end // bn
            per = -(-n_full // (num_splits - 1))
            rows = torch.arange(row0, min(row0 + bm, n * group), device=q.device)
            tok = rows // group
            vis = vis_req[tok]
            for split in range(num_splits):
                lo, hi = split * per * bn, min((split + 1) * per, n_full) * bn
                if split == num_splits - 1:
                    lo, hi = n_full * bn, kv_len
                for kvh in range(hkv):
                    heads = kvh * group + rows % group
                    k, v = k_pool[slots[lo:hi], kvh].double(), v_pool[slots[lo:hi], kvh].double()
                    s = (q[s0 + tok, heads].double() @ k.T * scale).masked_fill(
                        ~vis[:, lo:hi], float("-inf")
                    )
                    none = torch.full((len(rows),), float("-inf"), device=q.device)
                    lse = torch.logsumexp(s, -1) if hi > lo else none
                    o = torch.nan_to_num((s - lse[:, None]).exp()) @ v if hi > lo else 0.0
                    part_o[s0 + tok, heads, split] = torch.as_tensor(o, dtype=part_o.dtype)
                    part_lse[s0 + tok, heads, split] = (lse / math.log(2)).to(part_lse.dtype)
