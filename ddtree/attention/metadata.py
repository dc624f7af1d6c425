"""What one attention call is given, the same for every backend: the metadata of an extend (paged KV,
per-request lengths, an optional tree mask) and of a drafter block, and the paged-KV write."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    q_lens: list[int]  # host copy: new tokens per request
    kv_lens: list[int]  # host copy: visible KV length per request after this forward's write
    qo_indptr: torch.Tensor  # [b+1] int64, offsets of each request's queries in the flat token dim
    kv_lens_t: torch.Tensor  # [b] int64 on device
    block_table: torch.Tensor  # [b, max_pages] int64 page ids
    slot_mapping: torch.Tensor  # [T] int64 KV slot written by each new token
    page_size: int
    tree_mask: torch.Tensor | None = None  # [b, n, n] bool ancestors-and-self; None means causal

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)


@dataclass
class DraftAttentionMetadata:
    ctx_lens: list[int]  # host copy: cached drafter-context tokens per request
    ctx_lens_t: torch.Tensor  # [b] int64
    block_table: torch.Tensor  # [b, max_pages]
    block_positions: torch.Tensor  # [b, S] absolute positions of the block tokens
    page_size: int


def store_kv(
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
):
    """Write new K/V rows into a layer's paged cache ([num_slots, Hkv, D] each)."""
    kc, vc = kv_cache
    kc.index_copy_(0, slots, k.to(kc.dtype))
    vc.index_copy_(0, slots, v.to(vc.dtype))
