"""DFlash block-diffusion drafter (z-lab `DFlashDraftModel` checkpoint layout).

Target features of the tapped layers are fused once (`hidden_norm(fc(concat))`) and injected as extra K/V
into every drafter layer through that layer's own k/v projections; the block `[root, MASK x (S-1)]` is the
only query stream. The drafter owns no embedding and no LM head: it borrows the target's.
Inference splits a layer's attention in two halves: `context_kv` turns new context features into cached
K/V once (the drafter KV pool holds context only), and `block_hidden` runs the block against that cache.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels import tree_build
from ddtree.kernels.fused import qk_norm_rope
from ddtree.models.configs import DrafterConfig
from ddtree.models.layers import MLP, RMSNorm, RotaryEmbedding
from ddtree.models.parallel import TPGroup
from ddtree.models.quant import linear_rows
from ddtree.models.qwen3 import Qwen3Attention
from ddtree.speculative.tree import DraftTree, build_chain, build_tree

# (layer, q [b,S,Hq,D], k_blk [b,S,Hkv,D], v_blk) -> [b,S,Hq,D]; the callable knows where the context is.
BlockAttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DFlashAttention(Qwen3Attention):
    """The target's attention layout (`qkv_proj` = HF `q_proj`/`k_proj`/`v_proj`, q/k norms; `qkv` for block
    rows); context rows use only the k|v rows of the fused projection (one GEMM)."""

    def kv(self, x, cos, sin):
        """Normed and rotated k, and v, of context rows x."""
        kv = linear_rows(self.qkv_proj, x, self.q_size)
        shape = x.shape[:-1]
        k = kv[..., : self.kv_size].view(*shape, self.kv_heads, self.head_dim)
        v = kv[..., self.kv_size :].view(*shape, self.kv_heads, self.head_dim)
        _, k = qk_norm_rope(None, k, None, self.k_norm.weight, cos, sin, self.k_norm.eps)
        return k, v


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, tp: TPGroup | None = None):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, tp)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # DFlash2's grouped dynamic convolutions around attention and MLP (models/dflash2.py)
        self.attention_conv = self.mlp_conv = None


class DFlashDrafter(nn.Module):
    """Parameter names match z-lab checkpoints: `fc`, `hidden_norm`, `layers.N...`, `norm`.

    Under tensor parallelism the drafter is sharded like the target (heads, KV heads with replication,
    MLP rows; `fc` / `hidden_norm` replicated): at small batch a block forward reads its weights
    once, so sharding divides that read by tp for two small all-reduces per layer. By the cost model
    (docs/design-numbers.md) that is not slower at tp 2 and faster beyond, and a replicated drafter
    would take its weights (and tp x its context KV) from every rank's KV pool.

    The drafter interface the engine uses (DFlash2Drafter implements it too; `models/drafters.py`
    picks the class by `architectures`): `context_kv`, `block_hidden`, `logits`, then `propose`
    (what the tree build reads: here the logits, whose per-position marginals DDTree assumes) and
    `build_tree` (the DFLASH chain or the best-first DDTree of a tree spec)."""

    layer_class = DFlashLayer

    def __init__(self, cfg: DrafterConfig, tp: TPGroup | None = None):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(
            len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False
        )
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.scale = cfg.head_dim**-0.5

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) [..., T, Hkv, D] of new context rows (`features` = concatenated target taps)."""
        ctx = self.fuse(features.to(self.hidden_norm.weight.dtype))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block_hidden(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        attend: BlockAttendFn,
        block_size: int | None = None,
    ) -> torch.Tensor:
        """embeds [b, S, H] = target embedding of the block ids, positions [b, S] -> final-normed hidden [b, S, H].
        `block_size`: the rows of one block when several lie along dim -2 (training); default S (DFlash2's
        convolutions run within a block, whatever block size the engine drafts)."""
        block = block_size or embeds.shape[-2]
        x = (
            embeds * self.config.input_embedding_scale
            if self.config.input_embedding_scale != 1.0
            else embeds
        )
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        h, residual = self.layers[0].input_layernorm(x), x
        for i, layer in enumerate(self.layers):
            attn, conv = layer.self_attn, layer.attention_conv
            if conv is not None:  # DFlash2: convolve the normed input, keep the output's taps
                h, taps = conv.prepare(h, block)
            q, k, v = attn.qkv(h, cos, sin)
            out = attend(i, q, k, v)
            h = attn.o_proj(out.reshape(*x.shape[:-1], attn.heads * attn.head_dim))
            if conv is not None:
                h = conv.finish(h, taps, block)
            h, residual = layer.post_attention_layernorm(h, residual)
            conv = layer.mlp_conv
            if conv is None:
                h = layer.mlp(h)
            else:
                h, taps = conv.prepare(h, block)
                h = conv.finish(layer.mlp(h), taps, block)
            h, residual = norms[i](h, residual)  # residual = output of layer i
        return h

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        logits = lm_head(hidden)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def propose(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """hidden [b, D, H] of the drafted positions -> what `build_tree` reads (the logits)."""
        return self.logits(hidden, lm_head)

    def proposal_logits(self, proposal: torch.Tensor) -> torch.Tensor:
        """The per-position logits [b, D, V] a proposal carries."""
        return proposal

    def build_tree(
        self,
        roots: torch.Tensor,
        proposal: torch.Tensor,
        spec: tuple,
        max_depth: torch.Tensor | None = None,
        budgets: torch.Tensor | None = None,
    ) -> DraftTree:
        """The round's tree from a `propose` result. spec = (algorithm, budget, topk_cap,
        shadow_linear): DFLASH the top-1 chain, DDTREE the best-first tree over the per-position
        marginals (its node selection `kernels/tree_build`'s one launch where it runs);
        max_depth [b] per-request depth limits, budgets [b] per-request cuts (None: none)."""
        algorithm, budget, topk_cap, shadow_linear = spec
        if algorithm == "DFLASH":
            return build_chain(roots, proposal, max_depth=max_depth)
        return build_tree(
            roots,
            proposal,
            budget,
            topk_cap,
            shadow_linear,
            max_depth=max_depth,
            budgets=budgets,
            select=tree_build.select_nodes,
        )

    def forward_train(
        self, features: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor:
        """Training forward with many blocks per sequence in one pass.

        features [B, T, K*H] target taps for every position; block_embeds [B, A, S, H] for blocks anchored at
        `anchors` [B, A] (block token j sits at position anchor + j). A block sees context strictly before its
        anchor and its own block; blocks never see each other. Returns hidden [B, A, S, H]."""
        B, T, _ = features.shape
        _, A, S, H = block_embeds.shape
        dev = features.device
        ctx_pos = torch.arange(T, device=dev).expand(B, T)
        blk_pos = (anchors[..., None] + torch.arange(S, device=dev)).reshape(B, A * S)
        ctx_kv = self.context_kv(features, ctx_pos)
        qpos = blk_pos
        kpos = torch.cat([ctx_pos, blk_pos], 1)
        qblock = torch.arange(A, device=dev).repeat_interleave(S)
        kblock = torch.cat([torch.full((T,), -1, device=dev), qblock])
        anchor_q = anchors.repeat_interleave(S, dim=1)  # [B, A*S]
        ctx_ok = (kblock[None, None, :] < 0) & (kpos[:, None, :] < anchor_q[:, :, None])
        same = kblock[None, None, :] == qblock[None, :, None]
        masks = []
        for i in range(len(self.layers)):
            vis = ctx_ok | same
            dq = qpos[:, :, None] - kpos[:, None, :]
            if self.config.layer_is_causal(i):
                vis = vis & (dq >= 0)
            window = self.config.layer_window(i)
            if window is not None:
                vis = vis & (dq < window) & (self.config.layer_is_causal(i) | (-dq < window))
            masks.append(vis[:, None])

        def attend(layer, q, k, v):
            kk = torch.cat([ctx_kv[layer][0], k], 1)
            vv = torch.cat([ctx_kv[layer][1], v], 1)
            groups = q.shape[-2] // kk.shape[-2]
            qh = q.transpose(1, 2)
            kh = kk.transpose(1, 2).repeat_interleave(groups, 1)
            vh = vv.transpose(1, 2).repeat_interleave(groups, 1)
            out = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=masks[layer], scale=self.scale
            )
            return out.transpose(1, 2)

        hidden = self.block_hidden(block_embeds.reshape(B, A * S, H), blk_pos, attend, S)
        return hidden.view(B, A, S, H)
