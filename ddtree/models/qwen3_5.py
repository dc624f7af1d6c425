"""Hybrid Qwen3.5 / Qwen3.6 text target: Gated DeltaNet layers plus gated full-attention layers.

Same public surface as the dense `Qwen3ForCausalLM` (flat tokens with absolute positions, attention through
`attend(layer, q, k, v)`), plus `linear`, the recurrent-state context built by the state pool. Text-only
M-RoPE has equal t/h/w positions, which makes it plain 1-D RoPE on the first `partial_rotary_factor` of
each head.
"""

from __future__ import annotations

from torch import nn

from ddtree.kernels.fused import qk_norm_rope, sigmoid_gate
from ddtree.models.configs import TargetConfig
from ddtree.models.gated_deltanet import GatedDeltaNet, LinearStateContext
from ddtree.models.layers import MLP, RMSNorm, fuse_linears
from ddtree.models.parallel import RowParallelLinear, TPGroup, VocabParallelEmbedding
from ddtree.models.qwen3 import AttendFn, CausalLM


class OffsetRMSNorm(RMSNorm):
    """Qwen3.5 RMSNorm: scale is (1 + weight), applied in fp32 before casting back (zero init = identity).
    Like `RMSNorm`, `norm(x, residual)` -> (normed(x + residual), x + residual)."""

    offset = True


class GatedAttention(nn.Module):
    """q|k|v as one GEMM (`qkv_proj`; HF `q_proj`/`k_proj`/`v_proj` in checkpoints). The q part yields, per
    head, [query | gate] (head_dim each) when attn_output_gate; the attention output is multiplied by
    sigmoid(gate) before o_proj."""

    def __init__(self, cfg: TargetConfig, tp: TPGroup | None = None):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.gated = cfg.attn_output_gate
        bias = cfg.attention_bias
        self.q_size = self.heads * hd * (2 if self.gated else 1)
        self.kv_size = self.kv_heads * hd
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = RowParallelLinear(self.heads * hd, h, bias=bias, tp=tp)
        self.q_norm = OffsetRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(hd, cfg.rms_norm_eps)
        fuse_linears(
            self,
            "qkv_proj",
            (("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)),
        )

    def forward(self, layer: int, x, cos, sin, attend: AttendFn):
        shape = x.shape[:-1]
        qkv = self.qkv_proj(x)
        q = qkv[..., : self.q_size]
        k = qkv[..., self.q_size : self.q_size + self.kv_size].view(
            *shape, self.kv_heads, self.head_dim
        )
        v = qkv[..., self.q_size + self.kv_size :].view(*shape, self.kv_heads, self.head_dim)
        gate = None
        if self.gated:
            q, gate = q.view(*shape, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = q.view(*shape, self.heads, self.head_dim)
        q, k = qk_norm_rope(
            q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps, offset=True
        )
        out = attend(layer, q, k, v)
        if gate is not None:  # one launch on the GPU, the gate read in place (kernels/fused)
            out = sigmoid_gate(out.reshape(*shape, self.heads, self.head_dim), gate)
        return self.o_proj(out.reshape(*shape, self.heads * self.head_dim))


class Qwen3_5DecoderLayer(nn.Module):
    """Same calling convention as `Qwen3DecoderLayer`: input already normed by `input_layernorm`, plus the
    residual stream; returns (mlp output, residual)."""

    def __init__(
        self, cfg: TargetConfig, layer: int, linear_ordinal: int | None, tp: TPGroup | None = None
    ):
        super().__init__()
        self.linear_ordinal = linear_ordinal
        if linear_ordinal is not None:
            self.linear_attn = GatedDeltaNet(cfg, tp)
        else:
            self.self_attn = GatedAttention(cfg, tp)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, layer: int, h, residual, cos, sin, attend: AttendFn, linear: LinearStateContext | None
    ):
        if self.linear_ordinal is not None:
            h = self.linear_attn(h, self.linear_ordinal, linear)
        else:
            h = self.self_attn(layer, h, cos, sin, attend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3_5Body(nn.Module):
    def __init__(self, cfg: TargetConfig, tp: TPGroup | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        ordinal = {layer: j for j, layer in enumerate(cfg.linear_layer_ids)}
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(cfg, i, ordinal.get(i), tp) for i in range(cfg.num_hidden_layers)
        )
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5ForCausalLM(CausalLM):
    """Parameter names match HF text checkpoints (`model.layers.N.{linear_attn,self_attn}...`); the loader
    maps VLM keys (`model.language_model.*`) onto them and skips the vision tower and MTP head."""

    body_cls = Qwen3_5Body  # its recurrent-state pool is the engine's (`ModelRunner` builds it)
