"""Block-FP8 GEMM libraries on the GPU (issue 58) at the Qwen3-8B and Qwen3.6-27B layer shapes, LM
heads included: per shape and row count, us per call (activation quantization included) and the error
against the PyTorch reference (ddtree/kernels/fp8/reference.py, dequantized operands, float32 matmul).

    python3 studies/gpu_fp8_gemm_libs.py [--rows 1,8,16,64,128,256,520,1040] [--shapes 8b,27b]
        [--out F] [--jobs 12] [--sweep-m 4096]

Variants, each timed as the median replay of a CUDA graph of calls over rotating weight copies (at
least 256 MB of weights, so a small GEMM reads its weight from HBM, not L2), divided by the calls:
- `bf16`: F.linear on the bf16 weight (cuBLAS);
- `auto`: today's engine dispatch (`kernels.fp8.linear`, the backend it picks in the JSON);
- `triton`: the group-quant kernel + the Triton GEMM at tuning.py's tiles (unsplit, as the engine's);
- `cublas`: the group-quant kernel (rows padded to 4, column-major scales) + torch._scaled_mm with
  1x128 / 128x128 block scales (cuBLASLt >= 12.9);
- `deepgemm`: the same quantized activations (DeepGEMM's SM90 layout: MN-major, TMA-aligned fp32
  scales, which is cuBLAS's) + `deep_gemm.fp8_gemm_nt` through kernels/fp8/deepgemm.py (JIT);
- `flashinfer`: `flashinfer.gemm.gemm_fp8_nt_groupwise` where the package imports;
- `quant`: the group-quant kernel alone (the activation quantization cost inside every FP8 variant).
Also per library: `rowinv_bf16` / `rowinv_fp32`: the first rows of a GEMM over M rows equal, bit for
bit, the same rows computed at every other measured row count (one summation order at every row
count: what fp32 AR == speculation needs), and `eq_triton`: the fraction of bf16 outputs equal to
the Triton GEMM's. DeepGEMM's kernels are compiled first by --jobs worker processes (its JIT cache is
shared on disk); `--sweep-m` runs the 8B q|k|v at every row count 1..N after the timings (for at
most --sweep-budget-s) to count the kernels DeepGEMM compiles for them (what an engine warm-up must
cover) and how long that takes. A short table at the end; the JSON has everything.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpu_fp8_gemm import rel, time_calls  # noqa: E402  (the GEMM study beside this one)

from ddtree.kernels import fp8  # noqa: E402
from ddtree.kernels.fp8 import deepgemm as DG  # noqa: E402
from ddtree.kernels.fp8 import reference as R  # noqa: E402
from ddtree.kernels.fp8 import table  # noqa: E402
from ddtree.kernels.fp8 import triton as T  # noqa: E402
from ddtree.kernels.fp8.tuning import gemm_config  # noqa: E402

SHAPES = {  # name -> (N, K): the linears as the engine runs them (fused q|k|v, gate|up)
    "8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (24576, 4096),
        "down": (4096, 12288),
        "lm_head": (151936, 4096),
    },
    "27b": {
        "qkv": (14336, 5120),  # gated attention: q|gate 2 x 24 x 256, k, v 4 x 256
        "o": (5120, 6144),
        "qkvz": (16384, 5120),  # Gated DeltaNet q|k|v|z
        "gate_up": (34816, 5120),
        "down": (5120, 17408),
        "lm_head": (248320, 5120),
    },
}
ROTATE_BYTES = 256 << 20
LIBS = ("triton", "cublas", "deepgemm", "flashinfer")


def probe_libs() -> dict:
    info = {}
    try:
        import deep_gemm

        info["deepgemm"] = {
            "version": getattr(deep_gemm, "__version__", "?"),
            "file": deep_gemm.__file__,
        }
    except Exception as e:  # noqa: BLE001 - reported
        info["deepgemm"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    try:
        import flashinfer

        info["flashinfer"] = {"version": flashinfer.__version__}
    except Exception as e:  # noqa: BLE001 - reported
        info["flashinfer"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    return info


def quant4(x: torch.Tensor):
    """Activations quantized as cuBLAS and DeepGEMM read them: rows padded to 4, scales MN-major."""
    m = x.shape[0]
    return T.group_quant(x, 128, rows=-(-m // 4) * 4, column_major=True)


def make_call(lib: str, x: torch.Tensor, wq, ws, st, out_dtype=torch.bfloat16):
    """A zero-argument call of `lib` on x [m, K] -> [m, N] (quantization included)."""
    m, N = x.shape[0], wq.shape[0]
    if lib == "triton":
        cfg = gemm_config(m, N, exact=out_dtype == torch.float32)

        def f():
            q, s = T.group_quant(x, 128)
            return T.gemm(q, s, wq, ws, 128, 128, out_dtype, cfg)

    elif lib == "cublas":

        def f():
            q, s = quant4(x)
            return torch._scaled_mm(q, wq.t(), s, st, out_dtype=out_dtype)[:m]

    elif lib == "deepgemm":

        def f():
            q, s = quant4(x)
            return DG.gemm(q, s, wq, ws, m, out_dtype)

    elif lib == "flashinfer":
        from flashinfer.gemm import gemm_fp8_nt_groupwise

        def f():
            q, s = quant4(x)
            return gemm_fp8_nt_groupwise(
                q[:m], wq, s[:m], ws, scale_major_mode="MN", out_dtype=out_dtype
            )

    elif lib == "auto":

        def f():
            return fp8.linear(x, wq, ws, 128, 128, scale_t=st)

    else:
        raise ValueError(lib)
    return f


def compile_worker(jobs_json: str) -> int:
    """--compile: run each (N, K, m, dtype) of the list once through DeepGEMM (fills the JIT cache)."""
    import deep_gemm  # noqa: F401

    for N, K, m, dt in json.loads(jobs_json):
        dtype = getattr(torch, dt)
        # the values do not matter for compiling: no quantization of a (maybe 1 GB) weight here
        wq = torch.zeros(N, K, dtype=R.FP8, device="cuda")
        ws = torch.ones(-(-N // 128), -(-K // 128), device="cuda")
        x = torch.randn(m, K, device="cuda").to(dtype)
        try:
            make_call("deepgemm", x, wq, ws, None, dtype)()
        except Exception as e:  # noqa: BLE001 - e.g. an output dtype it refuses: the others go on
            print(f"compile {N}x{K} m={m} {dt}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del wq, ws
    torch.cuda.synchronize()
    return 0


def precompile(shapes, rows, jobs: int) -> dict:
    """DeepGEMM's kernels for every measured (shape, rows), compiled by `jobs` processes."""
    work = [(N, K, m, "bfloat16") for (N, K) in shapes for m in rows]
    parts = [work[i::jobs] for i in range(jobs)]
    t0 = time.time()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--compile", json.dumps(p)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in parts
        if p
    ]
    errors = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode or "Error" in out:
            errors.append(out[-800:])
    return {"seconds": time.time() - t0, "jobs": len(procs), "errors": errors[:2]}


def cache_entries() -> int:
    d = os.environ.get("DG_JIT_CACHE_DIR", os.path.expanduser("~/.deep_gemm"))
    n = 0
    for _root, dirs, files in os.walk(d):
        n += sum(f.endswith((".cubin", ".so")) for f in files)
    return n


def sweep_m(N: int, K: int, top: int, budget_s: float) -> dict:
    """Every row count 1..top through DeepGEMM on one shape, for at most budget_s seconds: kernels
    compiled (cumulative, at marks), seconds, the last row count reached."""
    w = torch.randn(N, K, device="cuda") * 0.02
    wq, ws = R.quantize_weight(w, (128, 128))
    x = torch.randn(top, K, device="cuda").to(torch.bfloat16)
    marks = {}
    before = cache_entries()
    t0 = time.time()
    m = 0
    for m in range(1, top + 1):
        if time.time() - t0 > budget_s:
            break
        make_call("deepgemm", x[:m], wq, ws, None)()
        if m in (16, 64, 128, 256, 520, 1040, 1536, 2048, 4096, 8192):
            torch.cuda.synchronize()
            marks[m] = {"kernels": cache_entries() - before, "seconds": time.time() - t0}
    torch.cuda.synchronize()
    return {
        "N": N,
        "K": K,
        "top": top,
        "reached": m,
        "kernels": cache_entries() - before,
        "marks": marks,
        "seconds": time.time() - t0,
    }


def bench_shape(name, N, K, rows, libs, bw, gen, log):
    dev = "cuda"
    w = (0.02 * torch.randn(N, K, generator=gen, device=dev)).to(torch.bfloat16)
    wq, ws = R.quantize_weight(w, (128, 128))
    fp8_bytes = wq.numel() + ws.numel() * 4
    copies = max(1, min(16, ROTATE_BYTES // fp8_bytes))
    wqs = [wq] + [wq.clone() for _ in range(copies - 1)]
    wss = [ws] + [ws.clone() for _ in range(copies - 1)]
    sts = [fp8.cublas_scale(s_) for s_ in wss]
    w16 = [w] + [w.clone() for _ in range(max(1, min(16, ROTATE_BYTES // (2 * w.numel()))) - 1)]
    wdq = R.dequantize(wq, ws, 128, 128)
    top = max(rows)
    xall = torch.randn(top, K, generator=gen, device=dev)
    out = []
    firsts: dict = {}  # (lib, dtype) -> the first rows' output at the smallest row count
    for m in rows:
        x = xall[:m].to(torch.bfloat16)
        xq, xs = R.group_quant(x, 128)
        ref = F.linear(R.dequantize(xq, xs, 1, 128), wdq)
        row = {"shape": name, "N": N, "K": K, "rows": m, "fp8_weight_bytes": fp8_bytes}
        row["floor_us"] = fp8_bytes / bw * 1e6
        row["bf16_floor_us"] = 2 * w.numel() / bw * 1e6
        row["bf16_err"] = rel(F.linear(x, w), F.linear(x.float(), w.float()))
        row["bf16_us"] = 1e6 * time_calls(
            [lambda i=i: F.linear(x, w16[i]) for i in range(len(w16))]
        )
        row["quant_us"] = 1e6 * time_calls([lambda: quant4(x)] * 4)
        row["auto"] = fp8.choose(
            m,
            N,
            K,
            fp8.cublas_ok(wq, 128, 128),
            deepgemm=DG.takes(wq, 128, 128, torch.bfloat16),
        )
        y_triton = None
        for lib in ("auto",) + libs:
            try:
                y = make_call(lib, x, wq, ws, sts[0])().clone()
                row[f"{lib}_err"] = rel(y, ref)
                if lib == "triton":
                    y_triton = y
                elif y_triton is not None and lib != "auto":
                    row[f"{lib}_eq_triton"] = (y == y_triton).float().mean().item()
                fns = [make_call(lib, x, wqs[i], wss[i], sts[i]) for i in range(copies)]
                row[f"{lib}_us"] = 1e6 * time_calls(fns)
                if lib == "auto":
                    continue
                for dt in (torch.bfloat16, torch.float32):
                    if dt == torch.float32 and lib == "deepgemm":
                        row["deepgemm_fp32"] = "no float32 output (its SM90 kernel writes bf16)"
                        continue
                    xi = xall[:m].to(dt)
                    yi = make_call(lib, xi, wq, ws, sts[0], dt)()
                    key = (lib, str(dt))
                    k = min(rows)
                    if key not in firsts:
                        firsts[key] = yi[:k].clone()
                    same = torch.equal(yi[:k], firsts[key])
                    tag = "rowinv_bf16" if dt == torch.bfloat16 else "rowinv_fp32"
                    row[f"{lib}_{tag}"] = bool(same)
                    if dt == torch.float32:
                        yr = R.block_matmul(
                            *R.group_quant(xi, 128), wq, ws, 128, 128, torch.float32
                        )
                        row[f"{lib}_fp32_err"] = rel(yi, yr)
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                row[f"{lib}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(row)
        log(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--rows", default="1,8,16,64,128,256,520,1040")
    ap.add_argument("--shapes", default="8b,27b")
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--jobs", type=int, default=12, help="DeepGEMM compile processes (0: none)")
    ap.add_argument("--sweep-m", type=int, default=0, help="DeepGEMM at rows 1..N on the 8B qkv")
    ap.add_argument("--sweep-budget-s", type=float, default=60.0)
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--from", dest="src", default=None, help="a run's JSON: no measuring")
    ap.add_argument(
        "--write-table", action="store_true", help="write kernels/fp8/gemm_table.json from the run"
    )
    ap.add_argument("--compile", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.compile is not None:
        return compile_worker(ns.compile)
    if ns.src:
        run = json.loads(pathlib.Path(ns.src).read_text())
        if ns.write_table:
            write_table(run, ns.src)
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = [int(r) for r in ns.rows.split(",")]
    props = torch.cuda.get_device_properties(0)
    info = {
        "device": props.name,
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "libs": probe_libs(),
    }
    from ddtree.bench.round_timing import copy_bandwidth

    bw = copy_bandwidth("cuda")["bandwidth_Bps"]
    info["copy_bandwidth_TBps"] = bw / 1e12
    print(json.dumps(info), flush=True)
    libs = tuple(
        lib
        for lib in ns.libs.split(",")
        if lib in ("triton", "cublas") or "error" not in info["libs"].get(lib, {})
    )
    shapes = [(s, n, nk) for s in ns.shapes.split(",") for n, nk in SHAPES[s].items()]
    if "deepgemm" in libs and ns.jobs:
        shapes_nk = sorted({nk for _, _, nk in shapes})
        info["deepgemm_precompile"] = precompile(shapes_nk, rows, ns.jobs)
        print("deepgemm precompile:", json.dumps(info["deepgemm_precompile"])[:2000], flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    results = []

    def log(r):
        us = " ".join(
            f"{k}={r[k + '_us']:.1f}" for k in ("bf16", "quant", "auto") + libs if k + "_us" in r
        )
        errs = " ".join(f"{k} {r[k + '_err']:.1e}" for k in ("auto",) + libs if k + "_err" in r)
        inv = " ".join(
            f"{k}:{int(r.get(k + '_rowinv_bf16', 0))}{int(r.get(k + '_rowinv_fp32', 0))}"
            for k in libs
        )
        bad = " ".join(
            f"{k}_error={r[k + '_error']}" for k in ("auto",) + libs if k + "_error" in r
        )
        print(
            f"{r['shape']:>12} M={r['rows']:>5} {us} auto={r['auto']} err({errs}) rowinv {inv} {bad}",
            flush=True,
        )

    for shape, name, (N, K) in shapes:
        results += bench_shape(f"{shape}:{name}", N, K, rows, libs, bw, gen, log)
        torch.cuda.empty_cache()
        if ns.out:  # partial results survive a timeout
            with open(ns.out, "w") as f:
                json.dump({"info": info, "results": results}, f, indent=1)
    info["seconds"] = time.time() - t0
    if "deepgemm" in libs and ns.sweep_m:  # after the timings: its compiles would disturb them
        info["deepgemm_sweep_m"] = sweep_m(6144, 4096, ns.sweep_m, ns.sweep_budget_s)
        print("deepgemm sweep:", json.dumps(info["deepgemm_sweep_m"]), flush=True)
    cols = ("bf16",) + libs + ("auto",)
    print(
        "\nus per call (FP8: activation quantization included; quant = it alone); x = bf16 / best FP8"
    )
    print(
        f"{'shape':>14} {'M':>5} "
        + " ".join(f"{c[:8]:>8}" for c in cols)
        + f" {'quant':>6} {'floor':>6}  best      x  xfloor"
    )
    for r in results:
        fp8s = {c: r[c + "_us"] for c in libs if c + "_us" in r}
        best = min(fp8s, key=fp8s.get) if fp8s else "-"
        bx = r["bf16_us"] / fp8s[best] if fp8s else float("nan")
        print(
            f"{r['shape']:>14} {r['rows']:>5} "
            + " ".join(f"{r.get(c + '_us', float('nan')):>8.1f}" for c in cols)
            + f" {r['quant_us']:>6.1f} {r['floor_us']:>6.1f}  {best:<8} {bx:>5.2f}"
            + f" {fp8s.get(best, float('nan')) / r['floor_us']:>6.2f}"
        )
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
    if ns.write_table:
        write_table({"info": info, "results": results}, ns.out or "")
    return 0


def write_table(run: dict, source: str) -> None:
    """kernels/fp8/gemm_table.json from a run (`table.build`), naming the run's device and file."""
    info = run["info"]
    measured = {
        "device": info["device"],
        "torch": info["torch"],
        "libs": {k: v.get("version", "error") for k, v in info.get("libs", {}).items()},
        "source": source,
        "command": "python3 studies/gpu_fp8_gemm_libs.py (scripts/device/fp8_gemm_libs.sh)",
    }
    out = table.build(run["results"], measured)
    table.PATH.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {table.PATH}")


if __name__ == "__main__":
    sys.exit(main())
