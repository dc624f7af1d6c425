#!/usr/bin/env python3
"""H200: the Gluon kernel (ddtree/kernels/tree_attention/hopper.py) against the Triton-only path, one run.

    python3 studies/gpu_tree_attention_hopper.py        # ~2 minutes; writes $OUT/gpu_tree_attention_hopper.json

Correctness against the PyTorch reference (Hopper kernel on, forced split counts, every VARIANTS config) is
tests/gpu/test_tree_attention_gpu.py. Timing (same shapes and method as gpu_tree_attention.py: CUDA
graph over R random input copies, cold L2):
   Triton-only vs the Gluon kernel at the issue's points, split counts around the default, and the
   per-kernel device times (torch.profiler) of one call with the Hopper kernel.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from gpu_tree_attention import (
    HKV,
    D,
    Problem,
    bandwidths,
    cold_copies,
    kernel_times,
    rel,
    save_json,
)  # noqa: E402

from ddtree.bench.cuda_timing import time_graph  # noqa: E402
from ddtree.kernels.tree_attention.hopper import HopperConfig  # noqa: E402

T0 = time.time()
# Hopper-kernel configs timed beside the default dispatch (dispatch.gluon_config_for; correctness: tests/gpu):
# 64-row blocks (DEFAULT), two warpgroups with 128- or 64-wide tiles, and tail_n=0 (the kernel before the
# swapped tail block)
VARIANTS = (
    HopperConfig(),
    HopperConfig(128, 128, 3),
    HopperConfig(128, 64, 3),
    HopperConfig(tail_n=0),
)
POINTS = [
    ("b1 n65 1k", 1, 65, 1024),
    ("b1 n65 4k", 1, 65, 4096),
    ("b1 n65 16k", 1, 65, 16384),
    ("b1 n65 32k", 1, 65, 32768),
    ("b8 n65 8k", 8, 65, 8192),
    ("b1 n64 16k", 1, 64, 16384),
    ("b1 n17 16k", 1, 17, 16384),
    ("b8 n64 8k", 8, 64, 8192),
    ("b1 n64 32k", 1, 64, 32768),
]


def point(name, b, n, ctx, bw):
    L = ctx + n
    kv_bytes = b * L * HKV * D * 4
    p = Problem([n] * b, [L] * b, cold_copies(kv_bytes), tree=n > 1, seed=ctx + n)
    floor = kv_bytes / bw
    ref = p.reference(0)
    row = {"point": name, "floor_us": floor * 1e6}

    def run(hop, splits, cfg=None):
        out, plan = p.ours_plan(0, hopper_ctx=hop, num_splits=splits, config=cfg)
        s, used = plan.num_splits, plan.hopper
        err = rel(out, ref)
        if err > 1e-2:
            print(f"    WRONG: {hop} {cfg} splits={splits}: rel {err:.2e}")
        t = time_graph(
            lambda: [p.ours(r, hopper_ctx=hop, num_splits=splits, config=cfg) for r in range(p.R)],
            p.R,
        )
        return t * 1e6, s, used, err

    tri = run(False, None)
    hop = run(None, None)
    row.update(
        triton_us=tri[0],
        triton_splits=tri[1],
        hopper_us=hop[0],
        hopper_splits=hop[1],
        used=str(hop[2]),
        err=max(tri[3], hop[3]),
    )
    best = hop
    for s in sorted({max(2, hop[1] - 2), hop[1] + 2} - {hop[1]}):
        r = run(HopperConfig(), s)
        if r[0] < best[0]:
            best = r
    row.update(best_us=best[0], best_splits=best[1], variants={})
    for c in VARIANTS:
        r = run(c, None)
        name_c = f"m{c.block_m}n{c.block_n}s{c.stages}t{c.tail_n}"
        row["variants"][name_c] = (r[0], r[1])
    print(
        f"    {name} variants: "
        + ", ".join(f"{k} {v[0]:.1f} (s={v[1]})" for k, v in row["variants"].items())
    )
    print(
        f"  {name:<12} floor {floor * 1e6:6.1f}  triton {tri[0]:7.1f} (s={tri[1]})  hopper {hop[0]:7.1f} "
        f"(s={hop[1]}, used={hop[2]})  best {best[0]:7.1f} (s={best[1]})  rel {row['err']:.1e}",
        flush=True,
    )
    if name == "b1 n65 16k":
        row["kernels_us"] = kernel_times(p, None)
        print("    kernels: " + ", ".join(f"{k} {v:.1f}" for k, v in row["kernels_us"].items()))
    return row


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    bw = bandwidths()["sm_copy_graph"]
    torch.cuda.empty_cache()
    print(f"SM copy {bw / 1e12:.2f} TB/s", flush=True)
    rows = [point(*pt, bw) for pt in POINTS]
    print("\n| point | floor us | Triton only | + Hopper ctx kernel | x floor | best (splits) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['point']} | {r['floor_us']:.1f} | {r['triton_us']:.1f} | {r['hopper_us']:.1f} | "
            f"{r['hopper_us'] / r['floor_us']:.2f}x | {r['best_us']:.1f} ({r['best_splits']}) |"
        )
    save_json("gpu_tree_attention_hopper.json", {"sm_copy_Bps": bw, "points": rows})
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
