#!/usr/bin/env python3
"""H200 timing of the DDTree tree build: the PyTorch node selection (per-depth stable sorts) vs the
one-launch Triton kernel (ddtree/kernels/tree_build), at the real drafter's logit shape (vocab
248320, D = 15, bf16), B = 16 / 32 / 64, batch 1 / 8; median microseconds over CUDA-graph
replays (no host launch overhead: as the engine's draft graph runs it).

    python3 studies/gpu_tree_build.py [--budgets 16,32,64] [--batches 1,8] [--warps 1,2,4,8]
                                   # a few minutes: the kernel compiles once per (budget, warps), 1-10 s

Columns: `build` = the whole `build_tree` (top-k log-probs, the selection, path / chain
probabilities), `select` = the node selection alone (what the kernel replaces), its time per
warp count in --warps (the kernel's default: 4 warps up to 1024-key sorts, else 8), the CUDA
kernels one build launches (torch.profiler), and whether the two trees are equal (the pass /
fail checks are tests/gpu/test_tree_build_gpu.py). $OUT/gpu_tree_build.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ddtree import envs  # noqa: E402
from ddtree.bench.cuda_timing import count_kernels, time_graph  # noqa: E402
from ddtree.kernels import tree_build  # noqa: E402
from ddtree.speculative.tree import (  # noqa: E402
    _depth_limit,
    build_tree,
    select_nodes,
    topk_logprobs,
)

V, D = 248320, 15
FIELDS = ("tokens", "parents", "depths", "valid", "tree_mask", "path_probs", "chain_probs")


def equal(a, b) -> bool:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        if x.is_floating_point():
            x, y = x.view(torch.int32), y.view(torch.int32)
        if not torch.equal(x, y):
            return False
    return True


def case(B: int, b: int, warps: list[int], reps: int) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(B * 100 + b)
    logits = (torch.randn(b, D, V, generator=gen, device=dev) * 3).bfloat16()
    roots = torch.randint(0, V, (b,), generator=gen, device=dev)
    limits = torch.full((b,), D, dtype=torch.int64, device=dev)
    budgets = torch.full((b,), B, dtype=torch.int64, device=dev)
    logp, ids = topk_logprobs(logits, B)
    limit = _depth_limit(limits, b, D, dev)
    kernel = tree_build._triton().select_nodes_triton

    def build(select):
        return lambda: build_tree(roots, logits, B, B, True, limits, budgets, select)

    def sel(fn, **kw):
        return lambda: fn(roots, logp, ids, B, True, limit, budgets, **kw)

    row = dict(budget=B, batch=b)
    row["equal"] = equal(build(tree_build.select_nodes)(), build(None)())
    row["build_torch_us"] = time_graph(build(None), reps=reps) * 1e6
    row["build_kernel_us"] = time_graph(build(tree_build.select_nodes), reps=reps) * 1e6
    row["select_torch_us"] = time_graph(sel(select_nodes), reps=reps) * 1e6
    for w in warps:
        row[f"select_kernel_w{w}_us"] = time_graph(sel(kernel, num_warps=w), reps=reps) * 1e6
    row["kernels_torch"] = count_kernels(build(None))
    row["kernels_kernel"] = count_kernels(build(tree_build.select_nodes))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="16,32,64")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--warps", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    os.environ.pop(envs.REFERENCE.name, None)
    warps = [int(w) for w in args.warps.split(",")]
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  V={V} D={D} bf16 logits")
    head = f"{'B':>4} {'batch':>5} | {'build torch':>11} {'kernel':>8} | {'select torch':>12} "
    head += " ".join(f"{f'kernel w{w}':>10}" for w in warps)
    head += f" | {'kernels torch':>13} {'kernel':>6} | equal"
    print(head)
    rows = []
    for B in (int(x) for x in args.budgets.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            r = case(B, b, warps, args.reps)
            rows.append(r)
            line = f"{B:>4} {b:>5} | {r['build_torch_us']:>11.1f} {r['build_kernel_us']:>8.1f} | "
            line += f"{r['select_torch_us']:>12.1f} "
            line += " ".join(f"{r[f'select_kernel_w{w}_us']:>10.1f}" for w in warps)
            line += f" | {r['kernels_torch']:>13} {r['kernels_kernel']:>6} | {r['equal']}"
            print(line, flush=True)
    print("us: median per build over CUDA-graph replays")
    print(f"{time.time() - t0:.1f} s")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_tree_build.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
