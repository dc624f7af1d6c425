"""Function-preserving widening of a trained small (target, DFlash drafter) pair to a production
shape.

`inflate_pair(src_target, src_drafter, shape)` returns an ordinary pair of the shape (e.g. Qwen3-8B,
or the hybrid Qwen3.6-27B) whose logits over the source's vocabulary equal the small model's and
whose drafter proposes what the small drafter proposes, while every projection, attention, Gated
DeltaNet and MLP runs at full size. `write_pair` writes it as OUT/target and OUT/drafter; `ddtree
inflate` does both.

Why it is exact (fp32 agrees to rounding; the tests hold it to 1e-5):
- Residual stream h -> H: real dims first, the others exactly zero: embedding columns there are zero
  and every projection writing the residual (o_proj, down_proj, GDN out_proj) has zero rows there.
  An RMSNorm over H sees the small model's sum of squares; with eps_H = (eps h - gamma^2) / H and
  real scales times sqrt(h/H), its output equals the small norm's (Qwen3.5 (1 + w) norms: the same
  on 1 + w).
- With a larger vocabulary one residual dim (`const`, the first padded one) holds gamma (a power of
  two, gamma^2 <= eps h / 2) in every embedding row; no projection reads or writes it (zero columns
  / rows) except the drafter's fc, which copies it into the fused context so that hidden_norm's RMS
  is exact as well. The final norms have scale 1 there, and each padded LM-head row is zero except
  -W on `const`, so a padded token scores -1e6 / (RMS of the small model's final residual): it never
  wins an argmax, and its softmax weight is exactly 0 in fp32 at any temperature the server accepts.
  Real LM-head rows are zero on `const`.
- Heads: head dim d -> D with RoPE pairs (i, i + rd/2) at theta^(-2i/rd): real dim j goes to k j and
  j + rd/2 to k j + rd_big/2 (rd_big = k rd, the rotary width; Qwen3.5's partial rotary part
  likewise), so each real pair meets its own frequency under the source's theta. q/k norms see the
  sum over D instead of d and the scale is 1/sqrt(D): k's norm scale times sqrt(d/D) cancels both.
  Each small KV head is copied into as many big KV heads as its q group needs; its q heads keep
  their group; every other q head copies a real q head of its KV head's group and has zero o_proj
  columns: real attention, no contribution.
- MLP channels beyond the source's copy real ones (real compute) with zero down_proj columns.
- Layers: source layers sit evenly over the big layers (hybrid: over the full-attention slots; the
  gated attention's gate rows are zero, sigmoid(0) = 1/2, so o_proj is doubled). Every other layer
  copies the nearest earlier source layer with zero o_proj and down_proj, and Gated DeltaNet layers
  have seeded random projections and a zero out_proj: they compute on the real residual stream and
  add nothing to it.
- The drafter is widened the same way; its taps are the layers that carry the source's tapped layers
  (a tap is a layer's output residual, which the extra layers after it leave unchanged), plus extra
  taps whose fc columns are zero. Sliding-window drafter layers keep the source layers' in-block
  causality, so the drafter is exact for contexts within the window (2048 for Qwen3.6) and only
  windowed beyond it. The one inexactness in exact arithmetic: the per-head q/k norms (and none
  other) add eps_H instead of eps d/D to the mean square, a relative change of about eps / (2
  mean(q^2)), ~1e-7 for trained weights. The tree / accept math is untouched, so acceptance is the
  small pair's and the cost is the shape's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from ddtree.configs import DrafterConfig, TargetConfig
from ddtree.inflate.drafter import drafter_config, drafter_taps, inflate_drafter
from ddtree.inflate.layout import InflateError, residual_for
from ddtree.inflate.shapes import resolve_shape
from ddtree.inflate.target import inflate_target, target_config
from ddtree.inflate.writer import copy_tokenizer, write_model

__all__ = ["InflateError", "InflatedPair", "inflate_pair", "write_pair"]


@dataclass
class InflatedPair:
    target: nn.Module
    drafter: nn.Module
    target_config: dict  # config.json dicts
    drafter_config: dict
    carriers: list[int]  # big target layer of each source layer
    source_target_dir: str


def _load_source(path: str, device) -> nn.Module:
    from ddtree.models.loader import load_target

    return load_target(path, torch.float32, str(device))


@torch.no_grad()
def inflate_pair(
    src_target: str,
    src_drafter: str,
    shape: str | dict,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> InflatedPair:
    """Build the widened pair in memory on `device` (nothing written): the 27B pair is built this
    way on the GPU. `shape`: "qwen3-8b", "qwen3.6-27b", a config.json path or dict (see
    `ddtree.inflate.shapes`)."""
    from ddtree.models.loader import load_drafter

    device = torch.device(device)
    tshape, dshape = resolve_shape(shape)
    src_t = _load_source(src_target, device)
    src_d = load_drafter(src_drafter, torch.float32, str(device))
    s, sd = src_t.config, src_d.config
    for key, small in (("hidden_size", s.hidden_size), ("vocab_size", s.vocab_size)):
        if int(tshape[key]) < small:
            raise InflateError(f"--shape {key} {tshape[key]} is smaller than the source's {small}")
    res = residual_for(
        s.hidden_size,
        int(tshape["hidden_size"]),
        int(tshape["vocab_size"]) > s.vocab_size,
        min(s.rms_norm_eps, sd.rms_norm_eps),
    )
    name = str(dtype).removeprefix("torch.")
    tdict = target_config(s, tshape, res, name)
    tcfg = TargetConfig.from_dict(tdict)
    target, carriers = inflate_target(src_t, tcfg, res, device, dtype, seed)
    taps = drafter_taps(
        sd, carriers, int(dshape.get("num_taps", len(sd.target_layer_ids))), tcfg.num_hidden_layers
    )
    ddict = drafter_config(sd, dshape, tdict, taps, res, name)
    drafter = inflate_drafter(
        src_d, DrafterConfig.from_dict(ddict), tcfg, res, device, dtype, carriers
    )
    return InflatedPair(target, drafter, tdict, ddict, carriers, src_target)


def write_pair(pair: InflatedPair, out_dir: str, shard_bytes: int | None = None) -> tuple[str, str]:
    """OUT/target (weights, config, tokenizer, chat template) and OUT/drafter; their paths."""
    tdir, ddir = os.path.join(out_dir, "target"), os.path.join(out_dir, "drafter")
    kw = {} if shard_bytes is None else {"shard_bytes": shard_bytes}
    write_model(pair.target, tdir, pair.target_config, **kw)
    copy_tokenizer(pair.source_target_dir, tdir)
    write_model(pair.drafter, ddir, pair.drafter_config, **kw)
    return tdir, ddir
