"""Issue 58's served table in one device run (scripts/device/fp8_served.sh): block FP8 against bf16,
each server building its pair in memory (`--model-path inflate:SHAPE`: the embedded pair inflated
on the GPU, FP8 servers quantizing target and drafter at load), held-out prompts (`bench
acceptance`'s), 128 output tokens, T=0, CUDA graphs, one server at a time on the card.

Parts, in priority order; every measured level is a row of OUT/fp8_served.json and .md the moment
it ends, so a run cut short keeps what it finished:
  8b   Qwen3-8B shape: DFLASH and DDTREE `auto`, bf16 and FP8, at concurrency 1, 8, 64 (every
       server the same KV pool, --max-total-tokens: the card is not what limits 8B at 64)
  ar   no speculation at batch 1, bf16 and FP8: the served round (/metrics) against the weight floor
       (target read bytes / the card's copy bandwidth measured first: `bench rounds`' convention)
  27b  Qwen3.6-27B hybrid shape: FP8 and bf16 DFLASH, then `auto`, at 1, 8, 32, 64 where the
       memory plan (`ddtree check-config`'s, for this card) holds that many running requests; a
       level past the plan's cap is skipped and said so, and the cap itself is measured instead

Each shape's part opens with its bf16 DFLASH server, whose start-up (no timing in it, unlike
`auto`'s round-cost profile) overlaps the pre-warm: --prewarm-procs processes compile into
DG_JIT_CACHE_DIR the DeepGEMM kernels that part's FP8 servers would compile at start-up (every row
count up to the largest forward each may meet, per FP8 weight shape: `engine/warmup.py`), and the
FP8 servers then load them from the cache. Nothing is timed while they run. A run whose time
would pass --time-budget-s starts no server or level it cannot finish.

    python3 studies/fp8_served.py --out OUT [--parts 8b,ar,27b] [--time-budget-s 530]
    python3 studies/fp8_served.py --dry-run --out /tmp/fp8_served   # CPU: tiny shapes, every step
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8_serving_summary as summary  # noqa: E402

PARTS = ("8b", "ar", "27b")
ALGO = {  # config -> (--speculative-algorithm, its flags)
    "DFLASH": ("DFLASH", ()),
    "auto": ("DDTREE", ("--speculative-ddtree-budget", "auto")),
    "AR": ("NONE", ()),
}
# a rough start-up per (part, quant), seconds: a server is started only with this much left
START_S = {("8b", "bf16"): 30, ("8b", "fp8"): 45, ("ar", "bf16"): 20, ("ar", "fp8"): 25}
START_S |= {("27b", "bf16"): 50, ("27b", "fp8"): 90}
LEVEL_S = {"8b": 6, "ar": 4, "27b": 12}  # one level's measurement, seconds
SPLITS = (128, 1024, 2560)  # pre-warm row ranges: DeepGEMM picks tile configs by row count
# tiny shapes for --dry-run (the CPU check of every step): tests/inflate_fixtures.py's
DRY_DENSE = {
    "hidden_size": 448,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 1100,
    "vocab_size": 8320,
    "drafter": {
        "num_hidden_layers": 5,
        "num_taps": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 1030,
    },
}
DRY_HYBRID = {
    **DRY_DENSE,
    "architectures": ["Qwen3_5ForCausalLM"],
    "num_hidden_layers": 9,
    "layer_types": ["linear_attention", "full_attention", "full_attention"] * 3,
    "partial_rotary_factor": 0.5,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "drafter": {
        **DRY_DENSE["drafter"],
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "sliding_window": 512,
    },
}


@dataclass(frozen=True)
class Run:
    """One server: a config of a part at one precision, and the levels asked of it."""

    part: str
    shape: str
    config: str  # DFLASH | auto | AR
    quant: str  # bf16 | fp8
    levels: tuple[int, ...]
    extra: tuple[str, ...] = ()  # the part's server flags

    @property
    def name(self) -> str:
        return f"{self.part} {self.config} {self.quant}"


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="fp8_served_out")
    p.add_argument("--log-dir", default=None, help="server and pre-warm logs (default OUT/logs)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--time-budget-s", type=float, default=530)
    p.add_argument("--shape-8b", default="qwen3-8b")
    p.add_argument("--shape-27b", default="qwen3.6-27b")
    p.add_argument("--concurrency-8b", default="1,8,64")
    p.add_argument("--concurrency-27b", default="1,8,32,64")
    p.add_argument("--flags-8b", default="--max-total-tokens 131072")
    p.add_argument(
        "--flags-27b",
        default="--mamba-scheduler-strategy no_buffer --disable-radix-cache",
        help="the prompts share no prefix worth a recurrent-state checkpoint, and each checkpoint "
        "row is a running request fewer: without the prefix cache the plan holds 32 / 15 (bf16 "
        "DFLASH / auto) and 98 / 58 (FP8) requests on 80 GB, with it 17 / 9 and 53 / 38",
    )
    p.add_argument("--waves", type=int, default=2, help="prompts per level = waves x concurrency")
    p.add_argument("--min-prompts", type=int, default=8, help="... but at least this many")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prewarm-procs", type=int, default=12, help="0: no DeepGEMM pre-warm")
    p.add_argument("--prewarm-timeout-s", type=float, default=150)
    p.add_argument("--port", type=int, default=30131)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes and counts")
    p.add_argument("--prewarm-worker", default=None, help=argparse.SUPPRESS)  # internal
    return p


def apply_dry_run(ns) -> None:
    os.makedirs(ns.out, exist_ok=True)
    for key, shape in (("shape_8b", DRY_DENSE), ("shape_27b", DRY_HYBRID)):
        path = os.path.join(ns.out, f"dry_{key}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(shape, f)
        setattr(ns, key, path)
    ns.concurrency_8b, ns.concurrency_27b = "1,2", "1,2"
    ns.flags_8b = "--max-total-tokens 4096"
    ns.flags_27b = (
        "--mamba-scheduler-strategy no_buffer --disable-radix-cache --max-total-tokens 4096"
    )
    ns.max_tokens, ns.min_prompts, ns.waves, ns.prewarm_procs = 8, 2, 1, 2


def plan_runs(ns) -> list[Run]:
    """The servers in priority order, each part opening with bf16 DFLASH (beside the part's
    pre-warm): the DFLASH pair first (FP8 / bf16 at every level; at 27B the capacity FP8 frees),
    then FP8 auto (auto / DFLASH in FP8), then bf16 auto."""
    lv8 = tuple(int(c) for c in ns.concurrency_8b.split(","))
    lv27 = tuple(int(c) for c in ns.concurrency_27b.split(","))
    f8, f27 = tuple(ns.flags_8b.split()), tuple(ns.flags_27b.split())
    runs = []
    for part in ns.parts.split(","):
        if part == "8b":
            order = (("DFLASH", "bf16"), ("DFLASH", "fp8"), ("auto", "fp8"), ("auto", "bf16"))
            runs += [Run("8b", ns.shape_8b, c, q, lv8, f8) for c, q in order]
        elif part == "ar":
            runs += [Run("ar", ns.shape_8b, "AR", q, (1,), f8) for q in ("bf16", "fp8")]
        elif part == "27b":
            order = (("DFLASH", "bf16"), ("DFLASH", "fp8"), ("auto", "fp8"), ("auto", "bf16"))
            runs += [Run("27b", ns.shape_27b, c, q, lv27, f27) for c, q in order]
        else:
            raise ValueError(f"--parts: unknown part {part!r}; use {', '.join(PARTS)}")
    return runs


def server_flags(ns, run: Run) -> list[str]:
    """`ddtree serve` flags of a run (without the port)."""
    algo, algo_flags = ALGO[run.config]
    top = max(run.levels)
    flags = ["--model-path", f"inflate:{run.shape}", "--speculative-algorithm", algo]
    flags += ["--device", ns.device, "--attention-backend", ns.attention_backend]
    flags += ["--max-running-requests", str(top), "--log-level", "warning", "--enable-metrics"]
    flags += ["--disable-cuda-graph"] if ns.device == "cpu" else ["--cuda-graph-max-bs", str(top)]
    flags += list(algo_flags) + list(run.extra)
    if run.quant == "fp8":
        flags += ["--quantization", "fp8"]
        if run.config != "AR":
            flags += ["--speculative-draft-quantization", "fp8"]
    return flags


def resolved(flags: list[str]):
    from ddtree.config.args import ServerArgs
    from ddtree.config.args import make_parser as server_parser
    from ddtree.config.resolve import resolve_server_args

    return resolve_server_args(ServerArgs(**vars(server_parser().parse_args(flags))))


def plan_levels(levels: tuple[int, ...], cap: int) -> tuple[list[int], list[int]]:
    """(levels to measure, levels skipped): those past the plan's running-request cap are skipped,
    and the cap itself is measured in their place (the most this server runs at once)."""
    kept = [c for c in levels if c <= cap]
    skipped = [c for c in levels if c > cap]
    if skipped and cap >= 1 and cap > max(kept, default=0):
        kept.append(cap)
    return kept, skipped


def meta_models(args):
    """(target, drafter or None) on the meta device, FP8 linears swapped in as the server's
    quantization at load makes them: the shapes the warm-up compiles for and the bytes a forward
    reads, with no weight built."""
    import torch

    from ddtree.models import quant
    from ddtree.models.drafters import build_drafter
    from ddtree.models.loader import build_target

    out = []
    for cfg, layout, make in (
        (args.target_config, args.target_fp8, build_target),
        (args.drafter_config if args.is_speculative else None, args.drafter_fp8, build_drafter),
    ):
        if cfg is None:
            out.append(None)
            continue
        with torch.device("meta"):
            model = make(cfg).to(getattr(torch, args.dtype))
            if layout is not None:
                quant.to_fp8(model, layout)
        out.append(model)
    return tuple(out)


def prewarm_tasks(fp8_runs: list[tuple[Run, object, object]]) -> list[tuple[int, ...]]:
    """(N, K, group_n, group_k, lo, hi) slices: every FP8 weight shape of the runs, to the most rows
    one of its servers' forwards may meet (`warmup._fp8_library`: a prefill chunk, or every running
    request verifying its widest tree), split at SPLITS."""
    from ddtree.models import quant

    rows: dict[tuple[int, int, int, int], int] = {}
    for _, args, plan in fp8_runs:
        caps = [c for c in (args.chunked_prefill_size, args.max_prefill_tokens) if c and c > 0]
        need = max(min(caps), plan.running_requests * plan.verify_width)
        for model in meta_models(args):
            for m in quant.fp8_modules(model) if model is not None else ():
                key = (*m.weight.shape, m.group_n, m.group_k)
                rows[key] = max(rows.get(key, 0), need)
    tasks = []
    for key, hi in sorted(rows.items()):
        edges = [0, *[s for s in SPLITS if s < hi], hi]
        tasks += [(*key, lo + 1, top) for lo, top in zip(edges, edges[1:])]
    return tasks


def start_prewarm(ns, tasks: list[tuple[int, ...]], tag: str) -> list[subprocess.Popen]:
    """Worker processes, each a share of the slices (largest first, to the least loaded)."""
    if not tasks or ns.prewarm_procs < 1:
        return []
    shares: list[list] = [[] for _ in range(min(ns.prewarm_procs, len(tasks)))]
    load = [0] * len(shares)
    for t in sorted(tasks, key=lambda t: -(t[5] - t[4] + 1) * t[0] * t[1]):
        i = load.index(min(load))
        shares[i].append(t)
        load[i] += (t[5] - t[4] + 1) * t[0] * t[1]
    procs = []
    for i, share in enumerate(shares):
        log = open(os.path.join(ns.log_dir, f"prewarm_{tag}_{i}.log"), "w", encoding="utf-8")
        argv = [sys.executable, os.path.abspath(__file__), "--prewarm-worker", json.dumps(share)]
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
    print(
        f"# pre-warm {tag}: {len(tasks)} slices of {len({t[:4] for t in tasks})} FP8 weight "
        f"shapes over {len(procs)} processes",
        flush=True,
    )
    return procs


def prewarm_worker(share: list) -> int:
    import torch

    from ddtree.kernels import fp8

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for n, k, gn, gk, lo, hi in share:
        t0 = time.perf_counter()
        w = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
        s = torch.ones(-(-n // gn), -(-k // gk), device=dev)
        st = fp8.cublas_scale(s) if fp8.cublas_ok(w, gn, gk) else None
        calls = fp8.warm_up(w, s, gn, gk, torch.bfloat16, hi, st, min_rows=lo)
        print(
            f"{n}x{k} rows {lo}..{hi}: {calls} calls, {time.perf_counter() - t0:.1f} s", flush=True
        )
    return 0


class Prewarm:
    """The pre-warm processes; `wait` before anything timed (the nvcc builds take the CPU)."""

    def __init__(self, procs: list[subprocess.Popen], timeout_s: float):
        self.procs, self.deadline, self.t0 = (
            procs,
            time.perf_counter() + timeout_s,
            time.perf_counter(),
        )
        self.done: dict | None = None if procs else {"seconds": 0.0, "failed": 0, "killed": 0}

    def wait(self) -> dict:
        if self.done is not None:
            return self.done
        killed = 0
        for p in self.procs:
            try:
                p.wait(max(self.deadline - time.perf_counter(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()  # our own child: the servers compile what it left
                p.wait()
                killed += 1
        failed = sum(p.returncode not in (0, None) for p in self.procs) - killed
        self.done = {"seconds": time.perf_counter() - self.t0, "failed": failed, "killed": killed}
        print(f"# pre-warm done: {self.done}", flush=True)
        return self.done

    def stop(self) -> dict:
        """At the end: kill what still runs (no part left to need it)."""
        self.deadline = time.perf_counter()
        return self.wait()


def time_left(ns) -> float:
    return ns.time_budget_s - (time.perf_counter() - ns.t0)


def run_need_s(run: Run) -> float:
    """What a run needs left to start at all: a rough start-up and one level."""
    return START_S.get((run.part, run.quant), 60) + LEVEL_S[run.part]


def wait_prewarms(ns) -> None:
    for pw in ns.prewarms.values():
        pw.wait()


BANDWIDTH = """import json, sys, torch
from ddtree.bench.round_timing import copy_bandwidth
dev = torch.device(sys.argv[1])
bw = copy_bandwidth(dev, (1 << 30) if dev.type == "cuda" else (16 << 20))
bw["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
print(json.dumps(bw))
"""


def device_bandwidth(device: str) -> dict:
    """The copy bandwidth the floors divide by (`bench rounds`' measure), on the quiet card before
    anything starts; in a child process, so that this one holds no CUDA context beside the servers
    (the memory plan assumes the card is theirs)."""
    out = subprocess.run(
        [sys.executable, "-c", BANDWIDTH, device], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_level(ns, url: str, c: int, first: bool) -> dict:
    from ddtree.bench import serving
    from ddtree.bench.acceptance import DEFAULT_PROMPTS
    from ddtree.bench.serving import Item

    n = max(ns.min_prompts, ns.waves * c)
    items = [Item(prompt=DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]) for i in range(n)]
    argv = ["--base-url", url, "--max-tokens", str(ns.max_tokens), "--ignore-eos"]
    argv += [
        "--concurrency",
        str(c),
        "--warmup",
        str(min(c, 4) if first else 0),
        "--timeout",
        "300",
    ]
    return asyncio.run(serving.run(serving.make_parser().parse_args(argv), items))["results"][0]


def row_of(run: Run, res: dict, extra: dict) -> dict:
    steps = res.get("steps") or {}
    return {
        "part": run.part,
        "config": run.config,
        "quant": run.quant,
        "concurrency": res["concurrency"],
        "prompts": res["completed"] + res["failed"],
        "failed": res["failed"],
        "output_tok_s": res["output_throughput"],
        "tau": res.get("mean_accept_length"),
        "round_ms": res.get("round_ms"),
        "mean_decode_batch": steps.get("mean_decode_batch"),
        "ttft_p50_ms": (res.get("ttft_ms") or {}).get("p50"),
        "tpot_p50_ms": (res.get("tpot_ms") or {}).get("p50"),
        **extra,
    }


def save(ns, report: dict) -> None:
    report["seconds"] = time.perf_counter() - ns.t0
    path = os.path.join(ns.out, "fp8_served.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    with open(os.path.join(ns.out, "fp8_served.md"), "w", encoding="utf-8") as f:
        f.write(summary.markdown(report))


def serve_run(ns, run: Run, flags: list[str], levels: list[int], report: dict, extra: dict) -> None:
    from ddtree.tools.studies.at_scale_serve import Server

    left, need = time_left(ns), run_need_s(run)
    if left < need:
        print(f"# {run.name}: skipped, {left:.0f} s left (needs ~{need} s)", flush=True)
        report["skipped"].append({"run": run.name, "why": f"time budget ({left:.0f} s left)"})
        return
    if run.config == "auto" or run.part == "27b":
        # auto: its start-up times the rounds it chooses between; 27B: the pre-warm processes
        # hold GPU memory (~1.3 GiB each) that a 27B server's static pool, sized from the whole
        # device, does not leave free (its first start died of CUDA OOM beside them)
        wait_prewarms(ns)
    srv_ns = SimpleNamespace(port=ns.port, server_timeout_s=max(left - LEVEL_S[run.part], 10))
    argv = [sys.executable, "-m", "ddtree.launch_server", *flags, "--port", str(ns.port)]
    log = os.path.join(ns.log_dir, "server_" + run.name.replace(" ", "_") + ".log")
    t0 = time.perf_counter()
    try:
        with Server(srv_ns, argv, log) as srv:
            print(f"# {run.name}: up in {srv.startup_s:.1f} s", flush=True)
            report["startup_s"][run.name] = srv.startup_s
            wait_prewarms(ns)
            for i, c in enumerate(levels):
                left = ns.time_budget_s - (time.perf_counter() - ns.t0)
                if left < LEVEL_S[run.part]:
                    print(f"#   c={c}: skipped, {left:.0f} s left", flush=True)
                    report["skipped"].append({"run": run.name, "concurrency": c, "why": "time"})
                    continue
                res = measure_level(ns, srv.url, c, i == 0)
                row = row_of(run, res, {**extra, "startup_s": srv.startup_s})
                report["rows"].append(row)
                report["levels"].setdefault(run.name, []).append(res)
                save(ns, report)
                print(
                    f"#   c={c}: {res['completed']} ok, {res['output_throughput']:.1f} tok/s, "
                    f"tau {row['tau'] or 0:.2f}, round {row['round_ms'] or 0:.2f} ms"
                    + (f" (floor {extra['floor_ms']:.2f} ms)" if "floor_ms" in extra else ""),
                    flush=True,
                )
    except RuntimeError as e:  # its server failed or did not come up: the other runs go on
        print(f"# {run.name}: {e}", flush=True)
        report["errors"][run.name] = str(e)
    report["wall_s"][run.name] = time.perf_counter() - t0
    save(ns, report)


def main(argv: list[str] | None = None) -> int:
    ns = make_parser().parse_args(argv)
    if ns.prewarm_worker is not None:
        return prewarm_worker(json.loads(ns.prewarm_worker))
    ns.t0 = time.perf_counter()
    # cut at the call's limit (`timeout`): leave through the server's `with`, which stops it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    import torch

    from ddtree.bench.random_pair import read_bytes
    from ddtree.config.memory_plan import memory_plan

    if ns.dry_run:
        apply_dry_run(ns)
        torch.set_num_threads(1)
    ns.device = "cuda" if torch.cuda.is_available() and not ns.dry_run else "cpu"
    ns.attention_backend = "triton" if ns.device == "cuda" else "torch"
    ns.log_dir = ns.log_dir or os.path.join(ns.out, "logs")
    os.makedirs(ns.log_dir, exist_ok=True)
    try:
        runs = plan_runs(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bw = device_bandwidth(ns.device)
    report = {
        "meta": {k: v for k, v in vars(ns).items() if k not in ("t0",)},
        "device": bw.pop("device"),
        "torch": torch.__version__,
        "bandwidth": bw,
        "plans": {},
        "rows": [],
        "levels": {},
        "skipped": [],
        "errors": {},
        "startup_s": {},
        "wall_s": {},
    }
    # every run's plan first (config.json and shapes only: a fraction of a second each)
    planned = []
    for run in runs:
        flags = server_flags(ns, run)
        args = resolved(flags)
        plan = memory_plan(args)
        levels, skipped = plan_levels(run.levels, plan.running_requests)
        report["plans"][run.name] = {
            "running_requests": plan.running_requests,
            "state_pool_requests": plan.state_pool_requests,
            "kv_tokens": plan.kv_tokens,
            "weight_gib": plan.weight_bytes_per_device / 2**30,
            "levels": levels,
            "skipped": skipped,
            "flags": flags,
            "warnings": list(plan.warnings),
        }
        print(
            f"# plan {run.name}: {plan.running_requests} running requests, "
            f"{plan.weight_bytes_per_device / 2**30:.1f} GiB weights, {plan.kv_tokens:,} KV "
            f"tokens -> levels {levels}"
            + (f"; skipped {skipped} (past the plan's cap)" if skipped else ""),
            flush=True,
        )
        for c in skipped:
            report["skipped"].append(
                {"run": run.name, "concurrency": c, "why": f"plan holds {plan.running_requests}"}
            )
        planned.append((run, flags, args, plan, levels))
    ns.prewarms, warmed = {}, set()
    report["prewarm_tasks"], report["prewarm"] = {}, {}
    save(ns, report)
    for run, flags, args, plan, levels in planned:
        if run.part not in ns.prewarms and time_left(ns) >= run_need_s(run):
            # the part's FP8 kernels, compiled beside its first (bf16 DFLASH) server's start-up
            fp8 = [
                (r, a, p) for r, _, a, p, _ in planned if r.part == run.part and r.quant == "fp8"
            ]
            tasks = [t for t in prewarm_tasks(fp8) if t not in warmed]
            warmed |= set(tasks)
            report["prewarm_tasks"][run.part] = tasks
            procs = start_prewarm(ns, tasks, run.part)
            ns.prewarms[run.part] = Prewarm(procs, ns.prewarm_timeout_s)
        extra = {"plan_running": plan.running_requests}
        if run.config == "AR":  # the weight floor: what one target forward reads / copy bandwidth
            target, _ = meta_models(args)
            extra["floor_ms"] = read_bytes(target) / bw["bandwidth_Bps"] * 1e3
        serve_run(ns, run, flags, levels, report, extra)
    report["prewarm"] = {part: pw.stop() for part, pw in ns.prewarms.items()}
    save(ns, report)
    print()
    print(summary.markdown(report))
    return 1 if report["errors"] or any(r["failed"] for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
