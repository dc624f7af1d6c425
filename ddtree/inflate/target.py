"""The widened target: dense Qwen3 -> dense Qwen3 (the Qwen3-8B shape), or dense Qwen3 -> hybrid
Qwen3.5/3.6 (the Qwen3.6-27B shape: real layers on full-attention slots, Gated DeltaNet layers with
a zero out_proj)."""

from __future__ import annotations

import torch
from torch import nn

from ddtree.configs import TargetConfig
from ddtree.inflate.blocks import fill_layer, fill_residual_norm, random_gdn
from ddtree.inflate.layout import InflateError, Residual, head_maps, pad_map, put, spread
from ddtree.inflate.shapes import is_hybrid

# Padded vocabulary rows score -PAD_LOGIT / rms(final residual of the small model): below -1e3 for
# any
# final-hidden RMS up to 1e3, so exp() of it is 0 in fp32 at any temperature <= 5 (and it never
# wins an argmax).
PAD_LOGIT = 1e6
_COPIED_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id")


def target_config(src: TargetConfig, shape: dict, res: Residual, dtype: str) -> dict:
    """config.json of the widened target: the shape's geometry, the source's RoPE, ids and context
    length, and the norm eps of `Residual.eps`; always untied (the padded LM-head rows differ from
    the embedding)."""
    text = src.raw.get("text_config") or src.raw
    cfg = {
        "architectures": ["Qwen3_5ForCausalLM" if is_hybrid(shape) else "Qwen3ForCausalLM"],
        "model_type": "qwen3_5_text" if is_hybrid(shape) else "qwen3",
        **{
            k: int(shape[k])
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
            )
        },
        "hidden_act": "silu",
        "max_position_embeddings": src.max_position_embeddings,
        "rms_norm_eps": res.eps(src.rms_norm_eps),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        **{k: text[k] for k in _COPIED_IDS if k in text},
    }
    if not is_hybrid(shape):
        cfg.update(
            rope_theta=src.rope_theta,
            rope_scaling=None,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=cfg["num_hidden_layers"],
        )
        return cfg
    parsed = TargetConfig.from_dict({**shape, "architectures": ["Qwen3_5ForCausalLM"]})
    cfg.update(
        {
            k: int(shape[k])
            for k in (
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
            )
        }
    )
    cfg.update(
        layer_types=list(parsed.layer_types),
        attn_output_gate=True,
        partial_rotary_factor=parsed.partial_rotary_factor,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": src.rope_theta,
            "partial_rotary_factor": parsed.partial_rotary_factor,
        },
    )
    if "full_attention_interval" in shape:
        cfg["full_attention_interval"] = int(shape["full_attention_interval"])
    return cfg


def check_source(src: TargetConfig) -> None:
    if src.is_hybrid:
        raise InflateError(
            "SRC_TARGET is hybrid: inflate widens a dense Qwen3 source (into a dense or a hybrid "
            "shape); train or pick a dense small target"
        )
    if src.rope_scaling is not None:
        raise InflateError(
            f"SRC_TARGET has rope_scaling {src.rope_scaling}: only plain RoPE keeps its "
            f"frequencies when head dims are spread out"
        )


def _lm_weights(small: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return small.model.embed_tokens.weight.data, small.lm_head.weight.data


@torch.no_grad()
def fill_vocab(big: nn.Module, small: nn.Module, res: Residual) -> None:
    """Embedding rows keep the real dims and put gamma on the constant dim; padded-vocab LM-head
    rows read only the constant dim, with a weight whose logit is -PAD_LOGIT / (small model's final
    RMS)."""
    emb, head = _lm_weights(small)
    v, V = emb.shape[0], big.config.vocab_size
    put(big.model.embed_tokens.weight.data, emb, pad_map(v, V), res.map)
    put(big.lm_head.weight.data, head, pad_map(v, V), res.map)
    if res.const is not None:
        big.model.embed_tokens.weight.data[:, res.const] = res.gamma
        # final norm on the constant dim is 1: its output there is gamma / (sqrt(h/H) rms_small)
        weight = PAD_LOGIT * res.scale / res.gamma
        weight = min(weight, torch.finfo(big.lm_head.weight.dtype).max / 16)
        big.lm_head.weight.data[v:, res.const] = -weight


def layer_plan(src: TargetConfig, cfg: TargetConfig) -> list[int]:
    """Big layer index carrying each source layer: evenly over every layer (dense) or over the
    full-attention layers (hybrid)."""
    slots = list(cfg.attention_layer_ids)
    if src.num_hidden_layers > len(slots):
        kind = "full-attention layers" if cfg.is_hybrid else "num_hidden_layers"
        raise InflateError(
            f"--shape has {len(slots)} {kind}, fewer than the source's {src.num_hidden_layers}"
        )
    return spread(src.num_hidden_layers, slots)


@torch.no_grad()
def inflate_target(
    small: nn.Module, cfg: TargetConfig, res: Residual, device, dtype: torch.dtype, seed: int = 0
) -> tuple[nn.Module, list[int]]:
    """(big target, carrier layer of each source layer). Extra layers copy the nearest earlier
    source layer's weights (real compute) with zero o_proj / down_proj (and Gated DeltaNet layers a
    zero out_proj)."""
    from ddtree.models.loader import build_target

    s = small.config
    check_source(s)
    carriers = layer_plan(s, cfg)
    if cfg.is_hybrid and not cfg.attn_output_gate:
        raise InflateError(
            "hybrid --shape needs attn_output_gate true (Qwen3.5/3.6 gated attention)"
        )
    with torch.device("meta"):  # dtype first: a 27B model never exists in fp32
        big = build_target(cfg).to(dtype)
    big = big.to_empty(device=device)
    maps = head_maps(
        s.num_attention_heads,
        s.num_key_value_heads,
        s.head_dim,
        int(s.head_dim * s.partial_rotary_factor),
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        int(cfg.head_dim * cfg.partial_rotary_factor),
    )
    if cfg.intermediate_size < s.intermediate_size:
        raise InflateError(
            f"intermediate_size {cfg.intermediate_size} < the source's {s.intermediate_size}"
        )
    gen = torch.Generator(device=device).manual_seed(seed)
    where = {b: i for i, b in enumerate(carriers)}
    src_layer = 0
    for j, layer in enumerate(big.model.layers):
        real = j in where
        src_layer = where.get(j, src_layer)
        gdn = getattr(layer, "linear_ordinal", None) is not None
        fill_layer(
            layer,
            small.model.layers[src_layer],
            None if gdn else maps,
            res,
            real,
            dst_offset=cfg.is_hybrid,
        )
        if gdn:
            random_gdn(layer.linear_attn, gen)
    fill_residual_norm(
        big.model.norm.weight, small.model.norm.weight, res, False, cfg.is_hybrid, const_value=1.0
    )
    fill_vocab(big, small, res)
    return big.eval(), carriers
