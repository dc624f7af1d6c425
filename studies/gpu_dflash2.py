"""What a DFlash2 drafter costs per round against a DFlash one at production shapes (issue 42), on
one inflated target: `inflate_pair` widens the embedded target and its DFlash drafter to the shape,
and the DFlash2 source drafter is widened onto the same target (same plan, same taps).

Per shape and batch, rounds of the engine's decoder on the same prefilled requests (context
--context, KV trimmed back each round, CUDA graphs, bf16): DFLASH with each drafter, and DDTREE at
--budgets with each (DFlash2: the path-conditioned tree, and DDTree over its unary marginals).
Prints one table (median round ms, the draft phase = drafter block + LM head + chain / tree build,
verify, commit, emitted tokens) and the DFlash2 DFLASH round's overhead over DFlash's: the
convolutions and the selector must add <= 5%. JSON rows to --output.

    python3 studies/gpu_dflash2.py --shapes qwen3-8b,qwen3.6-27b --dflash2 DIR --output OUT.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddtree.bench.round_timing import Clock  # noqa: E402
from ddtree.bench.rounds import prefilled_requests, run_case, runner_config  # noqa: E402


def pair_for_shape(shape: str, src_target: str, dflash: str, dflash2: str, device, dtype):
    """(target, DFlash drafter, DFlash2 drafter) of `shape` on `device` in `dtype`."""
    from ddtree.models.configs import DrafterConfig, TargetConfig
    from ddtree.models.loader import load_drafter
    from ddtree.tools.inflate import inflate_pair
    from ddtree.tools.inflate.drafter import inflate_drafter
    from ddtree.tools.inflate.plan import plan_pair

    pair = inflate_pair(src_target, dflash, shape, device, dtype)
    src2 = load_drafter(dflash2, torch.float32, str(device))
    # planned from the source pair, as inflate_pair plans: the same target, carriers and taps
    plan = plan_pair(TargetConfig.from_path(src_target), src2.config, shape)
    d2 = inflate_drafter(
        src2,
        DrafterConfig.from_dict(plan.drafter_config),
        TargetConfig.from_dict(plan.target_config),
        plan.residual,
        device,
        dtype,
        pair.carriers,
    )
    del src2
    return pair.target, pair.drafter, d2


def cases(budgets: list[int]):
    yield "DFlash", "DFLASH", 0, None
    yield "DFlash2", "DFLASH", 0, None
    for b in budgets:
        yield "DFlash", "DDTREE", b, None
        yield "DFlash2", "DDTREE", b, "path"
        yield "DFlash2", "DDTREE", b, "marginal"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--shapes", default="qwen3-8b,qwen3.6-27b")
    p.add_argument("--dflash2", required=True, help="the DFlash2 source drafter (embedded target)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--budgets", default="32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--time-budget-s", type=float, default=0, help="skip cases past this; 0: none")
    p.add_argument("--output", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (fp32, no graphs)")
    ns = p.parse_args(argv)
    device = torch.device(ns.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from ddtree.assets import default_model_paths
    from ddtree.engine.model_runner import ModelRunner
    from ddtree.engine.round.decoder import SpecConfig

    t0 = time.perf_counter()
    src_t, src_d = default_model_paths()
    batches = [int(x) for x in ns.batches.split(",") if x]
    budgets = [int(x) for x in ns.budgets.split(",") if x]
    rows, clock = [], Clock(device)
    print(
        f"{'shape':>12} {'bs':>3} {'drafter':>8} {'algo':>7} {'tree':>8} {'B':>3} {'round ms':>9} "
        f"{'draft':>7} {'verify':>7} {'commit':>7} {'emitted':>7}",
        flush=True,
    )
    for shape in ns.shapes.split(","):
        target, d1, d2 = pair_for_shape(shape, src_t, src_d, ns.dflash2, device, dtype)
        hybrid = target.config.is_hybrid
        for bs in batches:
            for name, algo, budget, tree in cases(budgets):
                if ns.time_budget_s and time.perf_counter() - t0 > ns.time_budget_s:
                    print(f"time budget reached: skipping the rest of {shape}", flush=True)
                    break
                drafter = d2 if name == "DFlash2" else d1
                opts = SimpleNamespace(
                    block_size=drafter.config.block_size,
                    page_size=16,
                    attention_backend="triton" if device.type == "cuda" else "torch",
                    disable_cuda_graph=False,
                    mamba_strategy="no_buffer" if hybrid else None,
                )
                cfg = runner_config(algo, budget, bs, ns.context, opts, device)
                if name == "DFlash2":  # the drafter is reused: its tree, not the env's
                    drafter.marginal_tree = tree == "marginal"
                runner = ModelRunner(target, drafter, cfg, device, dtype)
                reqs = prefilled_requests(runner, bs, ns.context, target.config.vocab_size, 2048, 0)
                spec = SpecConfig(algo, drafter.config.block_size, budget, budget, False)
                r = run_case(runner, spec, reqs, ns.context, ns.rounds, ns.warmup, clock)
                ph = r["phases_ms"]
                row = dict(shape=shape, batch=bs, drafter=name, algorithm=algo, tree=tree)
                row.update(budget=budget or None, **r)
                rows.append(row)
                print(
                    f"{shape:>12} {bs:>3} {name:>8} {algo:>7} {tree or '-':>8} {budget or '-':>3} "
                    f"{r['ms']:>9.3f} {ph['draft'] + ph['tree']:>7.3f} {ph['verify']:>7.3f} "
                    f"{ph['commit']:>7.3f} {r['emitted_mean']:>7.2f}",
                    flush=True,
                )
                del runner, reqs
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        for bs in batches:
            base = [x for x in rows if x["shape"] == shape and x["batch"] == bs]
            one = {x["drafter"]: x for x in base if x["algorithm"] == "DFLASH"}
            if len(one) == 2:
                a, b = one["DFlash"], one["DFlash2"]
                da = a["phases_ms"]["draft"] + a["phases_ms"]["tree"]
                db = b["phases_ms"]["draft"] + b["phases_ms"]["tree"]
                over = 100 * (b["ms"] - a["ms"]) / a["ms"]
                verdict = "OK (<= 5%)" if over <= 5 else "OVER 5%"
                print(
                    f"{shape} bs={bs}: DFLASH round DFlash2 {b['ms']:.3f} ms vs DFlash {a['ms']:.3f} "
                    f"ms: {over:+.1f}% ({verdict}); draft phase {db:.3f} vs {da:.3f} ms "
                    f"({db - da:+.3f} ms)",
                    flush=True,
                )
        del target, d1, d2
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if ns.output:
        with open(ns.output, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
