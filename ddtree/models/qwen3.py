"""Dense Qwen3 target (HF `Qwen3ForCausalLM` layout and numerics), written against the attention seam.

The forward takes flat tokens `[T]` with absolute positions; attention is delegated to a callable so the
same layers serve paged inference (through an `AttentionBackend`) and dense causal training.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels.fused import qk_norm_rope
from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.models.layers import MLP, RMSNorm, RotaryEmbedding, fuse_linears
from ddtree.models.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)

AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_attend(scale: float) -> AttendFn:
    """Dense causal attention for [B, T, H, D] tensors (training and tests; no cache)."""

    def attend(layer: int, q, k, v):
        groups = q.shape[-2] // k.shape[-2]
        qh, kh, vh = (x.transpose(-3, -2) for x in (q, k, v))
        kh, vh = kh.repeat_interleave(groups, -3), vh.repeat_interleave(groups, -3)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        return out.transpose(-3, -2)

    return attend


class Qwen3Attention(nn.Module):
    """q|k|v as one GEMM (`qkv_proj`; HF `q_proj`/`k_proj`/`v_proj` in checkpoints), then one fused kernel for
    the per-head q/k RMSNorms and RoPE. Under TP, `heads` / `kv_heads` are this rank's (q|k|v holds
    their rows, o_proj their columns: `ddtree.models.tp_layout`)."""

    def __init__(self, cfg: TargetConfig | DrafterConfig, tp: TPGroup | None = None):
        super().__init__()
        hidden, bias, eps = cfg.hidden_size, cfg.attention_bias, cfg.rms_norm_eps
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=bias, tp=tp)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        fuse_linears(
            self,
            "qkv_proj",
            (("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)),
        )

    def split_qkv(self, qkv: torch.Tensor, cos, sin):
        """qkv [..., q_size + 2 kv_size] (the fused projection) -> normed and rotated (q, k), and v (a view)."""
        shape = qkv.shape[:-1]
        q = qkv[..., : self.q_size].view(*shape, self.heads, self.head_dim)
        k = qkv[..., self.q_size : self.q_size + self.kv_size].view(
            *shape, self.kv_heads, self.head_dim
        )
        v = qkv[..., self.q_size + self.kv_size :].view(*shape, self.kv_heads, self.head_dim)
        q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps)
        return q, k, v

    def qkv(self, x, cos, sin):
        return self.split_qkv(self.qkv_proj(x), cos, sin)

    def forward(self, layer: int, x, cos, sin, attend: AttendFn):
        q, k, v = self.qkv(x, cos, sin)
        out = attend(layer, q, k, v)
        return self.o_proj(out.reshape(*x.shape[:-1], self.heads * self.head_dim))


class Qwen3DecoderLayer(nn.Module):
    """`forward` takes its input already normed by `input_layernorm` plus the residual stream, and returns
    (mlp output, residual): the layer's output is their sum, which the caller adds inside the next norm
    (`CausalLM.hidden_states`). Kernels: qkv GEMM, q/k norm + RoPE, attention, o GEMM, add + norm, gate|up GEMM,
    SiLU-mul, down GEMM (+ the next layer's add + norm)."""

    def __init__(self, cfg: TargetConfig, tp: TPGroup | None = None):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, tp)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, layer: int, h, residual, cos, sin, attend: AttendFn, linear=None):
        h = self.self_attn(layer, h, cos, sin, attend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3Body(nn.Module):
    def __init__(self, cfg: TargetConfig, tp: TPGroup | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The shell shared by our targets: a `model` body (embed_tokens, layers, norm), an LM head (tied or not),
    RoPE, tapping of layer outputs for the drafter. Parameter names match HF checkpoints.
    Under tensor parallelism `cfg` is one rank's geometry (`tp_layout.shard_target`) and `tp` the
    group its row-parallel layers, embedding and LM head combine over; logits are full-vocab."""

    body_cls: type[nn.Module]

    def __init__(self, cfg: TargetConfig, tp: TPGroup | None = None):
        super().__init__()
        self.config = cfg
        self.model = self.body_cls(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.partial_rotary_factor
        )
        self.scale = cfg.head_dim**-0.5

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: AttendFn,
        tap_layers: tuple[int, ...] = (),
        linear=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (final-normed hidden [..., T, H], taps [..., T, len(tap_layers)*H] or None).
        A tap id i is the *output* of decoder layer i (HF `hidden_states[i + 1]`). `linear` is the
        recurrent-state context of hybrid targets (the flat [T] tokens it describes); without it recurrent
        layers start from a zero state for each row of input_ids. Dense models ignore it."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        taps = {}
        wanted = set(tap_layers)
        layers = self.model.layers
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        h, residual = layers[0].input_layernorm(x), x
        for i, layer in enumerate(layers):
            out, residual = layer(i, h, residual, cos, sin, attend, linear)
            h, residual = norms[i](out, residual)  # residual = out + residual = output of layer i
            if i in wanted:
                taps[i] = residual
        tapped = torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else None
        return h, tapped

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[..., V] logits; `out` (contiguous [T, V] for 2-D hidden): written there, no copy."""
        return self.lm_head(hidden, out=out)

    def forward_train(self, input_ids: torch.Tensor, tap_layers: tuple[int, ...] = ()):
        """Dense causal forward for [B, T] ids (training, data generation and tests)."""
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        hidden, taps = self.hidden_states(
            input_ids, positions, causal_attend(self.scale), tap_layers
        )
        return self.logits(hidden), taps


class Qwen3ForCausalLM(CausalLM):
    body_cls = Qwen3Body
