"""Index maps of a widening: which small-model row / column each row / column of a big tensor copies
(-1: an exact zero), and the norm-scale algebra that keeps every normalised value equal.

A map is a LongTensor over a big axis; `put(dst, src, rows, cols)` writes dst[r, c] = src[rows[r],
cols[c]] where both are >= 0 and 0 elsewhere. Rows may repeat a source row (extra heads / MLP
channels that compute on real data); columns that feed the residual stream never do (their copies
are the zeros that make extras contribute nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.models.shapes import InflateError


def put(
    dst: torch.Tensor,
    src: torch.Tensor,
    rows: torch.Tensor | None = None,
    cols: torch.Tensor | None = None,
    scale: float = 1.0,
) -> None:
    dst.zero_()
    dev = dst.device
    rows = torch.arange(dst.shape[0], device=dev) if rows is None else rows.to(dev)
    rv = (rows >= 0).nonzero().flatten()
    src = src.to(dev)
    if dst.dim() == 1:
        dst[rv] = (src[rows[rv]].float() * scale).to(dst.dtype)
        return
    cols = torch.arange(dst.shape[1], device=dev) if cols is None else cols.to(dev)
    cv = (cols >= 0).nonzero().flatten()
    block = src[rows[rv]][:, cols[cv]].float() * scale
    dst[rv[:, None], cv[None, :]] = block.to(dst.dtype)


def pad_map(small: int, big: int) -> torch.Tensor:
    """Real dims first, the rest zero."""
    return torch.cat([torch.arange(small), torch.full((big - small,), -1)])


def cycle_map(small: int, big: int) -> torch.Tensor:
    """Real rows first, then copies of them (extras computing on real data)."""
    return torch.arange(big) % small


def head_dim_map(d: int, rd: int, D: int, rd_big: int) -> torch.Tensor:
    """Big head dim -> small head dim. RoPE rotates pairs (i, i + rd/2) at theta^(-2i/rd): with
    rd_big = k rd, small dim j < rd/2 goes to k j and j + rd/2 to k j + rd_big/2, so it meets the
    same frequency theta^(-2kj/(k rd)); unrotated dims follow the rotary part."""
    if rd_big < rd or rd_big % rd or (d - rd) > (D - rd_big):
        raise InflateError(
            f"head_dim {D} (rotary {rd_big}) cannot hold head_dim {d} (rotary {rd}): the rotary "
            f"width must be a multiple of the source's and the rest must fit"
        )
    k, m = rd_big // rd, torch.full((D,), -1)
    half, big_half = rd // 2, rd_big // 2
    for j in range(half):
        m[k * j], m[k * j + big_half] = j, j + half
    for j in range(rd, d):
        m[rd_big + j - rd] = j
    return m


@dataclass(frozen=True)
class HeadMaps:
    """Rows of q / k|v projections and columns of o_proj, in big (head, dim) order."""

    q_rows: torch.Tensor
    kv_rows: torch.Tensor
    o_cols: torch.Tensor
    dims: torch.Tensor  # big head dim -> small head dim (-1: zero)


def head_maps(
    heads: int, kv_heads: int, d: int, rd: int, H: int, KV: int, D: int, rd_big: int
) -> HeadMaps:
    """Real q heads keep their KV group: small KV head g is copied into ceil(gs / gb) big KV heads
    and its gs q heads fill their groups in order. Every other q head copies a q head of its KV
    head's source group (real attention, zero o_proj columns)."""
    gs, gb = heads // kv_heads, H // KV
    per = -(-gs // gb)
    if kv_heads * per > KV:
        raise InflateError(
            f"num_key_value_heads {KV} (group {gb}) cannot hold {kv_heads} KV heads of group {gs}: "
            f"need at least {kv_heads * per}"
        )
    src_kv = [b // per if b < kv_heads * per else b % kv_heads for b in range(KV)]
    src_q, real = [-1] * H, [False] * H
    for i in range(heads):
        g, t = divmod(i, gs)
        big = (g * per + t // gb) * gb + t % gb
        src_q[big], real[big] = i, True
    for big in range(H):
        if src_q[big] < 0:
            src_q[big] = src_kv[big // gb] * gs + big % gs
    dims = head_dim_map(d, rd, D, rd_big)
    valid = dims >= 0

    def rows(src: list[int], keep: list[bool] | None = None) -> torch.Tensor:
        out = []
        for h, s in enumerate(src):
            r = torch.where(valid, s * d + dims, -1)
            out.append(r if keep is None or keep[h] else torch.full_like(r, -1))
        return torch.cat(out)

    return HeadMaps(rows(src_q), rows(src_kv), rows(src_q, real), dims)


def norm_weight(
    dst: torch.Tensor,
    src: torch.Tensor,
    dims: torch.Tensor,
    scale: float,
    src_offset: bool,
    dst_offset: bool,
    fill: float = 1.0,
    const: int | None = None,
    const_value: float = 0.0,
) -> None:
    """dst's effective scale (w, or 1 + w for Qwen3.5 norms) = source effective scale[dims] * scale;
    `fill` on dims that only ever see zeros, `const_value` on the constant dim."""
    eff_src = src.float() + (1.0 if src_offset else 0.0)
    eff = torch.full((dst.shape[0],), fill, dtype=torch.float32, device=dst.device)
    valid = (dims >= 0).nonzero().flatten().to(dst.device)
    eff[valid] = eff_src.to(dst.device)[dims.to(dst.device)[valid]] * scale
    if const is not None:
        eff[const] = const_value
    with torch.no_grad():
        dst.copy_((eff - (1.0 if dst_offset else 0.0)).to(dst.dtype))
