"""Plain PyTorch attention over paged KV: the reference every kernel is tested against, and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.attention.metadata import AttentionMetadata, DraftAttentionMetadata, store_kv
from ddtree.kernels.paged import gather_slots


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hkv, D], mask [Lq, Lk] bool -> [Lq, Hq, D]; fp32 softmax."""
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).float()
    kh = k.transpose(0, 1).float().repeat_interleave(groups, 0)
    vh = v.transpose(0, 1).float().repeat_interleave(groups, 0)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[None], scale=scale)
    return out.transpose(0, 1).to(q.dtype)


class TorchReferenceBackend:
    name = "torch"

    def launch_plan(self, shape, device: torch.device, num_splits: int | None = None):
        from ddtree.kernels.tree_attention.dispatch import reference_plan

        return reference_plan(f"--attention-backend {self.name} is not capturable (use triton)")

    def with_splits(self, num_splits: int | None):
        return self

    def reads_host_q_lens(self, head_dim: int, device: torch.device) -> bool:
        return True  # `extend` loops over them

    def extend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        store_kv(kv_cache, meta.slot_mapping, k, v)
        kc, vc = kv_cache
        out = torch.empty_like(q)
        s = 0
        for i, (ql, kvl) in enumerate(zip(meta.q_lens, meta.kv_lens)):
            if ql == 0:
                continue
            slots = gather_slots(meta.block_table[i], kvl, meta.page_size)
            ctx = kvl - ql
            mask = torch.ones(ql, kvl, dtype=torch.bool, device=q.device)
            if meta.tree_mask is not None:
                mask[:, ctx:] = meta.tree_mask[i, :ql, :ql]
            else:
                mask[:, ctx:] = torch.ones(ql, ql, dtype=torch.bool, device=q.device).tril()
            out[s : s + ql] = _sdpa(q[s : s + ql], kc[slots], vc[slots], mask, scale)
            s += ql
        return out

    def draft_block(self, q, k, v, ctx_cache, meta: DraftAttentionMetadata, scale, causal, window):
        kc, vc = ctx_cache
        b, S = q.shape[:2]
        out = torch.empty_like(q)
        for i, cl in enumerate(meta.ctx_lens):
            slots = gather_slots(meta.block_table[i], cl, meta.page_size)
            keys = torch.cat([kc[slots].to(k.dtype), k[i]], 0)
            vals = torch.cat([vc[slots].to(v.dtype), v[i]], 0)
            qpos = meta.block_positions[i]
            kpos = torch.cat([torch.arange(cl, device=q.device), qpos])
            mask = draft_visibility(qpos, kpos, causal, window)
            out[i] = _sdpa(q[i], keys, vals, mask, scale)
        return out


def draft_visibility(
    qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    """[Sq, Sk] bool visibility for the drafter (z-lab semantics; see AttentionBackend.draft_block)."""
    dq = qpos[:, None] - kpos[None, :]
    vis = torch.ones_like(dq, dtype=torch.bool)
    if causal:
        vis &= dq >= 0
    if window is not None:
        vis &= dq < window
        if not causal:
            vis &= -dq < window
    return vis
