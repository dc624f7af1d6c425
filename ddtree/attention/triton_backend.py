"""`--attention-backend triton`: our split-KV paged kernel for decode, chain/tree verify and causal extend.

Dispatch: every extend shape (q = 1 decode, verify with a tree mask, causal chain, ragged prefill) goes
through one kernel, `ddtree.kernels.tree_attention.launch.paged_attention`; its launch plan (kernel, tiles,
splits, PDL) comes from `kernels/tree_attention/dispatch.py`, and `launch_plan` gives the graph runner the
plan of a shape (what a captured graph replays). `draft_block` runs the same kernel with the block's K/V passed
alongside (never stored); sliding-window layers pass their window to the kernel, which masks it per row.

Falls back to the torch reference when DDTREE_REFERENCE=attention, or when the tensors are on the CPU
and Triton's interpreter (TRITON_INTERPRET=1) is off, or for head dims the kernel does not take
(not a power of two >= 16).
"""

from __future__ import annotations

import torch

from ddtree import envs
from ddtree.attention.metadata import AttentionMetadata, DraftAttentionMetadata, store_kv
from ddtree.attention.torch_ref import TorchReferenceBackend

FORCE_REFERENCE = f"{envs.REFERENCE.name}=attention"


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, num_splits: int | None = None):
        # num_splits: fixed split count (e.g. while capturing CUDA graphs); None = chosen per call from the
        # host kv_lens, which under graph capture should then be the captured maxima.
        self.num_splits = num_splits
        self.force_reference = envs.REFERENCE.has("attention")
        self._ref = TorchReferenceBackend()
        self._kernel = None
        if not self.force_reference:
            try:
                from ddtree.kernels.tree_attention import launch as kernel
            except ImportError as e:
                raise RuntimeError(
                    f"--attention-backend triton needs the triton package ({e}); install it, or set "
                    f"{FORCE_REFERENCE} to run the torch reference behind this backend"
                ) from e
            self._kernel = kernel

    def _reference_reason(self, head_dim: int, device: torch.device) -> str | None:
        if self._kernel is None:
            return f"{FORCE_REFERENCE} is set"
        if head_dim < 16 or head_dim & (head_dim - 1):
            return f"head dim {head_dim} (the kernel takes powers of two >= 16)"
        if device.type != "cuda" and not envs.TRITON_INTERPRET.on():
            return f"{device.type} tensors without {envs.TRITON_INTERPRET.name}=1"
        return None

    def reads_host_q_lens(self, head_dim: int, device: torch.device) -> bool:
        # the kernel reads only max(q_lens) / max(kv_lens); the reference behind it loops
        return self._reference_reason(head_dim, device) is not None

    def _use_reference(self, q: torch.Tensor) -> bool:
        return self._reference_reason(q.shape[-1], q.device) is not None

    def with_splits(self, num_splits: int | None) -> TritonAttentionBackend:
        return (
            self if num_splits == self.num_splits else TritonAttentionBackend(num_splits=num_splits)
        )

    def launch_plan(self, shape, device: torch.device, num_splits: int | None = None):
        """The `dispatch.LaunchPlan` that `extend` / `draft_block` run for a call of `shape` (a
        dispatch.AttentionShape) with `num_splits` or this backend's split
        count: what a CUDA graph captured on this backend replays. Choosing the splits, ask after one call of
        the shape (it compiles the kernel variant whose resident-program count picks them)."""
        from ddtree.kernels.tree_attention import dispatch

        why = self._reference_reason(shape.head_dim, device)
        if why is not None:
            return dispatch.reference_plan(why)
        return dispatch.plan(
            shape,
            device,
            num_splits=num_splits or self.num_splits,
            triton_slots=lambda cfg: self._kernel.triton_slots(shape, cfg, device),
        )

    def extend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        if self._use_reference(q):
            return self._ref.extend(q, k, v, kv_cache, meta, scale)
        store_kv(kv_cache, meta.slot_mapping, k, v)
        kc, vc = kv_cache
        return self._kernel.paged_attention(
            q,
            kc,
            vc,
            meta.block_table,
            meta.qo_indptr,
            meta.kv_lens_t,
            meta.page_size,
            scale,
            max_q_len=max(meta.q_lens),
            max_kv_len=max(meta.kv_lens),
            tree_mask=meta.tree_mask,
            num_splits=self.num_splits,
        )

    def draft_block(self, q, k, v, ctx_cache, meta: DraftAttentionMetadata, scale, causal, window):
        """The same kernel with the block's K/V read from k/v (never stored). Assumes the block sits right
        after the context (block_positions[i] = ctx_lens[i] + arange(S), as ModelRunner.draft builds it),
        so the kernel's index positions are the block's positions and a sliding window applies as is."""
        if self._use_reference(q):
            return self._ref.draft_block(q, k, v, ctx_cache, meta, scale, causal, window)
        b, S, hq, d = q.shape
        hkv = k.shape[2]
        kc, vc = ctx_cache
        indptr = torch.arange(0, (b + 1) * S, S, device=q.device)
        out = self._kernel.paged_attention(
            q.reshape(b * S, hq, d),
            kc,
            vc,
            meta.block_table,
            indptr,
            meta.ctx_lens_t + S,
            meta.page_size,
            scale,
            max_q_len=S,
            max_kv_len=max(meta.ctx_lens) + S,
            causal=causal,
            new_kv=(k.reshape(b * S, hkv, d), v.reshape(b * S, hkv, d)),
            num_splits=self.num_splits,
            window=window,
        )
        return out.view(b, S, hq, d)
