"""The attention-backend seam: the interface a kernel implements and the registry that chooses one.

Every forward is an *extend*: request i appends `q_lens[i]` new tokens after `kv_lens[i] - q_lens[i]`
cached ones. Within the new tokens visibility is causal (prefill, chain) or given by a per-request
ancestor mask (tree verify); all cached tokens are visible. The drafter's block attention is the other
shape: block queries see the request's cached drafter context plus the block's own K/V, which is never
stored.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ddtree.attention.metadata import AttentionMetadata, DraftAttentionMetadata, store_kv

# the types every forward passes, handed on for the callers that choose a backend here
__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "DraftAttentionMetadata",
    "get_backend",
    "store_kv",
]


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

    def reads_host_q_lens(self, head_dim: int, device: torch.device) -> bool:
        """Whether `extend` reads every request's host q_len (`meta.q_lens`); else only the
        lengths' maxima bound its launch and each request's q_len comes from `meta.qo_indptr`
        (a packed verify then passes bounds, with no read-back)."""
        ...

    # CUDA-graph hooks: the graph runner asks the backend, instead of inspecting its type
    def launch_plan(self, shape, device: torch.device, num_splits: int | None = None):
        """The kernels.tree_attention.dispatch.LaunchPlan of a call of `shape` (kernel "reference": not
        capturable, with the reason in `fallback`). num_splits: fixed (None: the backend's own)."""
        ...

    def with_splits(self, num_splits: int | None) -> AttentionBackend:
        """This backend with the KV split count fixed (what a captured graph replays)."""
        ...


def _torch_backend() -> type:
    from ddtree.attention.torch_ref import TorchReferenceBackend

    return TorchReferenceBackend


def _triton_backend() -> type:
    # the module imports Triton itself, lazily
    from ddtree.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


# name -> lazy factory of the backend class: a backend module (and Triton with it) is imported only
# when its name is asked for.
BACKENDS: dict[str, Callable[[], type]] = {"torch": _torch_backend, "triton": _triton_backend}


def get_backend(name: str, **kwargs) -> AttentionBackend:
    if name not in BACKENDS:
        choices = ", ".join(sorted(BACKENDS))
        raise ValueError(f"--attention-backend {name!r} is not available; choose one of {choices}")
    return BACKENDS[name]()(**kwargs)
