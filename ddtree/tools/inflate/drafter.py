"""The widened DFlash (or DFlash2) drafter: its layers spread over the shape's layers, its taps on
the target layers that carry the source's tapped layers, extra taps on other layers with zero `fc`
columns; DFlash2's convolutions and selector widened like the residual (`fill_conv`,
`fill_selector`)."""

from __future__ import annotations

import torch
from torch import nn

from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.tools.inflate.blocks import fill_layer, fill_residual_norm
from ddtree.tools.inflate.layout import cycle_map, head_maps, pad_map, put
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
    from ddtree.models.drafters import build_drafter

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
        big = build_drafter(cfg).to(dtype)
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
        if s.is_dflash2:
            for name in ("attention_conv", "mlp_conv"):
                fill_conv(getattr(layer, name), getattr(small.layers[src_layer], name), res)
    fill_residual_norm(big.norm.weight, small.norm.weight, res, False, False, const_value=1.0)
    if s.is_dflash2:
        fill_selector(big.candidate_selector, small.candidate_selector, res)
    return big.eval()


def fill_conv(big: nn.Module, small: nn.Module, res: Residual) -> None:
    """A grouped dynamic convolution on the widened residual: big group g < the source's group
    count is the source's group g (real dims first, same group size), with its taps; every other
    group has zero taps. Its inputs are zero on the non-real dims the attention / MLP read (their
    columns there are zero) and its outputs zero where the residual is: so it adds what the small
    one adds."""
    k, G, g = small.kernel_size, small.taps // small.kernel_size, big.taps // big.kernel_size
    for side in range(2):
        put(big.base_kernel.data[side], small.base_kernel.data[side], None, res.map)
    # rows laid out (side, tap, group)
    side, tap, group = torch.meshgrid(
        torch.arange(2), torch.arange(k), torch.arange(g), indexing="ij"
    )
    rows = torch.where(group < G, (side * k + tap) * G + group, -1).flatten()
    put(big.kernel_projection.weight.data, small.kernel_projection.weight.data, rows, res.map)


def fill_selector(big: nn.Module, small: nn.Module, res: Residual) -> None:
    """Real vocabulary rows first (the target's layout); the extra rank columns compute (copied
    projection rows, copied successor columns) but add zero: their predecessor columns are zero.
    Padded vocabulary rows are zero (their logits never reach a top-k)."""
    r, R = small.hidden_projection.weight.shape[0], big.hidden_projection.weight.shape[0]
    V, Vb = small.predecessor_codebook.shape[0], big.predecessor_codebook.shape[0]
    put(
        big.hidden_projection.weight.data,
        small.hidden_projection.weight.data,
        cycle_map(r, R),
        res.map,
    )
    put(
        big.predecessor_codebook.data,
        small.predecessor_codebook.data,
        pad_map(V, Vb),
        pad_map(r, R),
    )
    put(big.successor_codebook.data, small.successor_codebook.data, pad_map(V, Vb), cycle_map(r, R))
