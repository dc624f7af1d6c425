"""Merging the split-KV partials (Triton), and launching that merge as a programmatic dependent of the splits.

Each split writes, per row (token, query head), a normalised partial o_s [D] and its base-2 log-sum-exp lse_s at
part_o / part_lse[(token * Hq + head) * num_splits + s]; the merged row is sum_s w_s o_s / sum_s w_s with
w_s = 2^(lse_s - max lse) (a split with lse = -inf weighs 0). `reference.split_partials_reference` is the oracle
of the partials.

PDL (programmatic dependent launch, sm_90+): the split kernel calls `gdc_launch_dependents` first, so the merge's
programs can be scheduled while the splits run; they wait in `gdc_wait` (griddepcontrol.wait) until the split
grid has finished and its writes are visible. That hides the launch gap between the two kernels, a visible
share of a memory-bound decode call (docs/design-numbers.md). The Gluon kernel (hopper.py) triggers it the
same way for decode-shaped launches (`dispatch.gluon_merge_pdl`).
Captured CUDA graphs keep the programmatic edge. DDTREE_DISABLE=pdl launches the merge as an ordinary kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ddtree.kernels.pdl import HAVE_GDC, gdc_launch_dependents, gdc_wait, pdl_ok

__all__ = ["HAVE_GDC", "combine", "gdc_launch_dependents", "gdc_wait", "pdl_ok"]


@triton.jit
def combine(
    part_o,
    part_lse,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (token, query head). With PDL it may start before the split grid ends (see above)."""
    if PDL:
        gdc_wait()  # before the first read of a partial: the split grid has finished and its writes are visible
    tok = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    base = (tok * HQ + h) * num_splits
    lse = tl.load(part_lse + base + s, mask=s_ok, other=float("-inf"))
    top = tl.reduce(lse, 0, tl.standard._elementwise_max)
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    d = tl.arange(0, D)
    o = tl.load(part_o + (base + s)[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    res = tl.reduce(o * w[:, None], 0, tl.standard._sum_combine) / tl.reduce(
        w, 0, tl.standard._sum_combine
    )
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty))
