#!/usr/bin/env python3
"""H200 check + timing of the Triton tree gated delta rule kernel, one run, < 2 minutes.

    python3 bench/gpu_gdn_tree.py            # from the repo root; writes $OUT/gpu_gdn_tree.json when $OUT is set

Qwen3.6-27B-shaped Gated DeltaNet layer: Hk=16 key heads, Hv=48 value heads, dk=dv=128; a draft tree of
B=64 nodes plus the root (65 nodes, depth-sorted, random branching), requests b=1 and b=8.
1. Correctness vs `reference.tree_gated_delta_rule` (bf16 and fp32 inputs): relative error of outputs and
   node states, plus a batch with padding nodes.
2. Timing from a CUDA graph (the kernel is sync-free): default tiles and a small block_v x num_warps sweep;
   the reference is timed eagerly for scale. Also reported: node-state bytes written / time, against the
   H200's ~4.8 TB/s (the state write is the kernel's floor).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ddtree.bench.cuda_timing import time_graph  # noqa: E402
from ddtree.kernels.gdn.reference import tree_gated_delta_rule  # noqa: E402
from ddtree.kernels.gdn.triton_tree import tree_gated_delta_rule_triton  # noqa: E402

HK, HV, DK, DV, NODES = 16, 48, 128, 128, 65
DEV = torch.device("cuda")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def tree(b, n, gen, pad=0):
    """Depth-sorted random trees (node i's parent < i), the last `pad` nodes of request 0 padding."""
    parents = torch.full((b, n), -1, dtype=torch.int64)
    depths = torch.full((b, n), -1, dtype=torch.int64)
    for r in range(b):
        m = n - (pad if r == 0 else 0)
        depth = [0]
        par = [-1]
        for c in range(1, m):  # parent among the nodes of the deepest two levels: bushy, depth-sorted
            lo = max(0, c - 1 - int(torch.randint(0, 12, (1,), generator=gen)))
            p = int(torch.randint(lo, c, (1,), generator=gen))
            while depth[p] < depth[-1] - 1:
                p += 1
            par.append(p)
            depth.append(depth[p] + 1)
        order = sorted(range(m), key=lambda i: (depth[i], i))
        pos = {old: new for new, old in enumerate(order)}
        parents[r, :m] = torch.tensor([-1 if par[o] < 0 else pos[par[o]] for o in order])
        depths[r, :m] = torch.tensor([depth[o] for o in order])
    return parents.to(DEV), depths.to(DEV)


def inputs(b, n, dtype, gen):
    q = torch.randn(b, n, HK, DK, generator=gen).to(DEV, dtype)
    k = torch.randn(b, n, HK, DK, generator=gen).to(DEV, dtype)
    v = torch.randn(b, n, HV, DV, generator=gen).to(DEV, dtype)
    g = (-torch.rand(b, n, HV, generator=gen) * 2).to(DEV)
    beta = torch.rand(b, n, HV, generator=gen).to(DEV, dtype)
    s0 = (torch.randn(b, HV, DK, DV, generator=gen) * 0.1).to(DEV)
    return q, k, v, g, beta, s0


def time_eager(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return sorted(ts)[len(ts) // 2]


def check(b, dtype, gen, pad=0):
    parents, depths = tree(b, NODES, gen, pad)
    q, k, v, g, beta, s0 = inputs(b, NODES, dtype, gen)
    o, st = tree_gated_delta_rule_triton(q, k, v, g, beta, parents, depths, s0, return_node_states=True)
    ro, rst = tree_gated_delta_rule(q, k, v, g, beta, parents, depths, s0, return_node_states=True)
    res = {"b": b, "dtype": str(dtype), "pad": pad, "rel_out": rel(o, ro), "rel_states": rel(st, rst),
           "finite": bool(torch.isfinite(o).all() and torch.isfinite(st).all())}
    print(f"check b={b} {dtype} pad={pad}: rel out {res['rel_out']:.2e} states {res['rel_states']:.2e} "
          f"finite={res['finite']}", flush=True)
    return res


def bench(b, gen):
    parents, depths = tree(b, NODES, gen)
    q, k, v, g, beta, s0 = inputs(b, NODES, torch.bfloat16, gen)
    buf = torch.empty(b, NODES, HV, DK, DV, dtype=torch.float32, device=DEV)
    state_bytes = buf.numel() * 4
    rows = []
    for bv in (None, 8, 16, 32, 64):
        for nw in (2, 4, 8):
            if bv is None and nw != 4:
                continue

            def fn(bv=bv, nw=nw):
                tree_gated_delta_rule_triton(q, k, v, g, beta, parents, depths, s0, return_node_states=True,
                                             node_states=buf, block_v=bv, num_warps=nw)
            try:
                us = time_graph(fn, reps=20) * 1e6
            except Exception as e:  # noqa: BLE001 - a tile that does not compile (registers) is skipped, not fatal
                print(f"  b={b} block_v={bv} warps={nw}: failed ({type(e).__name__}: {e})", flush=True)
                continue
            tbs = state_bytes / (us * 1e-6) / 1e12
            rows.append({"b": b, "block_v": bv, "num_warps": nw, "us": us, "state_write_TBps": tbs})
            print(f"  b={b} block_v={bv or 'auto'} warps={nw}: {us:8.1f} us  (node-state write {tbs:.2f} TB/s)",
                  flush=True)
    ref_us = time_eager(lambda: tree_gated_delta_rule(q, k, v, g, beta, parents, depths, s0,
                                                      return_node_states=True))
    print(f"  b={b} reference (eager): {ref_us:8.1f} us", flush=True)
    return {"b": b, "kernel": rows, "reference_us": ref_us,
            "best_us": min(r["us"] for r in rows) if rows else None}


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    checks = [check(b, dt, gen) for b in (1, 8) for dt in (torch.float32, torch.bfloat16)]
    checks.append(check(8, torch.float32, gen, pad=20))
    ok = all(c["finite"] and c["rel_states"] < 1e-4 and c["rel_out"] < (1e-4 if "float32" in c["dtype"] else 1e-2)
             for c in checks)
    print("correctness:", "PASS" if ok else "FAIL", flush=True)
    timings = [bench(b, gen) for b in (1, 8)]
    result = {"device": torch.cuda.get_device_name(), "shape": {"Hk": HK, "Hv": HV, "dk": DK, "dv": DV,
              "nodes": NODES}, "checks": checks, "correct": ok, "timings": timings}
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_gdn_tree.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
