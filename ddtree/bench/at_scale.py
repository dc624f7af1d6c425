"""`ddtree bench at-scale` (= `python3 -m ddtree.bench.at_scale`): serving at a production shape in
one device run, with the validity of the method measured in the same run.

1. Inflate the embedded pair to `--shape` (default Qwen3-8B) on the device (`ddtree.inflate`: the
   small pair's function at full size) and write it under --work-dir (local disk there; rewritten
   each run).
2. `rounds`: per-round time of the inflated target vs a random-weight target of the same shape
   (NONE, DFLASH, DDTREE B=64 at batch 1 and 8; `bench rounds`' runner and clock) - the inflated
   pair must cost what a trained pair of the shape costs.
3. `serving`: for each config (default DFLASH, DDTREE B=64, NONE, B=16, B=32: the order is the
   priority under --time-budget-s) start `python3 -m ddtree.launch_server`, drive every concurrency
   with `bench serving`'s client on held-out prompts (`bench acceptance`'s set, not the training
   corpus), the prompt count scaled per level (--waves x concurrency, at least --min-prompts), stop
   the server.
4. `tau`: τ of the small pair on the same prompts (offline, T=0) beside the served τ of the inflated
   pair. Prints one table and writes --out/at_scale.json and --out/at_scale.png.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time

PARTS = ("rounds", "serving", "tau")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddtree bench at-scale", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shape",
        default="qwen3-8b",
        help="qwen3-8b, qwen3.6-27b or a config.json (ddtree inflate)",
    )
    p.add_argument(
        "--work-dir", default="/tmp/ddtree_at_scale", help="where the inflated pair is written"
    )
    p.add_argument(
        "--out", default="at_scale_out", help="directory for at_scale.json, .png and server logs"
    )
    p.add_argument(
        "--configs",
        default="DFLASH,DDTREE64,NONE,DDTREE16,DDTREE32",
        help="serving configs in order",
    )
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
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


def parse_config(name: str) -> tuple[str, int | str]:
    name = name.strip().upper()
    if name in ("DDTREEAUTO", "DDTREE-AUTO"):  # --speculative-ddtree-budget auto (cap 64)
        return "DDTREE", "auto"
    if name.startswith("DDTREE"):
        return "DDTREE", int(name[6:] or 64)
    if name not in ("NONE", "DFLASH"):
        raise ValueError(
            f"--configs: unknown config {name!r}; use NONE, DFLASH, DDTREE<budget> or DDTREEAUTO"
        )
    return name, 0


def level_items(base: list, concurrency: int, ns) -> list:
    n = max(ns.min_prompts, ns.waves * concurrency)
    return [base[i % len(base)] for i in range(n)]


class Server:
    """`python3 -m ddtree.launch_server` for one config, log in --out; `with` waits for /health."""

    def __init__(self, ns, target: str, drafter: str, algo: str, budget: int, log: str):
        argv = [
            sys.executable,
            "-m",
            "ddtree.launch_server",
            "--model-path",
            target,
            "--port",
            str(ns.port),
            "--speculative-algorithm",
            algo,
            "--device",
            ns.device,
            "--attention-backend",
            ns.attention_backend,
            "--max-running-requests",
            str(max(ns.levels)),
            "--log-level",
            "warning",
            "--enable-metrics",  # bench serving reads budgets and host time per level from it
        ]
        if ns.max_total_tokens:
            argv += ["--max-total-tokens", str(ns.max_total_tokens)]
        if algo != "NONE":
            argv += ["--speculative-draft-model-path", drafter]
        if algo == "DDTREE":
            argv += ["--speculative-ddtree-budget", str(budget)]
        if ns.disable_cuda_graph or ns.device == "cpu":
            argv += ["--disable-cuda-graph"]
        else:
            argv += ["--cuda-graph-max-bs", str(max(ns.levels))]
        self.argv, self.log_path, self.ns = argv, log, ns
        self.url = f"http://127.0.0.1:{ns.port}"

    def __enter__(self):
        import httpx

        self.log = open(self.log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.ns.server_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; see {self.log_path}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"server not up after {self.ns.server_timeout_s} s; see {self.log_path}")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


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
        print(
            f"#   c={c}: {res['completed']} ok, {res['output_throughput']:.0f} tok/s, "
            f"tau {res['mean_accept_length']:.2f}",
            flush=True,
        )
    return levels


def over(ns, need_s: float = 0.0) -> bool:
    """True once --time-budget-s has passed, or would within `need_s` (a step's expected time)."""
    return time.perf_counter() - ns.t_start + need_s > ns.time_budget_s


def save(report: dict, ns) -> str:
    """Rewritten after every step: a run cut short at the device limit still leaves its JSON."""
    path = os.path.join(ns.out, "at_scale.json")
    report["seconds"] = time.perf_counter() - ns.t_start
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return path


def build(ns, report: dict):
    """The inflated pair in device memory, written to --work-dir/<shape> (kept for later runs)."""
    import torch

    from ddtree.assets import default_model_paths
    from ddtree.inflate import inflate_pair, write_pair

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if ns.device == "cuda" else torch.float32
    pair = inflate_pair(*default_model_paths(), ns.shape, ns.device, dtype)
    t1 = time.perf_counter()
    name = os.path.splitext(os.path.basename(ns.shape))[0]
    tdir, ddir = write_pair(pair, os.path.join(ns.work_dir, name))
    report["build"] = {
        "build_s": t1 - t0,
        "write_s": time.perf_counter() - t1,
        "target": tdir,
        "drafter": ddir,
        "target_params": sum(p.numel() for p in pair.target.parameters()),
        "drafter_params": sum(p.numel() for p in pair.drafter.parameters()),
    }
    print(
        f"# inflated {ns.shape}: built {t1 - t0:.1f} s, written {report['build']['write_s']:.1f} s "
        f"({report['build']['target_params'] / 1e9:.2f}B + "
        f"{report['build']['drafter_params'] / 1e9:.2f}B)",
        flush=True,
    )
    return pair, tdir, ddir


def main(argv: list[str] | None = None) -> int:
    import torch

    from ddtree.bench import at_scale_report as rep
    from ddtree.bench import at_scale_validity as val
    from ddtree.bench.acceptance import DEFAULT_PROMPTS
    from ddtree.bench.serving import Item

    ns = make_parser().parse_args(argv)
    ns.t_start = time.perf_counter()
    if ns.smoke:
        apply_smoke(ns)
        torch.set_num_threads(1)
    try:
        configs = [parse_config(c) for c in ns.configs.split(",") if c.strip()]
        ns.levels = [int(c) for c in ns.concurrency.split(",") if c.strip()]
        parts = [p.strip() for p in ns.parts.split(",") if p.strip()]
        if set(parts) - set(PARTS) or not ns.levels or min(ns.levels) < 1:
            raise ValueError(f"--parts must be from {PARTS} and --concurrency positive")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ns.device = (
        ("cuda" if torch.cuda.is_available() else "cpu") if ns.device == "auto" else ns.device
    )
    ns.attention_backend = ns.attention_backend or ("triton" if ns.device == "cuda" else "torch")
    os.makedirs(ns.out, exist_ok=True)
    report = {
        "meta": {k: v for k, v in vars(ns).items() if k != "t_start"},
        "serving": {},
        "rounds": [],
        "tau": {},
    }
    pair, tdir, ddir = build(ns, report)
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
    del pair
    gc.collect()
    if ns.device == "cuda":
        torch.cuda.empty_cache()
    if "rounds" in parts:
        report["rounds"] += val.random_rounds(ns.shape, report_drafter(ddir), kw)
        report["rounds_ratios"] = val.rounds_ratios(report["rounds"])
        save(report, ns)
    base = [Item(prompt=p) for p in DEFAULT_PROMPTS]
    if "serving" in parts:
        last_s = 0.0  # the previous config's wall time: the next one is expected to take as long
        for algo, budget in configs:
            name = val.config_name(algo, budget)
            if over(ns, last_s):
                print(f"# {name}: skipped (time budget)", flush=True)
                continue
            t0 = time.perf_counter()
            log = os.path.join(ns.out, f"server_{name.replace(' ', '_').replace('=', '')}.log")
            with Server(ns, tdir, ddir, algo, budget, log) as srv:
                print(f"# {name}: server up in {srv.startup_s:.1f} s", flush=True)
                report["serving"][name] = serve_levels(ns, srv.url, base)
            last_s = time.perf_counter() - t0
            save(report, ns)
    if "tau" in parts and not over(ns, 20):
        if ns.tau_level not in ns.levels:
            ns.tau_level = ns.levels[0]
        spec = [
            (a, b) for a, b in configs if a != "NONE" and val.config_name(a, b) in report["serving"]
        ]
        prompts = [it.prompt for it in level_items(base, ns.tau_level, ns)]
        small = val.small_pair_tau(prompts, ns.max_tokens, spec, ns.device)
        for name, t in small.items():
            served = {lv["concurrency"]: lv for lv in report["serving"][name]}.get(ns.tau_level)
            report["tau"][name] = {"small": t, "inflated": served and served["mean_accept_length"]}
    rows = rep.table_rows(report["serving"])
    report["table"], report["rounds_ratios"] = rows, val.rounds_ratios(report["rounds"])
    path = save(report, ns)
    print(f"\n{ns.shape}: {ns.max_tokens} output tokens per request, held-out prompts, T=0")
    rep.print_table(rows)
    rep.print_validity(report["rounds_ratios"], report["tau"])
    if rows:
        rep.plot(rows, os.path.splitext(path)[0] + ".png", f"{ns.shape} (inflated embedded pair)")
    print(f"done in {report['seconds']:.0f} s; wrote {path}")
    return 1 if any(r["failed"] for r in rows) else 0


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
    from ddtree.configs import TargetConfig

    return TargetConfig.from_path(default_model_paths()[0]).vocab_size


def report_drafter(ddir: str) -> dict:
    with open(os.path.join(ddir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
