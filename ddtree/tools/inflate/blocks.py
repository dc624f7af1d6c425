"""Filling one big attention / MLP / decoder layer from a small one (the maps are `layout.py`'s)."""

from __future__ import annotations

import torch
from torch import nn

from ddtree.tools.inflate.layout import HeadMaps, norm_weight, put
from ddtree.tools.inflate.plan import Residual


def fill_attention(
    big: nn.Module,
    small: nn.Module,
    maps: HeadMaps,
    res: Residual,
    real: bool,
    src_offset: bool = False,
    dst_offset: bool = False,
) -> None:
    """Qwen3 or gated attention `big` from Qwen3 attention `small`. q/k norms over the wider head
    see the same sum of squares over D instead of d; the D/d this puts on q.k and the 1/sqrt(D)
    scale cancel when k's scale is multiplied by sqrt(d/D). A gated head's gate rows are zero:
    sigmoid(0) = 1/2, so o_proj is doubled. `real=False` (an extra layer): every o_proj column is
    zero."""
    gated = getattr(big, "gated", False)
    d, D = small.head_dim, big.head_dim
    q_rows = maps.q_rows
    if gated:  # per head [query D | gate D]
        q_rows = torch.cat([q_rows.view(big.heads, D), torch.full((big.heads, D), -1)], 1).flatten()
    off = small.q_size
    kv = torch.where(maps.kv_rows >= 0, maps.kv_rows + off, -1)
    vv = torch.where(maps.kv_rows >= 0, maps.kv_rows + off + small.kv_size, -1)
    put(big.qkv_proj.weight.data, small.qkv_proj.weight.data, torch.cat([q_rows, kv, vv]), res.map)
    o_cols = maps.o_cols if real else torch.full_like(maps.o_cols, -1)
    put(
        big.o_proj.weight.data,
        small.o_proj.weight.data,
        res.map,
        o_cols,
        scale=2.0 if gated else 1.0,
    )
    for b in (big.qkv_proj.bias, big.o_proj.bias):
        if b is not None:
            b.data.zero_()
    norm_weight(big.q_norm.weight, small.q_norm.weight, maps.dims, 1.0, src_offset, dst_offset)
    norm_weight(
        big.k_norm.weight, small.k_norm.weight, maps.dims, (d / D) ** 0.5, src_offset, dst_offset
    )


def fill_mlp(big: nn.Module, small: nn.Module, res: Residual, real: bool) -> None:
    """Extra channels copy real ones (gate|up rows cycle); their down_proj columns are zero."""
    i, n_inter = small.inter, big.inter
    rows = torch.arange(n_inter) % i
    put(
        big.gate_up_proj.weight.data,
        small.gate_up_proj.weight.data,
        torch.cat([rows, rows + i]),
        res.map,
    )
    cols = (
        torch.where(torch.arange(n_inter) < i, torch.arange(n_inter), -1)
        if real
        else torch.full((n_inter,), -1)
    )
    put(big.down_proj.weight.data, small.down_proj.weight.data, res.map, cols)


def fill_residual_norm(
    big: torch.Tensor,
    small: torch.Tensor,
    res: Residual,
    src_offset: bool,
    dst_offset: bool,
    const_value: float = 0.0,
) -> None:
    """A residual-stream norm: real scales times sqrt(h/H); `const_value` on the constant dim."""
    norm_weight(
        big,
        small,
        res.map,
        res.scale,
        src_offset,
        dst_offset,
        const=res.const,
        const_value=const_value,
    )


def fill_layer(
    big: nn.Module,
    small: nn.Module,
    attn_maps: HeadMaps | None,
    res: Residual,
    real: bool,
    src_offset: bool = False,
    dst_offset: bool = False,
) -> None:
    """A decoder layer with attention (or, when `attn_maps` is None, a token mixer filled
    elsewhere), MLP and its two norms."""
    if attn_maps is not None:
        fill_attention(big.self_attn, small.self_attn, attn_maps, res, real, src_offset, dst_offset)
    fill_mlp(big.mlp, small.mlp, res, real)
    for name in ("input_layernorm", "post_attention_layernorm"):
        fill_residual_norm(
            getattr(big, name).weight, getattr(small, name).weight, res, src_offset, dst_offset
        )


@torch.no_grad()
def random_gdn(gdn: nn.Module, gen: torch.Generator) -> None:
    """A Gated DeltaNet with no source: seeded random projections (std 0.02) and HF-style decays,
    and a zero out_proj, so it runs on the real residual stream at full cost and adds nothing."""
    for name, p in gdn.named_parameters():
        if name == "A_log":
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(1, 16, generator=gen).log())
        elif name == "dt_bias" or name == "norm.weight":
            p.fill_(1.0)
        elif name == "out_proj.weight":
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, device=p.device, generator=gen) * 0.02)
