"""Forwards over paged KV: prefill (extend), drafter block, tree verify, and the commit of accepted nodes.

Device-side throughout a round: the host supplies per-request lengths (which it already knows) and reads
back only the accepted tokens after `commit`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.attention.backend import AttentionMetadata, DraftAttentionMetadata, get_backend, store_kv
from ddtree.engine.block_manager import BlockManager
from ddtree.engine.kv_cache import KVPool, kv_bytes_per_token
from ddtree.engine.request import Req


@dataclass(frozen=True)
class RunnerConfig:
    page_size: int = 16
    num_pages: int = 1024
    max_running_requests: int = 16
    max_context: int = 4096
    block_size: int = 16  # drafted block incl. the root; depth limit = block_size - 1
    max_verify_width: int = 65  # most tree nodes (root included) one request verifies at once
    attention_backend: str = "torch"
    mamba_strategy: str = "extra_buffer"
    mamba_ssm_dtype: str = "float32"


class ModelRunner:
    def __init__(self, target, drafter, cfg: RunnerConfig, device, dtype):
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.device, self.dtype = torch.device(device), dtype
        tcfg = target.config
        self.backend = get_backend(cfg.attention_backend)
        self.attn_layers = tcfg.attention_layer_ids
        self.pool_index = {layer: j for j, layer in enumerate(self.attn_layers)}
        slots = cfg.num_pages * cfg.page_size
        self.kv = KVPool(len(self.attn_layers), slots, tcfg.num_key_value_heads, tcfg.head_dim, dtype, device)
        self.draft_kv = None
        self.tap_layers: tuple[int, ...] = ()
        if drafter is not None:
            dcfg = drafter.config
            self.draft_kv = KVPool(dcfg.num_hidden_layers, slots, dcfg.num_key_value_heads, dcfg.head_dim, dtype, device)
            self.tap_layers = dcfg.target_layer_ids
        max_pages = -(-(cfg.max_context + cfg.max_verify_width) // cfg.page_size) + 1
        self.bm = BlockManager(cfg.num_pages, cfg.page_size, cfg.max_running_requests, max_pages, device)
        # Hybrid targets keep recurrent state per request in rows indexed by the request's block-table slot.
        self.state_pool = None
        if tcfg.is_hybrid:
            self.state_pool = target.make_state_pool(
                cfg.max_running_requests, cfg.max_verify_width, device, cfg.mamba_strategy, cfg.mamba_ssm_dtype
            )

    @staticmethod
    def kv_bytes_per_token(target_cfg, drafter_cfg, dtype) -> int:
        n = kv_bytes_per_token(len(target_cfg.attention_layer_ids), target_cfg.num_key_value_heads,
                               target_cfg.head_dim, dtype)
        if drafter_cfg is not None:
            n += kv_bytes_per_token(drafter_cfg.num_hidden_layers, drafter_cfg.num_key_value_heads,
                                    drafter_cfg.head_dim, dtype)
        return n

    # ---- metadata ------------------------------------------------------------------------------------
    def _lens(self, reqs: list[Req]) -> torch.Tensor:
        return torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=self.device)

    def _slot_ids(self, reqs: list[Req]) -> torch.Tensor:
        return torch.tensor([r.slot for r in reqs], dtype=torch.int64, device=self.device)

    def _rows(self, reqs: list[Req]) -> torch.Tensor:
        return self.bm.block_table[self._slot_ids(reqs)]

    def slots_of(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rows [b, max_pages] block-table rows, positions [b, m] logical -> KV slots [b, m]."""
        p = self.cfg.page_size
        return rows.gather(1, positions // p) * p + positions % p

    def _target_attend(self, meta: AttentionMetadata, state=None):
        scale = self.target.scale

        def attend(layer, q, k, v):
            return self.backend.extend(q, k, v, self.kv.layer(self.pool_index[layer]), meta, scale)

        return attend

    # ---- forwards ------------------------------------------------------------------------------------
    def _extend(self, reqs, q_lens, input_ids, positions, lpos, tree_mask=None, linear=None):
        rows = self._rows(reqs)
        ridx = torch.repeat_interleave(torch.arange(len(reqs), device=self.device),
                                       torch.tensor(q_lens, device=self.device))
        p = self.cfg.page_size
        slot_mapping = rows[ridx, lpos // p] * p + lpos % p
        kv_lens = [r.kv_len + q for r, q in zip(reqs, q_lens)]
        indptr = torch.zeros(len(reqs) + 1, dtype=torch.int64, device=self.device)
        indptr[1:] = torch.tensor(q_lens, device=self.device).cumsum(0)
        meta = AttentionMetadata(
            q_lens=list(q_lens), kv_lens=kv_lens, qo_indptr=indptr,
            kv_lens_t=torch.tensor(kv_lens, device=self.device), block_table=rows, slot_mapping=slot_mapping,
            page_size=p, tree_mask=tree_mask,
        )
        hidden, taps = self.target.hidden_states(
            input_ids, positions, self._target_attend(meta), self.tap_layers, linear=linear
        )
        return hidden, taps, slot_mapping

    @torch.inference_mode()
    def prefill(self, reqs: list[Req], q_lens: list[int]) -> torch.Tensor:
        """Extend each request by its next `q_lens[i]` prompt tokens; returns last-token logits [b, V]."""
        ids, pos = [], []
        for r, q in zip(reqs, q_lens):
            self.bm.allocate(r, r.kv_len + q)
            ids.append(torch.tensor(r.token_slice(r.kv_len, r.kv_len + q), dtype=torch.int64))
            pos.append(torch.arange(r.kv_len, r.kv_len + q))
        input_ids = torch.cat(ids).to(self.device)
        positions = torch.cat(pos).to(self.device)
        linear = None
        if self.state_pool is not None:
            linear = self.state_pool.extend_context([r.slot for r in reqs], q_lens, [r.kv_len for r in reqs])
        hidden, taps, slot_mapping = self._extend(reqs, q_lens, input_ids, positions, positions, linear=linear)
        last = torch.tensor(q_lens, device=self.device).cumsum(0) - 1
        if self.drafter is not None:
            self.write_draft_context(taps, positions, slot_mapping)
        for r, q in zip(reqs, q_lens):
            r.kv_len += q
        return self.target.logits(hidden[last]).float()

    @torch.inference_mode()
    def draft(self, reqs: list[Req], roots: torch.Tensor, block_size: int) -> torch.Tensor:
        """Drafter forward on [root, MASK x (S-1)] blocks -> marginals' logits [b, S-1, V]."""
        dcfg = self.drafter.config
        b = len(reqs)
        ids = torch.full((b, block_size), dcfg.mask_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = roots
        lens = self._lens(reqs)
        positions = lens[:, None] + torch.arange(block_size, device=self.device)
        meta = DraftAttentionMetadata(
            ctx_lens=[r.kv_len for r in reqs], ctx_lens_t=lens, block_table=self._rows(reqs),
            block_positions=positions, page_size=self.cfg.page_size,
        )
        scale = self.drafter.scale

        def attend(layer, q, k, v):
            return self.backend.draft_block(q, k, v, self.draft_kv.layer(layer), meta, scale,
                                            dcfg.layer_is_causal(layer), dcfg.layer_window(layer))

        hidden = self.drafter.block_hidden(self.target.embed_tokens(ids), positions, attend)
        return self.drafter.logits(hidden[:, 1:], self.target.lm_head)

    @torch.inference_mode()
    def verify(self, reqs: list[Req], tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over every request's tree (n nodes at logical slots [L, L+n), RoPE positions
        L + depth, ancestor mask). Returns logits [b, n, V] fp32 and taps [b, n, K*H]."""
        b, n = tree.tokens.shape
        for r in reqs:
            self.bm.allocate(r, r.kv_len + n)
        lens = self._lens(reqs)
        lpos = (lens[:, None] + torch.arange(n, device=self.device)).flatten()
        positions = (lens[:, None] + tree.depths).flatten()
        linear = None
        if self.state_pool is not None:
            linear = self.state_pool.tree_context([r.slot for r in reqs], tree)
        hidden, taps, _ = self._extend(reqs, [n] * b, tree.tokens.flatten(), positions, lpos, tree.tree_mask, linear)
        logits = self.target.logits(hidden).float().view(b, n, -1)
        return logits, (taps.view(b, n, -1) if taps is not None else None)

    @torch.inference_mode()
    def commit(self, reqs: list[Req], path: torch.Tensor, accept_length: torch.Tensor, taps) -> None:
        """Move the accepted nodes' KV to logical positions L..L+k (contiguous, in path order) and write
        their drafter context. path [b, D+1] node indices (root first), accept_length [b] = k."""
        lens = self._lens(reqs)
        j = torch.arange(path.shape[1], device=self.device)
        jj = torch.minimum(j[None, :], accept_length[:, None])  # padding repeats the last real row
        src_node = path.gather(1, jj)
        rows = self._rows(reqs)
        dst_pos = lens[:, None] + jj
        src_slot = self.slots_of(rows, lens[:, None] + src_node).flatten()
        dst_slot = self.slots_of(rows, dst_pos).flatten()
        self.kv.move(src_slot, dst_slot)
        if self.state_pool is not None:
            self.state_pool.commit(self._slot_ids(reqs), path, accept_length)
        if self.drafter is not None and taps is not None:
            feats = taps.gather(1, src_node[..., None].expand(-1, -1, taps.shape[-1]))
            self.write_draft_context(feats.flatten(0, 1), dst_pos.flatten(), dst_slot)

    def write_draft_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        for layer, (k, v) in enumerate(self.drafter.context_kv(features, positions)):
            store_kv(self.draft_kv.layer(layer), slots, k, v)

    def release(self, req: Req, keep_tokens: int | None = None) -> None:
        """Trim to `keep_tokens` cached tokens, or free everything when None."""
        if keep_tokens is None:
            self.bm.free(req)
        else:
            self.bm.trim(req, keep_tokens)
