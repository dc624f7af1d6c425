"""Block-FP8 GEMMs on the GPU (ddtree/kernels/fp8) at the Qwen3-8B and Qwen3.6-27B weight shapes:
correctness against the PyTorch reference, then time per call against bf16 F.linear, with the weight
floor (FP8 weight bytes / the copy bandwidth measured in the same run).

    python3 studies/gpu_fp8_gemm.py [--rows 1,16,64,128,520,1040] [--shapes 8b,27b] [--sweep] [--out F]

Each variant is timed as the median replay of a CUDA graph of calls over rotating weight copies (at
least 256 MB of weights, so a small GEMM reads its weight from HBM, not the 60 MB L2), divided by the
calls. Variants: `bf16` (F.linear), `cublas` (group-quant kernel + torch._scaled_mm with 1x128 /
128x128 block scales), `triton` (group-quant kernel + the Triton GEMM) at the tuning table's tiles
without split-K, `split` the same with the split `tuning.auto_split` picks on this device (decode
rows; the engine never splits), or
with --sweep every candidate tile and split (the best is reported with its tiles), and `auto`: what
the engine's dispatch (`kernels.fp8.linear`) picks, timed through it. Errors: ||y - ref|| / ||ref|| against the
reference (dequantized operands, float32 matmul); bf16's against the bf16 weights' fp32 product.
`quant_exact`: the group-quant kernel's fp8 values and scales == the reference's, bit for bit. A
short table at the end; the JSON has everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ddtree.bench.round_timing import copy_bandwidth  # noqa: E402
from ddtree.kernels import fp8  # noqa: E402
from ddtree.kernels.fp8 import reference as R  # noqa: E402
from ddtree.kernels.fp8 import triton as T  # noqa: E402
from ddtree.kernels.fp8.tuning import GemmConfig, auto_split, gemm_config, sm_count  # noqa: E402

SHAPES = {  # name -> (N, K): the decoder linears (fused as the engine runs them)
    "8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (24576, 4096),
        "down": (4096, 12288),
    },
    "27b": {
        "qkv": (14336, 5120),
        "o|out": (5120, 6144),
        "qkvz": (16384, 5120),
        "gate_up": (34816, 5120),
        "down": (5120, 17408),
    },
}
SWEEP = {  # the candidates of tuning.py's table (its docstring has the 2026-12 sweep)
    16: [GemmConfig(16, 32, 4, 4), GemmConfig(16, 64, 4, 4), GemmConfig(16, 128, 4, 4)]
    + [GemmConfig(16, bn, 4, 4, split_k=k) for bn in (32, 64) for k in (2, 3, 4, 6, 8)],
    64: [GemmConfig(32, 64, 4, 4), GemmConfig(64, 64, 4, 4), GemmConfig(64, 128, 4, 4)],
    128: [GemmConfig(64, 64, 4, 4), GemmConfig(64, 128, 4, 4), GemmConfig(128, 128, 8, 3)],
    1 << 30: [GemmConfig(64, 128, 4, 4), GemmConfig(128, 128, 8, 3), GemmConfig(128, 128, 4, 4)],
}
ROTATE_BYTES = 256 << 20


def time_calls(fns, reps: int = 10) -> float:
    """Median seconds per call over CUDA-graph replays of all `fns` in turn."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / len(fns))
    del g
    return sorted(ts)[len(ts) // 2]


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep_for(m: int):
    return next(c for lim, c in SWEEP.items() if m <= lim)


def bench_shape(name, N, K, rows, sweep, bw, gen, log):
    dev = "cuda"
    w = (0.02 * torch.randn(N, K, generator=gen, device=dev)).to(torch.bfloat16)
    wq, ws = R.quantize_weight(w, (128, 128))
    fp8_bytes = wq.numel() + ws.numel() * 4
    copies = max(1, min(16, ROTATE_BYTES // fp8_bytes))
    wqs = [wq.clone() for _ in range(copies)]
    wss = [ws.clone() for _ in range(copies)]
    scale_t = fp8.cublas_scale(ws)
    w16 = [w.clone() for _ in range(max(1, min(16, ROTATE_BYTES // (2 * w.numel()))))]
    wdq = R.dequantize(wq, ws, 128, 128)
    out = []
    for m in rows:
        x = torch.randn(m, K, generator=gen, device=dev).to(torch.bfloat16)
        xq, xs = R.group_quant(x, 128)
        ref = F.linear(R.dequantize(xq, xs, 1, 128), wdq)
        ref16 = F.linear(x.float(), w.float())
        row = {"shape": name, "N": N, "K": K, "rows": m, "fp8_weight_bytes": fp8_bytes}
        row["floor_us"] = fp8_bytes / bw * 1e6
        row["bf16_floor_us"] = 2 * w.numel() / bw * 1e6
        q, s = T.group_quant(x, 128)
        row["quant_exact"] = bool(
            torch.equal(q.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(s, xs)
        )
        row["bf16_err"] = rel(F.linear(x, w), ref16)
        row["bf16_us"] = 1e6 * time_calls(
            [lambda i=i: F.linear(x, w16[i]) for i in range(len(w16))]
        )
        # cuBLAS block-scaled
        try:
            mp = -(-m // 4) * 4
            qq, ss = T.group_quant(x, 128, rows=mp, column_major=True)
            y = torch._scaled_mm(qq, wq.t(), ss, scale_t, out_dtype=torch.bfloat16)[:m]
            row["cublas_err"] = rel(y, ref)
            sts = [fp8.cublas_scale(s_) for s_ in wss]

            def cub(i):
                qq, ss = T.group_quant(x, 128, rows=mp, column_major=True)
                return torch._scaled_mm(qq, wqs[i].t(), ss, sts[i], out_dtype=torch.bfloat16)

            row["cublas_us"] = 1e6 * time_calls([lambda i=i: cub(i) for i in range(copies)])
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            row["cublas_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        plain = gemm_config(m, N)  # what the engine runs (never split)
        split_cfg = dataclasses.replace(plain, split_k=auto_split(m, N, K, plain, sm_count(0)))
        configs = [plain] + ([split_cfg] if split_cfg.split_k > 1 else [])
        if sweep:
            configs += [c for c in sweep_for(m) if c not in configs]
        best = None
        for cfg in configs:

            def call(i, cfg=cfg):
                q, s = T.group_quant(x, 128)
                return T.gemm(q, s, wqs[i], wss[i], 128, 128, torch.bfloat16, cfg)

            err = rel(call(0), ref)
            us = 1e6 * time_calls([lambda i=i: call(i) for i in range(copies)])
            row.setdefault("triton_all", []).append(
                {"config": list(cfg.__dict__.values()), "us": us, "err": err}
            )
            if cfg == plain:
                row["triton_us"], row["triton_err"] = us, err
            if cfg == split_cfg:
                row["split_us"], row["split_err"], row["split_k"] = us, err, cfg.split_k
            if best is None or us < best[0]:
                best = (us, cfg, err)
        row["best_us"], row["best_err"] = best[0], best[2]
        row["best_config"] = list(best[1].__dict__.values())
        sts = [fp8.cublas_scale(s_) for s_ in wss]
        row["auto"] = fp8.choose(m, N, K, fp8.cublas_ok(wq, 128, 128))
        row["auto_err"] = rel(fp8.linear(x, wq, ws, 128, 128, scale_t=sts[0]), ref)
        row["auto_us"] = 1e6 * time_calls(
            [
                lambda i=i: fp8.linear(x, wqs[i], wss[i], 128, 128, scale_t=sts[i])
                for i in range(copies)
            ]
        )
        # row independence: row 0 alone vs inside the batch (the same kernels at M=1 and M)
        if m > 1:
            one = fp8.linear(x[:1], wq, ws, 128, 128, scale_t=scale_t)
            row["row0_same_as_alone"] = bool(
                torch.equal(one, fp8.linear(x, wq, ws, 128, 128, scale_t=scale_t)[:1])
            )
        out.append(row)
        log(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--rows", default="1,16,64,128,520,1040")
    ap.add_argument("--shapes", default="8b,27b")
    ap.add_argument("--sweep", action="store_true", help="time every candidate tile")
    ap.add_argument("--out", default=None, help="JSON file")
    ns = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = [int(r) for r in ns.rows.split(",")]
    props = torch.cuda.get_device_properties(0)
    info = {
        "device": props.name,
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    bw = copy_bandwidth("cuda")["bandwidth_Bps"]
    info["copy_bandwidth_TBps"] = bw / 1e12
    print(json.dumps(info), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    results = []

    def log(r):
        keys = ("bf16_us", "cublas_us", "triton_us", "split_us", "best_us", "auto_us", "floor_us")
        errs = " ".join(
            f"{k[:-4]} {r[k]:.1e}"
            for k in ("bf16_err", "cublas_err", "triton_err", "split_err", "auto_err")
            if k in r
        )
        print(
            f"{r['shape']:>12} M={r['rows']:>5} "
            + " ".join(f"{k[:-3]}={r[k]:.1f}" for k in keys if k in r)
            + f" auto={r['auto']} err({errs}) quant_exact={r['quant_exact']}"
            + (f" cublas_error={r['cublas_error']}" if "cublas_error" in r else ""),
            flush=True,
        )

    for shape in ns.shapes.split(","):
        for name, (N, K) in SHAPES[shape].items():
            results += bench_shape(f"{shape}:{name}", N, K, rows, ns.sweep, bw, gen, log)
    info["seconds"] = time.time() - t0
    print(
        "\nper call, us: triton = the table's tiles unsplit, split = with split-K auto's runs (k), best"
        " = the fastest Triton config tried (--sweep: every candidate), auto = the engine's dispatch"
        " (its backend named); x = bf16 / auto"
    )
    cols = ("bf16_us", "cublas_us", "triton_us", "split_us", "best_us", "auto_us", "floor_us")
    print(f"{'shape':>12} {'M':>5} " + " ".join(f"{c[:-3]:>8}" for c in cols) + "  k   auto      x")
    for r in results:
        print(
            f"{r['shape']:>12} {r['rows']:>5} "
            + " ".join(f"{r.get(c, float('nan')):>8.1f}" for c in cols)
            + f" {r.get('split_k', 1):>2} {r['auto']:>7} {r['bf16_us'] / r['auto_us']:>6.2f}"
        )
        if r.get("best_config") and r["best_us"] < min(r.get("split_us", 1e9), r["triton_us"]):
            print(f"{'':>19}best: {r['best_config']}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
