"""The attention-backend seam: metadata types and the interface a kernel implements.

Every forward is an *extend*: request i appends `q_lens[i]` new tokens after `kv_lens[i] - q_lens[i]`
cached ones. Within the new tokens visibility is causal (prefill, chain) or given by a per-request
ancestor mask (tree verify); all cached tokens are visible. The drafter's block attention is the other
shape: block queries see the request's cached drafter context plus the block's own K/V, which is never
stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

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


class AttentionBackend(Protocol):
    name: str

    def extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens; writes k/v into `kv_cache` at
        `meta.slot_mapping`, then attends. Returns [T, Hq, D]."""
        ...

    def draft_block(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx_cache: tuple[torch.Tensor, torch.Tensor],
        meta: DraftAttentionMetadata,
        scale: float,
        causal: bool,
        window: int | None,
    ) -> torch.Tensor:
        """q [b, S, Hq, D], k/v [b, S, Hkv, D] of the block; context from `ctx_cache`. Returns [b, S, Hq, D].
        A key at position pk is visible to a query at pq when (not causal or pk <= pq) and, with a window W,
        |pq - pk| < W (z-lab DFlash semantics)."""
        ...

    # CUDA-graph hooks: the graph runner asks the backend, instead of inspecting its type
    def launch_plan(self, shape, device: torch.device, num_splits: int | None = None):
        """The kernels.tree_attention.dispatch.LaunchPlan of a call of `shape` (kernel "reference": not
        capturable, with the reason in `fallback`). num_splits: fixed (None: the backend's own)."""
        ...

    def with_splits(self, num_splits: int | None) -> AttentionBackend:
        """This backend with the KV split count fixed (what a captured graph replays)."""
        ...


def register_backend(name: str):
    """Names a backend class (`cls.name`); the registry below says where each name's class lives."""

    def deco(cls):
        cls.name = name
        return cls

    return deco


def _torch_backend() -> type:
    from ddtree.attention.torch_ref import TorchReferenceBackend

    return TorchReferenceBackend


def _triton_backend() -> type:
    # the module imports Triton itself, lazily
    from ddtree.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


# name -> lazy factory of the backend class: a backend module is imported only when its name is
# asked for, so this seam imports no implementation (and the implementations, which import this
# file's metadata types, form no cycle with it).
BACKENDS: dict[str, Callable[[], type]] = {"torch": _torch_backend, "triton": _triton_backend}


def get_backend(name: str, **kwargs) -> AttentionBackend:
    if name not in BACKENDS:
        choices = ", ".join(sorted(BACKENDS))
        raise ValueError(f"--attention-backend {name!r} is not available; choose one of {choices}")
    return BACKENDS[name]()(**kwargs)


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
