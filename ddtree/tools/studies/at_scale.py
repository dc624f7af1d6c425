"""`ddtree bench at-scale` (= `python3 -m ddtree.tools.studies.at_scale`): serving at a production shape in
one device run, with the validity of the method measured in the same run.

1. Inflate the embedded pair to `--shape` (default Qwen3-8B) on the device (`ddtree.tools.inflate`: the
   small pair's function at full size) and write it under --work-dir (local disk there; rewritten
   each run); or, with --model-store memory (the default for hybrid shapes: the 27B pair), write
   nothing: each server gets `--model-path inflate:SHAPE` and builds the pair on its GPU.
2. `rounds`: per-round time of the inflated target vs a random-weight target of the same shape
   (NONE, DFLASH, DDTREE B=64 at batch 1 and 8; `bench rounds`' runner and clock) - the inflated
   pair must cost what a trained pair of the shape costs.
3. `serving`: for each config (default DFLASH, DDTREE B=64, NONE, B=16, B=32: the order is the
   priority under --time-budget-s; configs are data, `ddtree.tools.studies.at_scale_serve`) start
   `python3 -m ddtree.launch_server`, drive every concurrency with `bench serving`'s client on
   held-out prompts (`bench acceptance`'s set, not the training corpus), the prompt count scaled
   per level (--waves x concurrency, at least --min-prompts), stop the server.
4. `tau`: τ of the small pair on the same prompts (offline, T=0) beside the served τ of the inflated
   pair. Prints one table and writes --out/at_scale.json and --out/at_scale.png.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import sys
import time

from ddtree.tools.studies.at_scale_serve import Server, level_items, load_configs, server_argv

PARTS = ("rounds", "serving", "tau")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="ddtree bench at-scale", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--shape",
        default="qwen3-8b",
        help="qwen3-8b, qwen3.6-27b or a config.json (ddtree inflate)",
    )
    p.add_argument(
        "--work-dir", default="/tmp/ddtree_at_scale", help="where the inflated pair is written"
    )
    p.add_argument(
        "--model-store",
        default="auto",
        choices=("auto", "disk", "memory"),
        help="memory: each server builds the pair itself (--model-path inflate:SHAPE), nothing "
        "written; auto = memory for hybrid shapes (the 27B pair, ~55 GB, does not fit the "
        "H200 machine's 64 GiB disk once written), disk otherwise",
    )
    p.add_argument("--in-memory", action="store_true", help="= --model-store memory")
    p.add_argument(
        "--source-drafter",
        default=None,
        help="the small drafter inflated beside the embedded target (default: the embedded DFlash "
        "drafter; a DFlash2 one trained for it: scripts/train_reference_dflash2.sh)",
    )
    p.add_argument(
        "--out", default="at_scale_out", help="directory for at_scale.json, .png and server logs"
    )
    p.add_argument(
        "--configs",
        default="DFLASH,DDTREE64,NONE,DDTREE16,DDTREE32",
        help="serving configs in order (the priority under --time-budget-s): NONE, DFLASH, "
        "DDTREE<budget>",
    )
    p.add_argument(
        "--config-json",
        default=None,
        help='more configs: a JSON list of {"name", "algorithm", "flags": [serve flags]}',
    )
    p.add_argument(
        "--server-flags",
        default=None,
        help="extra `ddtree serve` flags for every server; default for hybrid shapes: "
        "--mamba-scheduler-strategy no_buffer (extra_buffer holds 3 requests at B=64 on the 27B)",
    )
    p.add_argument(
        "--concurrency",
        default="1,2,4,8,16,32,64,128,256",
        help="comma list of levels (the servers take the largest as --max-running-requests and "
        "--cuda-graph-max-bs)",
    )
    p.add_argument(
        "--waves", type=int, default=2, help="prompts per level = waves x concurrency ..."
    )
    p.add_argument("--min-prompts", type=int, default=4, help="... but at least this many")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--rounds-batches", default="1,8")
    p.add_argument("--rounds-context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per rounds config")
    p.add_argument(
        "--tau-level", type=int, default=8, help="concurrency whose prompts the τ check reuses"
    )
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=540,
        help="start no server config expected to end after this",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default=None, help="default triton on cuda, torch on cpu")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument(
        "--max-total-tokens", type=int, default=None, help="servers' KV cap (default: what fits)"
    )
    p.add_argument(
        "--rounds-budget", type=int, default=64, help="DDTREE budget of the rounds check"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check of the whole run in well under a minute: give a tiny --shape JSON",
    )
    p.add_argument("--port", type=int, default=30123)
    p.add_argument(
        "--server-timeout-s", type=float, default=300, help="wait this long for a server to be up"
    )
    return p


def serve_levels(ns, url: str, base: list) -> list[dict]:
    from ddtree.bench import serving

    levels = []
    for i, c in enumerate(ns.levels):
        if over(ns):
            print(f"#   c={c}: skipped (time budget)", flush=True)
            continue
        items = level_items(base, c, ns)
        args = serving.make_parser().parse_args(
            [
                "--base-url",
                url,
                "--max-tokens",
                str(ns.max_tokens),
                "--ignore-eos",
                "--concurrency",
                str(c),
                "--warmup",
                str(min(c, 4) if i == 0 else 0),
                "--timeout",
                "300",
            ]
        )
        res = asyncio.run(serving.run(args, items))["results"][0]
        levels.append(res)
        sv = res.get("server") or {}
        lag = sv.get("loop_lag_ms")
        gc_ms = sum(g["total_ms"] for g in (sv.get("gc_pauses") or {}).values())
        cl = res["client"]
        print(
            f"#   c={c}: {res['completed']} ok, {res['output_throughput']:.0f} tok/s, "
            f"tau {res['mean_accept_length']:.2f}"
            + (f", HTTP loop lag {lag:.2f} ms" if lag is not None else "")
            + (f", GC {gc_ms:.0f} ms" if sv else "")
            + f", client loop lag p99 {cl['loop_lag_ms']['p99']:.1f} ms, cpu {cl['cpu_share']:.2f}",
            flush=True,
        )
    return levels


def over(ns, need_s: float = 0.0) -> bool:
    """True once --time-budget-s has passed, or would within `need_s` (a step's expected time)."""
    return time.perf_counter() - ns.t_start + need_s > ns.time_budget_s


def config_need_s(times: list[float]) -> float:
    """The next server config's expected wall time: the fastest one so far (an auto server's
    start-up profile, or a first start compiling kernels, is not the next config's cost; the
    report is saved after every config, so an overrun loses only the config it cuts)."""
    return min(times, default=0.0)


def save(report: dict, ns) -> str:
    """Rewritten after every step: a run cut short at the device limit still leaves its JSON."""
    path = os.path.join(ns.out, "at_scale.json")
    report["seconds"] = time.perf_counter() - ns.t_start
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return path


def build(ns, report: dict, need_pair: bool):
    """The inflated pair in device memory (for the rounds check, or to write), and the paths the
    servers get: --work-dir/<shape>/{target,drafter}, or the `inflate:` spec and no drafter path
    (each server builds the pair on its device)."""
    import torch

    from ddtree.assets import default_model_paths
    from ddtree.tools.inflate import inflate_pair, write_pair

    memory = ns.model_store == "memory"
    src_target, src_drafter = default_model_paths()
    spec = f"inflate:{ns.shape}"
    if ns.source_drafter:
        src_drafter = os.path.abspath(ns.source_drafter)
        spec = f"{spec}:{src_target}:{src_drafter}"
    if memory and not need_pair:
        return None, spec, None
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if ns.device == "cuda" else torch.float32
    pair = inflate_pair(src_target, src_drafter, ns.shape, ns.device, dtype)
    t1 = time.perf_counter()
    if memory:
        tdir, ddir = spec, None
    else:
        name = os.path.splitext(os.path.basename(ns.shape))[0]
        tdir, ddir = write_pair(pair, os.path.join(ns.work_dir, name))
    report["build"] = {
        "build_s": t1 - t0,
        "write_s": None if memory else time.perf_counter() - t1,
        "target": tdir,
        "drafter": ddir,
        "target_params": sum(p.numel() for p in pair.target.parameters()),
        "drafter_params": sum(p.numel() for p in pair.drafter.parameters()),
    }
    b = report["build"]
    print(
        f"# inflated {ns.shape}: built {b['build_s']:.1f} s, "
        + ("in memory" if memory else f"written {b['write_s']:.1f} s")
        + f" ({b['target_params'] / 1e9:.2f}B + {b['drafter_params'] / 1e9:.2f}B)",
        flush=True,
    )
    return pair, tdir, ddir


def resolve_store(ns) -> None:
    """--model-store auto and the hybrid default of --server-flags, from the shape."""
    from ddtree.models.shapes import is_hybrid, resolve_shape

    hybrid = is_hybrid(resolve_shape(ns.shape)[0])
    if ns.in_memory and ns.model_store == "disk":
        raise ValueError("--in-memory contradicts --model-store disk; pass one of them")
    if ns.in_memory:
        ns.model_store = "memory"
    if ns.model_store == "auto":
        ns.model_store = "memory" if hybrid else "disk"
    if ns.server_flags is None:
        ns.server_flags = "--mamba-scheduler-strategy no_buffer" if hybrid else ""


def main(argv: list[str] | None = None) -> int:
    import torch

    from ddtree.bench.acceptance import DEFAULT_PROMPTS
    from ddtree.bench.serving import Item
    from ddtree.tools.studies import at_scale_report as rep
    from ddtree.tools.studies import at_scale_validity as val

    ns = make_parser().parse_args(argv)
    ns.t_start = time.perf_counter()
    if ns.smoke:
        apply_smoke(ns)
        torch.set_num_threads(1)
    try:
        configs = load_configs(ns.configs, ns.config_json)
        resolve_store(ns)
        ns.levels = [int(c) for c in ns.concurrency.split(",") if c.strip()]
        parts = [p.strip() for p in ns.parts.split(",") if p.strip()]
        if set(parts) - set(PARTS) or not ns.levels or min(ns.levels) < 1:
            raise ValueError(f"--parts must be from {PARTS} and --concurrency positive")
    except (ValueError, OSError) as e:  # InflateError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    ns.device = (
        ("cuda" if torch.cuda.is_available() else "cpu") if ns.device == "auto" else ns.device
    )
    ns.attention_backend = ns.attention_backend or ("triton" if ns.device == "cuda" else "torch")
    os.makedirs(ns.out, exist_ok=True)
    report = {
        "meta": {k: v for k, v in vars(ns).items() if k != "t_start"},
        "configs": [dataclasses.asdict(c) for c in configs],
        "serving": {},
        "rounds": [],
        "tau": {},
    }
    pair, tdir, ddir = build(ns, report, "rounds" in parts)
    if "rounds" in parts:
        kw = dict(
            batches=[int(b) for b in ns.rounds_batches.split(",")],
            context=ns.rounds_context,
            rounds=ns.rounds,
            warmup=1 if ns.smoke else 3,
            device=torch.device(ns.device),
            budget=ns.rounds_budget,
            attention_backend=ns.attention_backend,
            cuda_graph=not ns.disable_cuda_graph,
        )
        src_vocab = _source_vocab()  # contexts of real tokens
        report["rounds"] += val.time_pair("inflated", pair.target, pair.drafter, src_vocab, **kw)
        drafter_dict = pair.drafter_config
    del pair  # the servers need the device memory
    gc.collect()
    if ns.device == "cuda":
        torch.cuda.empty_cache()
    if "rounds" in parts:
        report["rounds"] += val.random_rounds(ns.shape, drafter_dict, kw)
        report["rounds_ratios"] = val.rounds_ratios(report["rounds"])
        save(report, ns)
    base = [Item(prompt=p) for p in DEFAULT_PROMPTS]
    if "serving" in parts:
        times: list[float] = []  # each config's wall time so far
        for cfg in configs:
            if over(ns, config_need_s(times)):
                print(f"# {cfg.name}: skipped (time budget)", flush=True)
                continue
            t0 = time.perf_counter()
            slug = "".join(ch if ch.isalnum() else "_" for ch in cfg.name)
            log = os.path.join(ns.out, f"server_{slug}.log")
            try:
                with Server(ns, server_argv(ns, tdir, ddir, cfg), log, cfg.env) as srv:
                    print(f"# {cfg.name}: server up in {srv.startup_s:.1f} s", flush=True)
                    report.setdefault("startup_s", {})[cfg.name] = srv.startup_s
                    report["serving"][cfg.name] = serve_levels(ns, srv.url, base)
            except RuntimeError as e:  # one config's server failing leaves the others' rows
                print(f"# {cfg.name}: {e}", flush=True)
                report.setdefault("errors", {})[cfg.name] = str(e)
            times.append(time.perf_counter() - t0)
            save(report, ns)
    if "tau" in parts and not over(ns, 20):
        if ns.tau_level not in ns.levels:
            ns.tau_level = ns.levels[0]
        spec = [c for c in configs if c.algorithm != "NONE" and c.name in report["serving"]]
        prompts = [it.prompt for it in level_items(base, ns.tau_level, ns)]
        small = val.small_pair_tau(prompts, ns.max_tokens, spec, ns.device, ns.source_drafter)
        for name, t in small.items():
            served = {lv["concurrency"]: lv for lv in report["serving"][name]}.get(ns.tau_level)
            report["tau"][name] = {
                "small": t["tau"],
                "small_se": t["se"],
                "small_per_prompt": t["per_prompt"],
                "inflated": served and served["mean_accept_length"],
            }
    rows = rep.table_rows(report["serving"])
    report["table"], report["rounds_ratios"] = rows, val.rounds_ratios(report["rounds"])
    adaptive = {c.name for c in configs if c.budget == "auto"}
    report["ceiling"] = rep.ceiling_rows(report["serving"], adaptive)
    path = save(report, ns)
    print(f"\n{ns.shape}: {ns.max_tokens} output tokens per request, held-out prompts, T=0")
    rep.print_table(rows)
    rep.print_round_split(report["serving"])
    rep.print_ceiling(report["ceiling"])
    rep.print_validity(report["rounds_ratios"], report["tau"])
    if rows:
        rep.plot(rows, os.path.splitext(path)[0] + ".png", f"{ns.shape} (inflated embedded pair)")
    print(f"done in {report['seconds']:.0f} s; wrote {path}")
    return 1 if any(r["failed"] for r in rows) or report.get("errors") else 0


SMOKE = {
    "device": "cpu",
    "configs": "DFLASH,DDTREE8,NONE",
    "concurrency": "1,2",
    "max_tokens": 8,
    "min_prompts": 2,
    "waves": 1,
    "rounds_batches": "1,2",
    "rounds_context": 32,
    "rounds": 2,
    "rounds_budget": 8,
    "tau_level": 2,
    "max_total_tokens": 2048,
}


def apply_smoke(ns) -> None:
    """Small counts on the CPU, every step of the real run (explicit flags still win)."""
    defaults = make_parser().parse_args([])
    for key, value in SMOKE.items():
        if getattr(ns, key) == getattr(defaults, key):
            setattr(ns, key, value)


def _source_vocab() -> int:
    from ddtree.assets import default_model_paths
    from ddtree.models.configs import TargetConfig

    return TargetConfig.from_path(default_model_paths()[0]).vocab_size


if __name__ == "__main__":
    sys.exit(main())
