"""The widened DFlash drafter: its layers spread over the shape's layers, its taps on the target
layers that carry the source's tapped layers, extra taps on other layers with zero `fc` columns."""

from __future__ import annotations

import torch
from torch import nn

from ddtree.configs import DrafterConfig, TargetConfig
from ddtree.tools.inflate.blocks import fill_layer, fill_residual_norm
from ddtree.tools.inflate.layout import head_maps, put
from ddtree.tools.inflate.plan import InflateError, Residual, spread


@torch.no_grad()
def inflate_drafter(
    small: nn.Module,
    cfg: DrafterConfig,
    tcfg: TargetConfig,
    res: Residual,
    device,
    dtype: torch.dtype,
    carriers: list[int],
) -> nn.Module:
    from ddtree.models.dflash import DFlashDrafter

    s = small.config
    if (
        s.rope_scaling is not None
        or s.input_embedding_scale != 1.0
        or s.output_multiplier != 1.0
        or s.final_logit_softcapping
    ):
        raise InflateError(
            "SRC_DRAFTER uses rope_scaling or logit scaling: not supported by inflate"
        )
    if cfg.num_hidden_layers < s.num_hidden_layers or cfg.intermediate_size < s.intermediate_size:
        raise InflateError(
            f"drafter shape ({cfg.num_hidden_layers} layers, MLP {cfg.intermediate_size}) is "
            f"smaller than the source's ({s.num_hidden_layers}, {s.intermediate_size})"
        )
    with torch.device("meta"):
        big = DFlashDrafter(cfg).to(dtype)
    big = big.to_empty(device=device)
    h, H = s.hidden_size, cfg.hidden_size
    big_pos = {b: t for t, b in enumerate(cfg.target_layer_ids)}
    cols = torch.full((len(cfg.target_layer_ids) * H,), -1)
    for t_small, layer in enumerate(s.target_layer_ids):
        t = big_pos[carriers[layer]]
        cols[t * H : t * H + h] = torch.arange(h) + t_small * h
    put(big.fc.weight.data, small.fc.weight.data, res.map, cols)
    # the fused context carries the constant too, so hidden_norm's RMS is exact
    if res.const is not None:
        big.fc.weight.data[res.const, res.const] = 1.0
    fill_residual_norm(big.hidden_norm.weight, small.hidden_norm.weight, res, False, False)
    maps = head_maps(
        s.num_attention_heads,
        s.num_key_value_heads,
        s.head_dim,
        s.head_dim,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.head_dim,
    )
    placed = spread(s.num_hidden_layers, list(range(cfg.num_hidden_layers)))
    where = {b: i for i, b in enumerate(placed)}
    src_layer = 0
    for j, layer in enumerate(big.layers):
        src_layer = where.get(j, src_layer)
        fill_layer(layer, small.layers[src_layer], maps, res, j in where)
    fill_residual_norm(big.norm.weight, small.norm.weight, res, False, False, const_value=1.0)
    return big.eval()
