"""`ddtree bench prefix-cache`: the prefix cache's serving targets, cache on vs --disable-radix-cache.

For each of the two settings it starts `python3 -m ddtree.launch_server` on the given pair and runs
two `bench serving --workload multiturn` workloads against it: `shared` (--conversations
conversations over one --system-prompt-tokens system prompt, --turns turns each) and `distinct`
(as many one-turn requests, every one its own system prompt: nothing to reuse). Then it
checks issue 22's targets: shared TTFT p50 at least --min-ttft-ratio x lower with the cache, shared
output throughput not lower, distinct output throughput within --max-distinct-loss. One table, a
JSON report, exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

SETTINGS = (("cache", ()), ("no cache", ("--disable-radix-cache",)))


def make_parser() -> argparse.ArgumentParser:
    from ddtree.bench import multiturn
    from ddtree.bench.cli import DefaultsFormatter

    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="ddtree bench prefix-cache",
        description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsFormatter,
    )
    p.add_argument(
        "--model-path",
        required=True,
        help="target dir, or inflate:SHAPE (each server builds the pair in memory, its drafter too)",
    )
    p.add_argument("--speculative-draft-model-path", help="drafter dir (DFLASH / DDTREE)")
    p.add_argument("--algorithm", default="DDTREE", choices=("NONE", "DFLASH", "DDTREE"))
    p.add_argument("--budget", type=int, default=16, help="DDTREE budget")
    p.add_argument("--conversations", type=int, default=32, help="conversations per workload")
    p.add_argument("--concurrency", type=int, default=8, help="conversations at once")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per turn")
    p.add_argument("--device", default="cuda")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV cap of both servers")
    p.add_argument("--port", type=int, default=30124)
    p.add_argument("--server-timeout-s", type=float, default=400.0)
    p.add_argument("--timeout", type=float, default=300.0, help="per-turn timeout in seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-ttft-ratio", type=float, default=5.0)
    p.add_argument("--max-distinct-loss", type=float, default=0.02)
    p.add_argument("--out", default="prefix_cache_out", help="directory of the JSON and logs")
    p.add_argument(
        "--server-flag",
        action="append",
        default=[],
        help="extra launch_server flag for both servers, repeatable "
        "(e.g. --server-flag=--mamba-scheduler-strategy=no_buffer)",
    )
    multiturn.add_flags(p, distinct=False)
    return p


def workload(ns, distinct: bool) -> argparse.Namespace:
    w = argparse.Namespace(**vars(ns))
    # distinct: as many requests as the shared workload's turns, each a one-turn conversation
    w.num_prompts = ns.conversations * (ns.turns if distinct else 1)
    w.concurrency = [ns.concurrency]
    w.distinct_system_prompts, w.turns = distinct, 1 if distinct else ns.turns
    w.temperature, w.ignore_eos, w.api_key, w.model, w.save_requests = 0.0, True, None, None, False
    w.warmup = 1
    if w.tokenizer is None and os.path.isfile(os.path.join(ns.model_path, "tokenizer.json")):
        w.tokenizer = ns.model_path  # held-out prompts through the served model's tokenizer
    return w


def serve(ns, name: str, extra: tuple[str, ...]) -> dict:
    from ddtree.bench import multiturn
    from ddtree.bench.serving_report import BREAKDOWN_COLUMNS
    from ddtree.tools.studies.at_scale_serve import ServeConfig, Server, server_argv

    sns = argparse.Namespace(**vars(ns))
    sns.levels = [ns.concurrency]
    sns.server_flags = getattr(ns, "server_flags", None) or ""
    flags = ("--speculative-ddtree-budget", str(ns.budget)) if ns.algorithm == "DDTREE" else ()
    cfg = ServeConfig(ns.algorithm, ns.algorithm, flags)
    log = os.path.join(ns.out, f"server_{name.replace(' ', '_')}.log")
    argv = server_argv(sns, ns.model_path, ns.speculative_draft_model_path, cfg)
    srv = Server(sns, argv, log)
    srv.argv += ["--enable-metrics", *ns.server_flag, *extra]
    out = {}
    with srv:
        print(f"# {name}: server up in {srv.startup_s:.1f} s", flush=True)
        for kind, distinct in (("shared", False), ("distinct", True)):
            w = workload(ns, distinct)
            w.base_url = srv.url
            out[kind] = asyncio.run(multiturn.run(w))["results"][0]
            r = out[kind]
            print(
                f"#   {kind}: {r['completed']} ok / {r['failed']} failed, TTFT p50 "
                f"{r['ttft_ms']['p50']:.1f} ms, {r['output_throughput']:.0f} tok/s, "
                f"hit rate {r['cache_hit_rate']:.2f}, accept {r['mean_accept_length']:.2f}",
                flush=True,
            )
            if r.get("steps"):
                print("#     " + step_line(name, kind, r["steps"]), flush=True)
            b = r.get("ttft_breakdown_later_turns_ms") or r.get("ttft_breakdown_ms")
            if b:
                print(
                    "#     TTFT p50 by phase (ms): "
                    + ", ".join(f"{k} {b[k]['p50']:.1f}" for k in BREAKDOWN_COLUMNS),
                    flush=True,
                )
    return out


def verdict(res: dict, ns) -> list[tuple[str, float, str, bool]]:
    """(target, measured, wanted, met) rows from {setting: {workload: level}}."""
    on, off = res["cache"], res["no cache"]
    ttft = off["shared"]["ttft_ms"]["p50"] / max(on["shared"]["ttft_ms"]["p50"], 1e-9)
    tput = on["shared"]["output_throughput"] / max(off["shared"]["output_throughput"], 1e-9)
    dist = on["distinct"]["output_throughput"] / max(off["distinct"]["output_throughput"], 1e-9)
    failed = sum(r["failed"] for s in res.values() for r in s.values())
    return [
        ("shared TTFT p50, off / on", ttft, f">= {ns.min_ttft_ratio:g}", ttft >= ns.min_ttft_ratio),
        ("shared out tok/s, on / off", tput, ">= 1.00", tput >= 1.0),
        (
            "distinct out tok/s, on / off",
            dist,
            f">= {1 - ns.max_distinct_loss:.2f}",
            dist >= 1 - ns.max_distinct_loss,
        ),
        ("failed turns", failed, "0", failed == 0),
    ]


STEP_COLUMNS = (  # (summarize key, header, format)
    ("prefill_steps", "prefill", "{:.0f}"),
    ("graphed_share", "graphed", "{:.2f}"),
    ("graphable_share", "graphable", "{:.2f}"),
    ("passes_per_graphed_step", "passes", "{:.2f}"),
    ("mean_prefill_batch", "p-batch", "{:.2f}"),
    ("chunks_per_prompt", "chunks", "{:.2f}"),
    ("decode_steps", "decode", "{:.0f}"),
    ("mean_decode_batch", "d-batch", "{:.2f}"),
    ("schedule_ms_per_step", "sched ms", "{:.3f}"),
    ("cache_insert_ms_per_prompt", "insert ms", "{:.3f}"),
)
STEP_HEADER = f"{'setting':<10} {'workload':<9} " + " ".join(f"{h:>9}" for _, h, _ in STEP_COLUMNS)


def step_line(setting: str, kind: str, st: dict) -> str:
    """prefill: steps; graphed / graphable: their share on the extend graphs (graphable: at the
    default widths, what a CPU server would take on the device); passes per graphed step; p-batch:
    request chunks per prefill step; chunks per prompt; decode steps and batch; host ms."""
    cells = ["-" if st.get(k) is None else fmt.format(st[k]) for k, _, fmt in STEP_COLUMNS]
    return f"{setting:<10} {kind:<9} " + " ".join(f"{c:>9}" for c in cells)


def format_report(res: dict, rows) -> str:
    lines = [
        f"{'setting':<10} {'workload':<9} {'TTFT p50':>10} {'TTFT p99':>10} {'tok/s':>9}"
        f" {'hit rate':>9} {'evicted':>9} {'accept':>9}",
        f"{'':<10} {'':<9} {'(ms)':>10} {'(ms)':>10} {'(out)':>9} {'(ratio)':>9} {'(pages)':>9}"
        f" {'(tok/rd)':>9}",
    ]
    for setting, levels in res.items():
        for kind, r in levels.items():
            evicted = r.get("cache_evicted_pages")
            lines.append(
                f"{setting:<10} {kind:<9} {r['ttft_ms']['p50']:>10.1f} {r['ttft_ms']['p99']:>10.1f}"
                f" {r['output_throughput']:>9.1f} {r['cache_hit_rate']:>9.2f}"
                f" {'-' if evicted is None else f'{evicted:.0f}':>9}"
                f" {r.get('mean_accept_length', 0.0):>9.2f}"
            )
    steps = [(st, k, r["steps"]) for st, lv in res.items() for k, r in lv.items() if r.get("steps")]
    if (
        steps
    ):  # the step plan behind the numbers (engine/scheduling/step_stats.py; servers with /metrics)
        lines += ["", "per-step counters (server side):", STEP_HEADER]
        lines += [step_line(setting, kind, st) for setting, kind, st in steps]
    lines += [""] + [
        f"{'PASS' if ok else 'FAIL'}  {name:<30} {value:>8.2f}  (target {want})"
        for name, value, want, ok in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ddtree.bench import multiturn

    ns = make_parser().parse_args(argv)
    problem = multiturn.check(ns)
    if problem or ns.conversations < 1 or ns.concurrency < 1:
        print(
            f"error: {problem or '--conversations and --concurrency must be >= 1'}", file=sys.stderr
        )
        return 2
    inflated = ns.model_path.startswith("inflate:")
    if ns.algorithm != "NONE" and not ns.speculative_draft_model_path and not inflated:
        print(
            f"error: --algorithm {ns.algorithm} needs --speculative-draft-model-path "
            "(or --model-path inflate:SHAPE, which brings its drafter)",
            file=sys.stderr,
        )
        return 2
    os.makedirs(ns.out, exist_ok=True)
    t0 = time.perf_counter()
    res = {name: serve(ns, name, extra) for name, extra in SETTINGS}
    rows = verdict(res, ns)
    report = {"meta": vars(ns), "results": res, "targets": rows, "wall_s": time.perf_counter() - t0}
    path = os.path.join(ns.out, "prefix_cache.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(format_report(res, rows))
    print(f"wrote {path}")
    return 0 if all(ok for *_, ok in rows) else 1
