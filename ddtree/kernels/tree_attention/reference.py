"""Plain PyTorch oracle for `paged_attention`: dense per-request gather, softmax in fp32 (or float64)."""

from __future__ import annotations

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
