"""Plain PyTorch oracle for `paged_attention`: dense per-request gather, softmax in fp32 (or float64)."""

from __future__ import annotations

import math

import torch

from ddtree.attention.backend import gather_slots


def paged_attention_reference(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
    qo_indptr: torch.Tensor, kv_lens: torch.Tensor, page_size: int, scale: float, *,
    tree_mask: torch.Tensor | None = None, causal: bool = True,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, acc_dtype: torch.dtype = torch.float32, **_unused,
) -> torch.Tensor:
    """Same contract as `ddtree.kernels.tree_attention.triton.paged_attention` (extra kwargs such as
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
        stored = ctx if new_kv is not None else kv_len  # new_kv: the new tokens' K/V are not in the pools
        slots = gather_slots(block_table[i], stored, page_size)
        k, v = k_pool[slots].to(acc_dtype), v_pool[slots].to(acc_dtype)  # [L, Hkv, D]
        if new_kv is not None:
            k = torch.cat([k, new_kv[0][s:e].to(acc_dtype)])
            v = torch.cat([v, new_kv[1][s:e].to(acc_dtype)])
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        vis = torch.ones(n, kv_len, dtype=torch.bool, device=q.device)
        if tree_mask is not None:
            vis[:, ctx:] = tree_mask[i, :n, :n].bool()
        elif causal:
            vis[:, ctx:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = torch.einsum("thd,lhd->htl", q[s:e].to(acc_dtype), k) * scale
        scores = scores.masked_fill(~vis[None], float("-inf"))
        out[s:e] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v).to(q.dtype)
    return out


def context_partials_reference(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
    qo_indptr: torch.Tensor, kv_lens: torch.Tensor, page_size: int, scale: float, part_o: torch.Tensor,
    part_lse: torch.Tensor, num_splits: int, max_q_len: int, causal: bool, cfg,
) -> None:
    """Oracle for `hopper.launch_context` (same signature): splits 0 .. num_splits - 2 of every row. Row r of a
    request (token r // G, query head g = r % G of its KV head) sees, in split s, the full block_n tiles
    [s * per, min((s + 1) * per, n_full)) of [0, free_end), with free_end = ctx (+ the block's first token
    under `causal`) and per = ceil(n_full / (num_splits - 1)). Writes the normalised partial [T, Hq, S, D] and
    its log-sum-exp in base 2 (-inf, zeros for an empty split), as the Triton kernel's split stores."""
    hq, hkv = q.shape[1], k_pool.shape[1]
    group, bn, bm = hq // hkv, cfg.block_n, cfg.block_m
    indptr = qo_indptr.tolist()
    for i, kv_len in enumerate(kv_lens.tolist()):
        s0, n = indptr[i], indptr[i + 1] - indptr[i]
        ctx = kv_len - n
        for row0 in range(0, n * group, bm):
            free_end = ctx + (row0 // group if causal else 0)
            n_full = free_end // bn
            per = -(-n_full // (num_splits - 1))
            rows = torch.arange(row0, min(row0 + bm, n * group))
            tok, head = s0 + rows // group, rows % group
            for split in range(num_splits - 1):
                lo, hi = split * per * bn, min((split + 1) * per, n_full) * bn
                for kvh in range(hkv):
                    heads = kvh * group + head
                    if hi <= lo:
                        part_o[tok, heads, split] = 0.0
                        part_lse[tok, heads, split] = float("-inf")
                        continue
                    slots = gather_slots(block_table[i], hi, page_size)[lo:]
                    k, v = k_pool[slots, kvh].double(), v_pool[slots, kvh].double()
                    s = q[tok, heads].double() @ k.T * scale
                    lse = torch.logsumexp(s, -1)
                    part_o[tok, heads, split] = ((s - lse[:, None]).exp() @ v).to(part_o.dtype)
                    part_lse[tok, heads, split] = (lse / math.log(2)).to(part_lse.dtype)
