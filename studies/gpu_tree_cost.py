#!/usr/bin/env python3
"""What a tree round costs beyond a chain round (issue 43), on the GPU, in one process: per kernel
family and per phase, DDTREE against DFLASH on the same random pair, plus the GEMMs alone at the
rows each verify runs and the no_buffer GDN tree kernel alone.

    python3 studies/gpu_tree_cost.py --shape qwen3.6-27b \
        --cases DFLASH:0:1,DDTREE:64:1,DDTREE:64:1@DDTREE_DISABLE=pdl \
        --gemm-rows 16,65,128,136,264 --gdn --json $OUT/tree_cost.json

A case is ALGO:budget:batch[:context][@VAR=VALUE[+VAR=VALUE...]] (no_buffer, CUDA graphs, the
Triton backend, 1k context by default; after @ environment switches for that case only). Per case:
wall ms per round (CUDA events over --rounds rounds after 5 warm-up rounds), then torch.profiler
over as many rounds: GPU busy ms, launches, each kernel family's ms and launches, and the GPU idle
before each family's kernels (the launch gaps: a gap over 20 us is counted as a host wait); the
round clock's device phases (plan / draft / verify / commit, engine/round/clock.py) and the idle
between rounds. Each case after the first of a shape is also printed as a difference to the
first (put the chain first). --gemm-rows: the target's projections and LM head at those rows, one
CUDA graph (`gemm_chain`). --gdn: one GDN layer's no_buffer tree verify at the 27B head shape (Hk
16, Hv 48, dk = dv = 128), CUDA-graph us, checked against the PyTorch reference: the kernel with the
gate inside and the overlapped outputs, the pre-issue-43 form (separate gating launch, outputs after
the solve), and launch variants. Several --shape runs go one after another in one process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ddtree.bench.cuda_timing import time_graph
from ddtree.bench.random_pair import build_pair, read_bytes, shape_configs
from ddtree.bench.rounds import measure_floor, prefilled_requests, runner_config
from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.round.decoder import SpecConfig, SpecDecoder

FAMILIES = (  # (family, name pattern): the first match wins
    ("gemm", r"nvjet|gemm|cutlass|splitKreduce|cublas|sm90_xmma"),
    ("gdn solve", r"_solve_kernel"),
    ("gdn output", r"_output_kernel"),
    ("gdn gating", r"_gating_kernel"),
    ("gdn conv", r"_tree_conv_kernel"),
    ("gdn norm", r"_gated_rmsnorm_kernel"),
    ("gdn commit", r"_replay_ssm_kernel|_commit"),
    ("gdn other", r"_decode_kernel|_tree_gdn_kernel"),
    ("attention", r"split_kv_attn|combine|_attn|hopper|_tree_attn|gluon"),
    ("norm/act", r"_add_rmsnorm|_silu_mul|_qk_norm_rope|_sigmoid_gate|_rmsnorm"),
    ("tree build", r"_tree_build|topk|TopK|DigitCounts|radix|sort|cumsum|Scan"),
    ("reduce", r"reduce_kernel|argmax|ArgMax|logsumexp"),
    ("copy/index", r"Memcpy|Memset|copy|index|scatter|gather|fill|where|cat"),
)
HOST_GAP_US = 20.0  # an idle gap longer than this before a kernel: the GPU waited for the host


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name):
            return fam
    return "other"


def kernel_events(prof, device_type: str = "CUDA") -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel / memcpy / memset, in start order (--smoke: the
    CPU ops instead, nested ones too: only the code path is exercised)."""
    out = []
    for e in prof.events():
        if e.device_type.name != device_type:
            continue
        tr = e.time_range
        out.append((e.name, tr.start, tr.end))
    return sorted(out, key=lambda x: x[1])


def summarize(events, rounds: int) -> dict:
    """Per kernel name and per family: ms per round, launches per round, idle ms before them."""
    names: dict[str, list[float]] = {}
    prev_end = None
    host_gap = 0.0
    for name, t0, t1 in events:
        gap = 0.0 if prev_end is None else max(0.0, t0 - prev_end)
        if gap > HOST_GAP_US:
            host_gap += gap
            gap_small = 0.0
        else:
            gap_small = gap
        rec = names.setdefault(name, [0.0, 0, 0.0])
        rec[0] += t1 - t0
        rec[1] += 1
        rec[2] += gap_small
        prev_end = t1 if prev_end is None else max(prev_end, t1)
    per = {n: dict(ms=v[0] / 1e3 / rounds, n=v[1] / rounds, gap_ms=v[2] / 1e3 / rounds)
           for n, v in names.items()}  # fmt: skip
    fams: dict[str, dict] = {}
    for n, v in per.items():
        f = fams.setdefault(family(n), dict(ms=0.0, n=0.0, gap_ms=0.0))
        for k in f:
            f[k] += v[k]
    return dict(kernels=per, families=fams, host_gap_ms=host_gap / 1e3 / rounds)


def profile_case(target, drafter, algo, budget, batch, context, rounds, dev):
    ns = SimpleNamespace(
        block_size=16, page_size=16, attention_backend="triton", disable_cuda_graph=False,
        mamba_strategy="no_buffer",
    )  # fmt: skip
    cfg = runner_config(algo, budget, batch, context, ns, dev)
    dtype = next(target.parameters()).dtype
    runner = ModelRunner(target, drafter if algo != "NONE" else None, cfg, dev, dtype)
    reqs = prefilled_requests(runner, batch, context, target.config.vocab_size, 4096, 0)
    dec = SpecDecoder(runner, SpecConfig(algo, 16, budget, budget, algo == "DDTREE"))
    recs = []

    def one_round():
        out = dec.round(reqs, cfg.max_context)
        t = dec.budgets.last.timing
        recs.append((t.device_s, t.idle_s, dict(t.device_phases or {})))
        for r, toks in zip(reqs, out):
            r.kv_len = context
            runner.release(r, context)
            r.output_ids[-1] = toks[-1]

    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(5):
        one_round()
    sync()
    recs.clear()
    t0 = time.perf_counter()
    if cuda:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
    for _ in range(rounds):
        one_round()
    if cuda:
        e1.record()
    sync()
    wall = e0.elapsed_time(e1) / rounds if cuda else (time.perf_counter() - t0) * 1e3 / rounds
    phases = {}
    if recs and recs[0][2]:
        for p in recs[0][2]:
            phases[p] = statistics.median(r[2][p] for r in recs) * 1e3
    idle = [r[1] for r in recs if r[1] is not None]
    phases["idle"] = statistics.median(idle) * 1e3 if idle else None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(rounds):
            one_round()
        sync()
    s = summarize(kernel_events(prof, "CUDA" if cuda else "CPU"), rounds)
    busy = sum(v["ms"] for v in s["families"].values())
    launches = sum(v["n"] for v in s["families"].values())
    return dict(wall_ms=wall, busy_ms=busy, launches=launches, phases=phases, **s)


def case_name(algo, budget, batch, context) -> str:
    return f"{algo}{'' if algo == 'NONE' else ' B=' + str(budget)} b{batch} ctx{context}"


def print_case(name, env, rec, floor_ms):
    ph = rec["phases"]
    pstr = " ".join(f"{k} {v:.2f}" for k, v in ph.items() if v is not None)
    print(
        f"\n== {name}{' @' + env if env else ''}: wall {rec['wall_ms']:.3f} ms/round "
        f"({rec['wall_ms'] / floor_ms:.2f}x floor), GPU busy {rec['busy_ms']:.3f}, "
        f"{rec['launches']:.0f} launches, host waits {rec['host_gap_ms']:.3f} ms; phases (ms): {pstr}",
        flush=True,
    )
    fams = sorted(rec["families"].items(), key=lambda kv: -kv[1]["ms"])
    print("   family        ms/round  launches  gap-before ms")
    for f, v in fams:
        print(f"   {f:12s} {v['ms']:9.3f} {v['n']:9.1f} {v['gap_ms']:12.3f}")


def print_diff(base_name, base, name, rec):
    print(f"\n-- {name} minus {base_name}: wall {rec['wall_ms'] - base['wall_ms']:+.3f} ms "
          f"({rec['wall_ms'] / base['wall_ms']:.3f}x), busy {rec['busy_ms'] - base['busy_ms']:+.3f}, "
          f"gaps {(rec['wall_ms'] - rec['busy_ms']) - (base['wall_ms'] - base['busy_ms']):+.3f}")  # fmt: skip
    fams = set(rec["families"]) | set(base["families"])
    zero = dict(ms=0.0, n=0.0, gap_ms=0.0)
    rows = []
    for f in fams:
        a, b = base["families"].get(f, zero), rec["families"].get(f, zero)
        rows.append((b["ms"] - a["ms"], b["gap_ms"] - a["gap_ms"], b["n"] - a["n"], f))
    print("   family        +ms kernel  +ms gaps  +launches")
    for dk, dg, dn, f in sorted(rows, key=lambda r: -(r[0] + r[1])):
        print(f"   {f:12s} {dk:+10.3f} {dg:+9.3f} {dn:+10.1f}")
    ks = set(rec["kernels"]) | set(base["kernels"])
    kd = []
    for k in ks:
        a, b = base["kernels"].get(k, zero), rec["kernels"].get(k, zero)
        kd.append((b["ms"] - a["ms"], a["ms"], b["ms"], a["n"], b["n"], k))
    print("   top kernels by +ms (base ms / this ms, launches):")
    for d, a, b, na, nb, k in sorted(kd, key=lambda r: -abs(r[0]))[:14]:
        print(f"   {d:+8.3f}  {a:7.3f} / {b:7.3f}  ({na:5.1f} / {nb:5.1f})  {k[:90]}")


def gemm_weights(target) -> list[torch.Tensor]:
    """Every weight a verify forward multiplies by, in layer order (GDN: the fused in_proj), + LM head."""
    ws = []
    for layer in target.model.layers:
        if getattr(layer, "linear_attn", None) is not None:
            la = layer.linear_attn
            ws += [la.fused_in_proj(), la.out_proj.weight]
        else:
            a = layer.self_attn
            ws += [a.qkv_proj.weight, a.o_proj.weight]
        ws += [layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    return ws + [target.lm_head.weight]


def gemm_chain(target, rows: list[int], lt: bool = False) -> dict[int, float]:
    """ms of the verify's GEMMs alone at each row count (one CUDA graph on the GPU; inputs random);
    lt: through cuBLASLt (torch.backends.cuda.preferred_blas_library), whose heuristics may pick
    other kernels."""
    ws = gemm_weights(target)
    dev = ws[0].device
    out = {}
    before = torch.backends.cuda.preferred_blas_library() if dev.type == "cuda" else None
    if lt and dev.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        out = _gemm_times(ws, rows, dev)
    finally:
        if before is not None:
            torch.backends.cuda.preferred_blas_library(before)
    return out


def _gemm_times(ws, rows, dev) -> dict[int, float]:
    out = {}
    for m in rows:
        xs = {w.shape[1]: torch.randn(m, w.shape[1], device=dev, dtype=w.dtype) for w in ws}

        def run(xs=xs):
            for w in ws:
                xs[w.shape[1]] @ w.t()

        if dev.type == "cuda":
            out[m] = time_graph(run, reps=10) * 1e3
        else:  # --smoke: the code path
            t0 = time.perf_counter()
            run()
            out[m] = (time.perf_counter() - t0) * 1e3
    return out


def gdn_micro(smoke: bool = False) -> list[dict]:
    """One GDN layer's no_buffer tree verify (27B heads), CUDA-graph us, vs the PyTorch reference
    (--smoke: tiny heads on the CPU, no timing; run with TRITON_INTERPRET=1)."""
    from ddtree.kernels.gdn.fused import gdn_gating
    from ddtree.kernels.gdn.reference import tree_gated_delta_rule
    from ddtree.kernels.gdn.tree_chunk_triton import tree_chunk_triton
    from ddtree.speculative.tree import DraftTree

    HK, HV, D = (2, 4, 16) if smoke else (16, 48, 128)
    dev = "cpu" if smoke else "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def tree(b, n, kind):
        par = torch.full((b, n), -1, dtype=torch.int64)
        g = torch.Generator().manual_seed(n)
        for r in range(b):
            for c in range(1, n):
                if kind == "chain":
                    par[r, c] = c - 1
                else:  # bushy: a parent among the last few nodes, depth <= 15
                    par[r, c] = max(0, c - 1 - int(torch.randint(0, 5, (1,), generator=g)))
        dep = torch.zeros(b, n, dtype=torch.int64)
        for c in range(1, n):
            dep[:, c] = dep.gather(1, par[:, c : c + 1].clamp_min(0))[:, 0] + 1
        return par.to(dev), dep.to(dev)

    # B=64 and the chain at batch 1, B=16 and B=64 at batch 8
    for b, n, kind in ((1, 65, "bushy"), (1, 16, "chain"), (8, 17, "bushy"), (8, 65, "bushy")):
        par, dep = tree(b, n, kind)
        T = b * n
        proj = torch.randn(T, 2 * HK * D + HV * D + 2 * HV, device=dev, generator=gen)
        proj = proj.bfloat16()
        q = proj[:, : HK * D].view(b, n, HK, D)
        k = proj[:, HK * D : 2 * HK * D].view(b, n, HK, D)
        v = proj[:, 2 * HK * D : 2 * HK * D + HV * D].view(b, n, HV, D)
        a, bb = proj[:, -2 * HV : -HV], proj[:, -HV:]
        A_log = torch.rand(HV, device=dev, generator=gen).add(0.1).log()
        dt_bias = torch.randn(HV, device=dev, generator=gen)
        pool = torch.randn(b + 1, HV, D, D, device=dev, generator=gen) * 0.05
        rows_t = torch.arange(b, device=dev)
        mask = DraftTree.from_parents(torch.zeros_like(par), par).tree_mask
        raw = (a, bb, A_log, dt_bias)
        g, beta = gdn_gating(*raw)
        want, _ = tree_gated_delta_rule(
            q.float(), k.float(), v.float(), g.view(b, n, HV), beta.view(b, n, HV).float(), par,
            dep, pool[rows_t],
        )  # fmt: skip
        variants = {  # the launches that do not spill (studies/gdn_tree_chunk_compile_report.py)
            "gate inside, overlapped (default)": dict(gate=raw),
            "separate gating, outputs after the solve (pre-issue-43)": dict(old=True),
            "gate inside, outputs after the solve": dict(gate=raw, early=False),
            "output BV 16": dict(gate=raw, block_v=16),
            "output BV 64, 8 warps": dict(gate=raw, block_v=64, num_warps=8),
            "output 8 warps": dict(gate=raw, num_warps=8),
        }
        for label, kw in variants.items():
            kw = dict(kw)
            old = kw.pop("old", False)

            def fn(kw=kw, old=old):
                if old:
                    gg, bt = gdn_gating(*raw)
                    return tree_chunk_triton(q, k, v, gg.view(b, n, HV), bt.view(b, n, HV), dep,
                                             pool, mask, None, rows_t, early=False)  # fmt: skip
                return tree_chunk_triton(q, k, v, None, None, dep, pool, mask, None, rows_t, **kw)

            try:
                err = ((fn().double() - want.double()).norm() / want.double().norm()).item()
                t = 0.0 if smoke else time_graph(fn, reps=20) * 1e6
            except Exception as e:  # noqa: BLE001 - a variant that does not compile / fit: report
                rows.append(dict(b=b, n=n, kind=kind, variant=label, error=f"{type(e).__name__}"))
                print(f"   b={b} n={n} {kind:5s} {label:55s} failed: {type(e).__name__}: {e}"[:200])
                continue
            rows.append(dict(b=b, n=n, kind=kind, variant=label, us=t, rel_err=err))
            print(f"   b={b} n={n:2d} {kind:5s} {label:55s} {t:8.1f} us  rel err {err:.1e}",
                  flush=True)  # fmt: skip
    return rows


def run_shape(shape, cases, ns, deadline, out):
    dev = torch.device("cpu" if ns.smoke else "cuda")
    dtype = torch.float32 if ns.smoke else torch.bfloat16
    tcfg, dcfg = shape_configs(shape, 5, 16, str(dtype).removeprefix("torch."), ns.smoke)
    target, drafter = build_pair(tcfg, dcfg, dev, dtype, 0)
    if ns.smoke:
        fl, bw = 1.0, 1e12
    else:
        floor = measure_floor(target, drafter, dev, 2048 << 20)
        fl, bw = floor["floor_ms"], floor["bandwidth_Bps"]
    print(f"\n#### {shape}: floor {fl:.3f} ms ({read_bytes(target) / 1e9:.2f} GB at {bw / 1e12:.2f} "
          f"TB/s)", flush=True)  # fmt: skip
    res = out.setdefault(shape, dict(floor_ms=fl, cases=[], gemm={}))
    if ns.gemm_rows:
        rows = [int(x) for x in ns.gemm_rows.split(",")]
        gm = gemm_chain(target, rows)
        lt = gemm_chain(target, [int(x) for x in ns.gemm_lt_rows.split(",") if x])
        res["gemm"], res["gemm_cublaslt"] = gm, lt
        base = next(iter(gm.values()))
        print("GEMMs alone (every projection + LM head, one CUDA graph; cuBLASLt where asked):")
        for m, ms in gm.items():
            extra = f"   cuBLASLt {lt[m]:7.3f} ms" if m in lt else ""
            print(f"   rows {m:4d}: {ms:7.3f} ms  ({ms / base:.3f}x rows {rows[0]}, "
                  f"{ms / fl:.2f}x floor){extra}")  # fmt: skip
    first = {}
    for case in re.split(r",(?=(?:NONE|DFLASH|DDTREE):)", cases):
        if time.time() > deadline:
            print(f"\n== {case}: skipped (time budget)", flush=True)
            continue
        spec, _, env_part = case.partition("@")
        algo, budget, batch, context = (spec.split(":") + [""])[:4]
        ctx = int(context or 1024)
        env = dict(kv.split("=", 1) for kv in env_part.split("+") if kv)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        t0 = time.time()
        try:
            rec = profile_case(target, drafter, algo, int(budget), int(batch), ctx, ns.rounds, dev)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        name = case_name(algo, int(budget), int(batch), ctx)
        rec.update(name=name, env=env_part, seconds=time.time() - t0)
        res["cases"].append(rec)
        print_case(name, env_part, rec, fl)
        key = (batch, ctx)
        if key in first:
            print_diff(*first[key], name + (" @" + env_part if env_part else ""), rec)
        else:
            first[key] = (name + (" @" + env_part if env_part else ""), rec)
        gc.collect()
    del target, drafter
    gc.collect()
    if not ns.smoke:
        torch.cuda.empty_cache()


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--shape", action="append", help="qwen3.6-27b, qwen3-8b (repeatable)")
    p.add_argument("--cases", action="append", help="one list per --shape (see the docstring)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--gemm-rows", default="")
    p.add_argument("--gemm-lt-rows", default="", help="rows also timed through cuBLASLt")
    p.add_argument("--gdn", action="store_true")
    p.add_argument("--time-budget-s", type=float, default=1e9)
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny hybrid: the code path only")
    ns = p.parse_args(argv)
    deadline = time.time() + ns.time_budget_s
    out: dict = {}
    dev_name = "cpu (smoke)" if ns.smoke else torch.cuda.get_device_name()
    print(f"{dev_name} torch {torch.__version__}", flush=True)
    if ns.gdn:
        print("\nGDN tree verify, one layer (27B heads), CUDA-graph us:")
        out["gdn"] = gdn_micro(ns.smoke)
    for shape, cases in zip(ns.shape or [], ns.cases or []):
        run_shape(shape, cases, ns, deadline, out)
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(out, f, indent=1, default=str)
    print("\n| shape | case | switches | wall ms | x first | busy ms | gaps ms | launches |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, res in out.items():
        if shape == "gdn":
            continue
        base = {}
        for c in res["cases"]:
            key = c["name"].split(" ctx")[0].split(" ")[-1]  # the batch
            b = base.setdefault(key, c["wall_ms"])
            print(f"| {shape} | {c['name']} | {c['env'] or '-'} | {c['wall_ms']:.2f} | "
                  f"{c['wall_ms'] / b:.3f} | {c['busy_ms']:.2f} | {c['wall_ms'] - c['busy_ms']:.2f} | "
                  f"{c['launches']:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
