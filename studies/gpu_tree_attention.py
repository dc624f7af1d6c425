#!/usr/bin/env python3
"""H200 timing + config sweep of the split-KV paged tree-attention kernel (issue 7), one run, < 4 minutes.

    python3 studies/gpu_tree_attention.py            # from the repo root; writes $OUT/gpu_tree_attention.json
    python3 studies/gpu_tree_attention.py --shape qwen3.6-27b   # the hybrid target's gated attention:
        # 24 query heads, 4 KV heads, head dim 256 (AR / DFLASH chain / B=64 tree points, batch 1 and 8)

Prints, per shape, every variant (the default, each config of `sweep_configs`, split counts around the best)
with its time, ratio to the KV floor and relative error, then a WINNER line per shape and a final summary
table against the issue's targets, from which to set defaults. Correctness against the PyTorch reference on
random ragged batches is tests/gpu/test_tree_attention_gpu.py (`python3 -m pytest -m gpu tests/gpu`); the
frozen v1 kernel's numbers are in BENCHMARKS.md (git holds studies/tree_attention_v1.py before its removal).

Timing (32 query heads, 8 KV heads, head dim 128, bf16, page size 16): ours (default config, and the best
   of a small sweep of tile configs / split counts), SDPA (dense K/V, dense bool mask) and FlexAttention
   (block mask, Triton backend), each as a ratio to the KV-read floor = KV bytes / device-to-device copy
   bandwidth measured in this run. Every method runs from a CUDA graph holding R calls over R different
   random input copies (R x KV bytes >= ~4x L2), so the numbers are per call with a cold L2.
"""

import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ddtree.bench.cuda_timing import time_graph  # noqa: E402
from ddtree.bench.round_timing import copy_bandwidth  # noqa: E402
from ddtree.kernels.tree_attention.launch import paged_attention_plan  # noqa: E402
from ddtree.kernels.tree_attention.reference import paged_attention_reference  # noqa: E402
from ddtree.kernels.tree_attention.tuning import (  # noqa: E402
    KernelConfig,
    default_config,
    wide_head_candidates,
)

HQ, HKV, D, PAGE, DT = 32, 8, 128, 16, torch.bfloat16
DEV = torch.device("cuda")
T0 = time.time()
# seconds since start after which the sweep / Flex are skipped
SWEEP_BUDGET_S = float(os.environ.get("SWEEP_BUDGET_S", 190))
FLEX_BUDGET_S = float(os.environ.get("FLEX_BUDGET_S", 150))
# Flex compiles slowly: few points
FLEX_POINTS = os.environ.get("FLEX_POINTS", "b1 n65 16k").split(",")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def cold_copies(kv_bytes: int) -> int:
    """Random input copies a CUDA graph cycles through so that they exceed the 60 MB L2 about 4x (2 to 64)."""
    return int(min(64, max(2, math.ceil(4 * 60e6 / kv_bytes))))


def save_json(name: str, obj) -> None:
    """Write a benchmark's results to $OUT/name (the device run's folder that comes back), or ./out/name."""
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, indent=1)


def bandwidths():
    """Device memory bandwidth, several ways (bytes read + written per second for copies; read only for `read`).
    The old script timed `y.copy_(x)` inside a CUDA graph: a memcpy node, which may run on the copy engines
    rather than the SMs (2.72 TB/s in that run against 4.1-4.3 TB/s seen elsewhere on this card). The floor uses
    the best copy figure; the kernel reads KV through the SMs, so the SM copy is the apt one."""
    x = torch.randn(2**29, dtype=DT, device=DEV)  # 1 GiB each, ~17x the 60 MB L2
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    out = {
        "memcpy_eager": copy_bandwidth(DEV, nbytes, reps=12)["bandwidth_Bps"]
    }  # the rounds benchmark's probe
    out["memcpy_graph"] = 2 * nbytes / time_graph(lambda: y.copy_(x), 1, reps=20)
    out["sm_copy_graph"] = 2 * nbytes / time_graph(lambda: torch.mul(x, 1.0, out=y), 1, reps=20)
    acc = torch.empty((), dtype=torch.float32, device=DEV)
    out["read_graph"] = nbytes / time_graph(
        lambda: acc.copy_(x.sum(dtype=torch.float32)), 1, reps=20
    )
    return out  # x, y freed on return (the caller empties the cache)


def matmul_rate():
    a = torch.randn(8192, 8192, dtype=DT, device=DEV)
    b = torch.randn(8192, 8192, dtype=DT, device=DEV)
    return 2 * 8192**3 / time_graph(lambda: a @ b, 1, reps=10)


def random_tree_masks(b, n, gen):
    """Random parent arrays (parent < child) -> ancestors-and-self masks [b, n, n] bool."""
    masks = torch.zeros(b, n, n, dtype=torch.bool)
    for i in range(b):
        m = torch.eye(n, dtype=torch.bool)
        for c in range(1, n):
            m[c] |= m[int(torch.randint(0, c, (1,), generator=gen))]
        masks[i] = m
    return masks.to(DEV)


class Problem:
    """R random copies of a batch: paged pools (pages scattered), block tables, q, masks; dense K/V views."""

    def __init__(self, q_lens, kv_lens, copies, page=PAGE, tree=True, dense=False, seed=0):
        gen = torch.Generator().manual_seed(seed)
        b = len(q_lens)
        self.q_lens, self.kv_lens, self.R, self.page = q_lens, kv_lens, copies, page
        pages = [-(-kv // page) for kv in kv_lens]
        per_copy = sum(pages)
        total = per_copy * copies + 4
        self.k_pool = torch.randn(total * page, HKV, D, dtype=DT, device=DEV)
        self.v_pool = torch.randn(total * page, HKV, D, dtype=DT, device=DEV)
        perm = torch.randperm(total, generator=gen).to(DEV)
        self.tables = []
        for r in range(copies):
            bt = torch.zeros(b, max(pages) + 1, dtype=torch.int64, device=DEV)
            o = r * per_copy
            for i, p in enumerate(pages):
                bt[i, :p] = perm[o : o + p]
                o += p
            self.tables.append(bt)
        self.qs = [torch.randn(sum(q_lens), HQ, D, dtype=DT, device=DEV) for _ in range(copies)]
        self.indptr = torch.tensor([0] + q_lens, device=DEV).cumsum(0)
        self.kv_t = torch.tensor(kv_lens, device=DEV)
        self.mask = random_tree_masks(b, max(q_lens), gen) if tree else None
        self.scale = D**-0.5
        self.kv_bytes = sum(kv_lens) * HKV * D * 2 * 2
        if dense:  # equal lengths only: [b, H, L, D] copies for SDPA / Flex
            L, n = kv_lens[0], q_lens[0]
            self.dk, self.dv = [], []
            for bt in self.tables:
                slots = (
                    bt[:, torch.arange(L, device=DEV) // page] * page
                    + torch.arange(L, device=DEV) % page
                )
                self.dk.append(self.k_pool[slots].transpose(1, 2).contiguous())
                self.dv.append(self.v_pool[slots].transpose(1, 2).contiguous())
            self.dq = [q.view(b, n, HQ, D).transpose(1, 2).contiguous() for q in self.qs]
            full = torch.ones(b, n, L, dtype=torch.bool, device=DEV)
            if tree:
                full[:, :, L - n :] = self.mask
            self.dense_mask = full[:, None]

    def ours_plan(self, r, **kw):
        """(output, the dispatch.LaunchPlan that ran) of our kernel on copy r."""
        kw.setdefault("tree_mask", self.mask)
        return paged_attention_plan(
            self.qs[r],
            self.k_pool,
            self.v_pool,
            self.tables[r],
            self.indptr,
            self.kv_t,
            self.page,
            self.scale,
            max_q_len=max(self.q_lens),
            max_kv_len=max(self.kv_lens),
            **kw,
        )

    def ours(self, r, **kw):
        return self.ours_plan(r, **kw)[0]

    def reference(self, r):
        return paged_attention_reference(
            self.qs[r].float(),
            self.k_pool,
            self.v_pool,
            self.tables[r],
            self.indptr,
            self.kv_t,
            self.page,
            self.scale,
            tree_mask=self.mask,
        )


# --shape: (query heads, KV heads, head dim) of the target's attention layers
SHAPES = {"qwen3-8b": (32, 8, 128), "qwen3.6-27b": (24, 4, 256)}
POINTS_WIDE_HEAD = [
    ("b1 n65 1k", 1, 65, 1024, True),
    ("b8 n65 1k", 8, 65, 1024, True),
    ("b1 n16 1k (DFLASH)", 1, 16, 1024, True),
    ("b1 n1 1k (AR)", 1, 1, 1024, True),
    ("b1 n65 16k", 1, 65, 16384, True),
]  # the 27B rounds' points (issue 19): its gated attention at head dim 256
POINTS = [
    ("b1 n65 16k", 1, 65, 16384, True),
    ("b1 n65 1k", 1, 65, 1024, True),
    ("b1 n65 4k", 1, 65, 4096, True),
    ("b1 n65 32k", 1, 65, 32768, True),
    ("b8 n65 8k", 8, 65, 8192, True),
    ("b1 n1 16k (AR)", 1, 1, 16384, True),
    ("b1 n64 16k (diag: 256 rows)", 1, 64, 16384, False),
    ("b1 n16 16k (diag: 64 rows)", 1, 16, 16384, False),
]  # (name, b, nodes, context, full sweep + SDPA/Flex)


def short(c):
    if c is None:
        return "default"
    return (
        f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}t{c.tail_m}tn{c.tree_n}"
        f"{'T' if c.tail_split else 'S'}"
        f"{f'c{c.combine_warps}' if c.combine_warps != 1 else ''}"
    )
    # T: tail split (masked tiles in their own split); S: not; cN: N warps in the split-merging kernel


def sweep_configs(rows, head_dim=128):
    """Candidate configs for `rows` (q tokens x GQA group) per request. sm_90 compile reports of each are in
    studies/tree_attention_compile_report.py (registers, spills, programs per SM); head dim 256:
    `tuning.wide_head_candidates`."""
    if head_dim > 128:
        return wide_head_candidates(rows)
    if rows <= 16:
        return [
            KernelConfig(16, 128, 4, 5, tail_split=False),
            KernelConfig(16, 128, 4, 5),
            KernelConfig(16, 64, 4, 5, tail_split=False),
            KernelConfig(16, 64, 4, 3),
        ]
    return [
        KernelConfig(64, 64, 4, 5),  # default: 5 stages keep 2-3 K/V tiles in flight; 2 programs/SM
        KernelConfig(64, 32, 4, 5),  # 3 programs/SM
        KernelConfig(64, 64, 4, 3),  # the previous session's defaults: 1 K/V tile in flight
        KernelConfig(64, 32, 4, 3),
        KernelConfig(128, 64, 8, 5),  # 3 row blocks per KV head instead of 5
        KernelConfig(64, 128, 8, 5),  # 128-wide tiles: half the steps, 1 program/SM
    ]


def flex_fn(p):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, n, L = len(p.q_lens), p.q_lens[0], p.kv_lens[0]
    ctx, tm = L - n, p.mask
    block_mask = None
    if n > 1:

        def mask_mod(bi, h, qi, ki):
            return (ki < ctx) | tm[bi, qi, (ki - ctx).clamp(min=0)]

        block_mask = create_block_mask(mask_mod, B=b, H=None, Q_LEN=n, KV_LEN=L, device=DEV)
    for knob in (
        "cache_size_limit",
        "recompile_limit",
    ):  # one compile per point shape and mask closure
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    flex = torch.compile(flex_attention, dynamic=False)

    def run():
        for r in range(p.R):
            flex(
                p.dq[r],
                p.dk[r],
                p.dv[r],
                block_mask=block_mask,
                scale=p.scale,
                enable_gqa=True,
                kernel_options={"BACKEND": "TRITON"},
            )

    return run


def sdpa_fn(p):
    n = p.q_lens[0]

    def run():
        for r in range(p.R):
            F.scaled_dot_product_attention(
                p.dq[r],
                p.dk[r],
                p.dv[r],
                attn_mask=p.dense_mask if n > 1 else None,
                scale=p.scale,
                enable_gqa=True,
            )

    return run


def kernel_times(p, cfg):
    """Device time per call of each kernel of one attention call (torch.profiler over all R input copies):
    how the time splits between the split-KV kernel and the combine."""
    from torch.profiler import ProfilerActivity, profile

    for r in range(p.R):
        p.ours(r, config=cfg)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for r in range(p.R):
            p.ours(r, config=cfg)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.count:
            out[e.key[:40]] = t / e.count
    return out


def bench_point(name, b, n, ctx, bw, mma, results, full=True):
    """Times the default and every sweep config (heuristic split count), then split counts around the
    two fastest; SDPA (and Flex at FLEX_POINTS) when `full`."""
    L = ctx + n
    kv_bytes = b * L * HKV * D * 4
    p = Problem([n] * b, [L] * b, cold_copies(kv_bytes), tree=n > 1, dense=full, seed=ctx + b + n)
    R = p.R
    floor = kv_bytes / bw
    ref = p.reference(0)
    rows = n * (HQ // HKV)
    res = {
        "point": name,
        "b": b,
        "n": n,
        "ctx": ctx,
        "kv_mb": kv_bytes / 1e6,
        "floor_us": floor * 1e6,
        "copies": R,
        "variants": [],
    }
    c0 = default_config(rows, D, L)
    configs = sweep_configs(rows, D)
    res["mma_floor_us"] = 4 * b * rows * HKV * L * D / mma * 1e6  # unpadded rows

    def run(label, cfg, splits, **kw):
        ablation = bool(kw)
        if cfg is not None:
            kw["hopper_ctx"] = (
                False  # the sweep tunes the Triton kernel (gpu_tree_attention_hopper.py: Gluon)
            )
        try:
            out, plan = p.ours_plan(0, config=cfg, num_splits=splits, **kw)
            err = (
                rel(out, ref) if not ablation else float("nan")
            )  # ablations compute another function
            t = time_graph(
                lambda: [p.ours(r, config=cfg, num_splits=splits, **kw) for r in range(R)], R
            )
        except Exception as e:  # noqa: BLE001 - a config that fails to compile (shared memory) is skipped
            print(f"    {label}: {type(e).__name__}: {str(e)[:160]}")
            return None
        v = {
            "label": label,
            "config": short(plan.config),
            "splits": plan.num_splits,
            "us": t * 1e6,
            "x": t / floor,
            "rel_err": err,
            "kernel": plan.kernel,
        }
        res["variants"].append(v)
        bad = "" if err != err or err < 2e-2 else "  WRONG"
        print(
            f"    {label:<8} {v['config']:<24} s={v['splits']:<3} {v['kernel']:<6}  {v['us']:8.1f} us  "
            f"{v['x']:5.2f}x floor  rel {err:.1e}{bad}",
            flush=True,
        )
        return v

    print(
        f"  {name}: KV {kv_bytes / 1e6:.1f} MB, floor {floor * 1e6:.1f} us, MMA floor "
        f"{res['mma_floor_us']:.1f} us, {R} copies",
        flush=True,
    )
    res["default"] = run("default", None, None)
    if full:
        try:
            res["kernels_us"] = kernel_times(p, None)
            print(
                "    kernels (profiler, us per call): "
                + ", ".join(f"{k} {v:.1f}" for k, v in res["kernels_us"].items()),
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - the breakdown is a diagnostic
            print(f"    profiler failed: {type(e).__name__}: {str(e)[:160]}")
    for cfg in configs:
        if time.time() - T0 > SWEEP_BUDGET_S:
            print("    (sweep budget spent)")
            break
        if cfg != c0:
            run("sweep", cfg, None)
    good = [v for v in res["variants"] if not v["rel_err"] >= 2e-2]
    if full and good and time.time() - T0 < SWEEP_BUDGET_S:
        tiles = -(-L // 32)
        top = []
        for v in sorted(good, key=lambda v: v["us"]):
            if v["config"] not in top:
                top.append(v["config"])
        by_name = {short(c): c for c in [c0] + configs}
        for cfg in [by_name[t] for t in top[:2] if t in by_name]:
            s0 = next(v["splits"] for v in good if v["config"] == short(cfg))
            cands = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, s0 - 1, s0 + 1, 2 * s0})
            for s in [
                s for s in cands if s >= 1 and s != s0 and s0 / 3 <= s <= 3 * s0 + 1 and s <= tiles
            ] + ([1] if s0 > 3 else []):
                if time.time() - T0 > SWEEP_BUDGET_S:
                    break
                run("splits", cfg, s)
    if full:  # the split-merging kernel's warps, on the default config
        for w in (2, 4):
            if time.time() - T0 < SWEEP_BUDGET_S:
                run("combine", dataclasses.replace(c0, combine_warps=w), None)
    if n > 1 and name.startswith("b1 n65 16k"):  # ablation: the same shape with no tree mask at all
        res["nomask"] = run("no-mask", None, None, tree_mask=None, causal=False)
    good = [v for v in res["variants"] if v["label"] != "no-mask" and not v["rel_err"] >= 2e-2]
    if good:
        best = min(good, key=lambda v: v["us"])
        res["best"] = best
        print(
            f"  WINNER {name}: {best['config']} splits={best['splits']}  {best['us']:.1f} us "
            f"({best['x']:.2f}x floor; default {res['default']['us'] if res['default'] else float('nan'):.1f})",
            flush=True,
        )
    if full:
        for label, make in (("sdpa", sdpa_fn), ("flex", flex_fn)):
            if label == "flex" and (name not in FLEX_POINTS or time.time() - T0 > FLEX_BUDGET_S):
                continue
            try:
                tm = time_graph(make(p), R)
                res[label] = {"us": tm * 1e6, "x": tm / floor}
                print(f"    {label:<8} {tm * 1e6:8.1f} us  {tm / floor:5.2f}x floor", flush=True)
            except Exception as e:  # noqa: BLE001
                res[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"    {label} failed: {res[f'{label}_error']}")
    results.append(res)


def fmt(v):
    return "n/a" if not v else f"{v['us']:.1f} ({v['x']:.2f}x)"


def target_us(name, floor_us):
    if name.startswith("b1 n1 "):
        return 1.5 * floor_us
    if name.startswith("b1 n65 1k"):
        return 4 + 2 * floor_us
    return 2 * floor_us


def main():
    global HQ, HKV, D, POINTS
    import argparse

    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    shape = ap.parse_args().shape
    HQ, HKV, D = SHAPES[shape]  # module globals: Problem and bench_point read them
    if shape != "qwen3-8b":
        POINTS = POINTS_WIDE_HEAD
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEV)
    print(
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}; {shape}: "
        f"{HQ} query heads, {HKV} KV heads, head dim {D}"
    )
    bws, mma = bandwidths(), matmul_rate()
    torch.cuda.empty_cache()
    bw = max(bws["memcpy_eager"], bws["memcpy_graph"], bws["sm_copy_graph"])
    print(
        "bandwidth TB/s: "
        + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in bws.items())
        + f"; floor uses {bw / 1e12:.2f} (best copy, read+write); bf16 matmul {mma / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    results = []
    for name, b, n, ctx, full in POINTS:
        bench_point(name, b, n, ctx, bw, mma, results, full=full)
        torch.cuda.empty_cache()
    print(
        "\n| point | KV floor us | target us | default | best: config, splits | SDPA | Flex | meets target |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        best = r.get("best")
        tgt = target_us(r["point"], r["floor_us"])
        print(
            f"| {r['point']} | {r['floor_us']:.1f} | {tgt:.1f} | {fmt(r.get('default'))} | "
            f"{fmt(best)} {best['config'] if best else ''} s={best['splits'] if best else ''} | "
            f"{fmt(r.get('sdpa'))} | {fmt(r.get('flex'))} | "
            f"{'yes' if best and best['us'] <= tgt else 'no'} |"
        )
    print("\nwins per config (shapes where it is within 3% of the best):")
    for cfg in sweep_configs(260, D) + sweep_configs(4, D):
        wins = [
            r["point"]
            for r in results
            if r.get("best")
            and any(
                v["config"] == short(cfg) and v["us"] <= 1.03 * r["best"]["us"]
                for v in r["variants"]
                if not v["rel_err"] >= 2e-2
            )
        ]
        if wins:
            print(f"  {short(cfg)}: {', '.join(wins)}")
    print(f"total {time.time() - T0:.0f} s")
    save_json(
        f"gpu_tree_attention{'' if shape == 'qwen3-8b' else '_' + shape}.json",
        {
            "device": props.name,
            "bandwidths": bws,
            "copy_bw": bw,
            "matmul_flops": mma,
            "points": results,
        },
    )


if __name__ == "__main__":
    main()
