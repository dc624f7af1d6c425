"""The widened target: dense Qwen3 -> dense Qwen3 (the Qwen3-8B shape), or dense Qwen3 -> hybrid
Qwen3.5/3.6 (the Qwen3.6-27B shape: real layers on full-attention slots, Gated DeltaNet layers with
a zero out_proj)."""

from __future__ import annotations

import torch
from torch import nn

from ddtree.models.configs import TargetConfig
from ddtree.tools.inflate.blocks import fill_layer, fill_residual_norm, random_gdn
from ddtree.tools.inflate.layout import head_maps, pad_map, put
from ddtree.tools.inflate.plan import InflateError, Residual, check_source, layer_plan

# Padded vocabulary rows score -PAD_LOGIT / rms(final residual of the small model): below -1e3 for
# any
# final-hidden RMS up to 1e3, so exp() of it is 0 in fp32 at any temperature <= 5 (and it never
# wins an argmax).
PAD_LOGIT = 1e6


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
