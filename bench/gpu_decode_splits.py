#!/usr/bin/env python3
"""H200: AR decode (1 query token, 32 q heads over 8 KV heads, head dim 128, bf16, page 16) through the Triton
split-KV kernel, over split counts and tile configs, against the KV-read floor of the same run (issue 7); also
through the Gluon kernel (hopper.py), forced: its swapped path takes row blocks of <= 8 rows, which a decode
token's GQA group is.
DDTREE_NO_PDL=1 launches the split merge as an ordinary kernel instead of a programmatic dependent of the split
kernel.

    python3 bench/gpu_decode_splits.py [16384,32768]     # ~40 s; prints a table
    python3 bench/gpu_decode_splits.py --batch            # batched / ragged decode: Triton vs Gluon, default splits
    python3 bench/gpu_decode_splits.py --pdl-ab           # the merge as a programmatic dependent of the Gluon
                                                          # kernel, or not: decode and tree points, alternating

Each variant is checked against the PyTorch reference before it is timed (CUDA graph over R random copies).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from gpu_tree_attention import HKV, D, Problem, bandwidths, cold_copies, rel  # noqa: E402

from ddtree import envs  # noqa: E402
from ddtree.bench.cuda_timing import time_graph  # noqa: E402
from ddtree.kernels.tree_attention.hopper import HopperConfig  # noqa: E402
from ddtree.kernels.tree_attention.tuning import KernelConfig  # noqa: E402

SPLITS = (None, 15, 16, 24, 32, 33, 48, 64)
VARIANTS = (
    ("default", {}),
    ("Triton n64 w4 st5", {"config": KernelConfig(16, 64, 4, 5, tail_split=False)}),
    ("Gluon swapped", {"hopper_ctx": HopperConfig()}),
)


def problem(q_lens, kv_lens, tree, seed):
    """A Problem with enough random input copies to defeat L2 (R x KV bytes >= ~240 MB), and its KV bytes."""
    kv_bytes = sum(kv_lens) * HKV * D * 4
    return Problem(q_lens, kv_lens, cold_copies(kv_bytes), tree=tree, seed=seed), kv_bytes


def graph_err(p, ref):
    """The default launch replayed from a CUDA graph (with PDL, the merge is a programmatic dependent there too)
    against the reference, after the pools' other copies ran in between."""
    out = torch.full_like(ref, float("nan"), dtype=p.qs[0].dtype)
    p.ours(0, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.ours(0, out=out)
    out.fill_(float("nan"))
    p.ours(1)
    graph.replay()
    torch.cuda.synchronize()
    return rel(out, ref) if torch.isfinite(out).all() else float("inf")


BATCHES = [
    ("b1 1k", [1024]),
    ("b1 2k", [2048]),
    ("b8 1k", [1024] * 8),
    ("b8 2k", [2048] * 8),
    ("b8 4k", [4096] * 8),
    ("b8 16k", [16384] * 8),
    ("b8 ragged 0.5-16k", [500, 16384, 3000, 9000, 1, 12000, 700, 6000]),
    ("b32 1k", [1024] * 32),
    ("b64 2k", [2048] * 64),
    ("b4 32k", [32768] * 4),
    ("b4 2-token chains 4k", [4096] * 4),
]  # the last: q_len 2 (8 rows: still one swapped block)


def batched(bw):
    print("| decode batch | floor us | Triton (splits) | Gluon swapped (splits) | Gluon / Triton |")
    print("|---|---|---|---|---|")
    for name, kv_lens in BATCHES:
        q_len = 2 if "2-token" in name else 1
        p, kv_bytes = problem([q_len] * len(kv_lens), kv_lens, False, len(kv_lens))
        ref = p.reference(0)
        cells = []
        for kw in ({"hopper_ctx": False}, {"hopper_ctx": HopperConfig()}):
            out, plan = p.ours_plan(0, **kw)
            err, used = rel(out, ref), plan.num_splits
            t = time_graph(lambda: [p.ours(r, **kw) for r in range(p.R)], p.R) * 1e6
            cells.append((t, used, err))
        (tt, st, et), (tg, sg, eg) = cells
        flag = "  WRONG" if max(et, eg) > 1e-2 else ""
        print(
            f"| {name} | {kv_bytes / bw * 1e6:.1f} | {tt:.1f} ({st}) | {tg:.1f} ({sg}) | {tg / tt:.2f}{flag} |",
            flush=True,
        )


PDL_POINTS = [
    ("decode b1 4k", [1], [4096]),
    ("decode b1 16k", [1], [16384]),
    ("decode b1 32k", [1], [32768]),
    ("decode b8 4k", [1] * 8, [4096] * 8),
    ("tree 65 16k", [65], [16384 + 65]),
    ("tree 65 32k", [65], [32768 + 65]),
    ("tree 65 b8 8k", [65] * 8, [8192 + 65] * 8),
    ("tree 17 16k", [17], [16384 + 17]),
]


def pdl_ab():
    """Each point's default Gluon launch with the merge as a programmatic dependent (HopperConfig(pdl=True))
    and as an ordinary launch (pdl=False), timed on, off, on, off in one process."""
    print("| point | merge PDL (2 runs) | ordinary launch (2 runs) | on / off |")
    print("|---|---|---|---|")
    for name, q_lens, kv_lens in PDL_POINTS:
        p, _ = problem(q_lens, kv_lens, q_lens[0] > 1, len(name))
        ref = p.reference(0)
        times = {True: [], False: []}
        for on in (True, False, True, False):
            cfg = HopperConfig(pdl=on)
            err = rel(p.ours(0, hopper_ctx=cfg), ref)
            if err > 1e-2:
                print(f"  WRONG: {name} pdl={on}: rel err {err:.2e}")
            times[on].append(
                time_graph(lambda: [p.ours(r, hopper_ctx=cfg) for r in range(p.R)], p.R) * 1e6
            )
        on_t, off_t = times[True], times[False]
        print(
            f"| {name} | {on_t[0]:.1f}, {on_t[1]:.1f} | {off_t[0]:.1f}, {off_t[1]:.1f} | "
            f"{min(on_t) / min(off_t):.3f} |",
            flush=True,
        )


def main():
    if "--pdl-ab" in sys.argv:
        return pdl_ab()
    bw = bandwidths()["sm_copy_graph"]
    torch.cuda.empty_cache()
    pdl = "off" if envs.NO_PDL.on() else "on"
    print(f"{torch.cuda.get_device_name()}; SM copy {bw / 1e12:.2f} TB/s; PDL {pdl}")
    if "--batch" in sys.argv:
        return batched(bw)
    ctxs = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "16384,32768").split(",")]
    for ctx in ctxs:
        p, kv_bytes = problem([1], [ctx], False, ctx)
        ref = p.reference(0)
        floor = kv_bytes / bw * 1e6
        print(
            f"\ndecode {ctx}: floor {floor:.1f} us (R={p.R}); CUDA-graph replay rel err {graph_err(p, ref):.1e}"
        )
        best = None
        for name, kw in VARIANTS:
            cells = []
            for s in SPLITS:
                try:
                    out, plan = p.ours_plan(0, num_splits=s, **kw)
                    err, used = rel(out, ref), plan.num_splits
                    t = (
                        time_graph(lambda: [p.ours(r, num_splits=s, **kw) for r in range(p.R)], p.R)
                        * 1e6
                    )
                except Exception as e:  # noqa: BLE001
                    cells.append(f"s{s}: {type(e).__name__}")
                    continue
                flag = "  WRONG" if err > 1e-2 else ""
                cells.append(f"s{used}{'*' if s is None else ''} {t:.1f}{flag}")
                if not flag and (best is None or t < best[0]):
                    best = (t, name, used)
            print(f"  {name:<18} " + "  ".join(cells), flush=True)
        print(
            f"  best {best[0]:.1f} us = {best[0] / floor:.2f}x floor ({best[1]}, splits {best[2]})"
        )


if __name__ == "__main__":
    main()
