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

In bf16 the two pairs round differently (the norm scales sqrt(h/H) are not powers of two, and wide
GEMMs accumulate in another order), so near-ties flip: on fixed text the inflated pair's DFLASH
acceptance stays close to the small pair's bf16 (`tools.studies.at_scale_precision`), but each pair
decodes its own text and a served τ follows the text (`tools.studies.at_scale_trajectories`; the
numbers: docs/design-numbers.md).

`--model-path inflate:<shape>[:<src_target>:<src_drafter>]` (`source.py`) serves a pair built in
memory: `plan.py` gives its configs without torch, `pair.py` builds it on the serving device.
"""

from __future__ import annotations

from ddtree.models.shapes import InflateError

__all__ = ["InflateError", "InflatedPair", "inflate_pair", "write_pair"]
_PAIR = ("InflatedPair", "inflate_pair", "write_pair")


def __getattr__(name: str):
    # the weights half needs torch; the config half (plan, shapes, source) must not import it, and
    # importing any submodule runs this file first
    if name in _PAIR:
        from ddtree.tools.inflate import pair

        return getattr(pair, name)
    raise AttributeError(f"module 'ddtree.tools.inflate' has no attribute {name!r}")
