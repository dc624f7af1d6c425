"""`ddtree bench rounds`: per-round cost of AR, DFLASH and DDTREE on a random-weight Qwen3-8B-shaped pair,
as a ratio to the memory floor measured in the same run (target read bytes / device copy bandwidth), with
the stage split, plus rounds with forced accept lengths (random weights accept nothing).

Rounds go through ModelRunner + SpecDecoder exactly as the engine runs them. Every round starts at the stated
context: after a round each request is trimmed back to it, so KV never grows. The rows, the table, the target
checks and the plot are `ddtree/bench/rounds_report.py`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

from ddtree.bench.rounds_report import (
    PHASES,
    add_vs_batch1,
    make_row,
    plot,
    print_checks,
    print_header,
    print_row,
    target_checks,
)


def make_parser() -> argparse.ArgumentParser:
    from ddtree.bench.cli import DefaultsFormatter

    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="ddtree bench rounds", formatter_class=DefaultsFormatter
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU; finishes in seconds"
    )
    p.add_argument(
        "--shape",
        default=None,
        help="qwen3-8b (default), qwen3.6-27b (hybrid) or a config.json (`ddtree "
        "inflate` shapes); with --smoke a hybrid shape gives a tiny hybrid pair",
    )
    p.add_argument("--batch-sizes", default="1,8", help="comma list of batch sizes")
    p.add_argument("--budgets", default="16,64,256", help="DDTREE budgets")
    p.add_argument(
        "--context", default=None, help="comma list of context lengths (default 1024; smoke 64)"
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="timed rounds per config (default 50; smoke 3)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed rounds first (default 5; smoke 1)"
    )
    p.add_argument(
        "--accept-lengths",
        default="1,4,8,16",
        help="forced emitted tokens per round for DFLASH and DDTREE at --forced-budget, at the first "
        "context; empty: none",
    )
    p.add_argument(
        "--accept-trace",
        default=None,
        help="JSON list of emitted lengths per round to replay too (default: none)",
    )
    p.add_argument(
        "--forced-budget", type=int, default=64, help="DDTREE budget of the forced-accept rows"
    )
    p.add_argument("--drafter-layers", type=int, default=None, help="default 5; smoke 2")
    p.add_argument("--block-size", type=int, default=16, help="drafter block size")
    p.add_argument("--page-size", type=int, default=16, help="KV page size in tokens")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=2048,
        help="tokens per prefill call (default: %(default)s, as the engine)",
    )
    p.add_argument("--device", default="auto", help="auto = cuda when available (cpu with --smoke)")
    p.add_argument("--dtype", default=None, help="default bfloat16; smoke float32")
    p.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="fp8: both models' decoder linears in block FP8 (quantized after the random init, "
        "as --quantization fp8 at load); the floor counts the FP8 bytes",
    )
    p.add_argument("--attention-backend", default=None, help="default triton on GPU, torch on CPU")
    p.add_argument("--disable-cuda-graph", action="store_true", help="time eager rounds")
    p.add_argument(
        "--mamba-strategy",
        default=None,
        choices=("extra_buffer", "no_buffer"),
        help="hybrid targets: the state commit (default no_buffer, the server's: replay the accepted "
        "path; extra_buffer keeps a fp32 state per tree node: ~10 GB per request at the 27B shape, B=64)",
    )
    p.add_argument(
        "--copy-mib",
        type=int,
        default=None,
        help="copy size for the bandwidth (default 2048; smoke 16)",
    )
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=0,
        help="skip configs once this much time has passed; 0 = no limit",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--output", default=None, help="JSON rows; a PNG is written beside it (default: none)"
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument(
        "--peer-checkout",
        default=None,
        metavar="DIR",
        help="an outside checkout of liranringel/ddtree: time its DDTREE round (B = --forced-budget, "
        "batch 1, first context) on the same weights in this process, against ours "
        "(default: none)",
    )
    return p


def ints(s: str | None) -> list[int]:
    return [int(x) for x in (s or "").split(",") if x.strip()]


def runner_config(algo: str, budget: int, batch: int, context: int, ns, device):
    from ddtree.engine.config import RunnerConfig, pages_per_request, verify_width

    width = verify_width(algo, ns.block_size, budget)  # the engine's widths and page counts
    max_context = context + ns.block_size
    per_req = pages_per_request(max_context, width, ns.page_size)
    return RunnerConfig(
        page_size=ns.page_size,
        num_pages=batch * per_req + 4,
        max_running_requests=batch,
        max_context=max_context,
        block_size=ns.block_size,
        max_verify_width=width,
        attention_backend=ns.attention_backend,
        enable_cuda_graph=device.type == "cuda" and not ns.disable_cuda_graph,
        cuda_graph_max_bs=batch,
        # hybrid targets: the state commit (--mamba-strategy; gpu_profile_round.py sets it per case)
        mamba_strategy=getattr(ns, "mamba_strategy", None) or "no_buffer",
    )


def prefilled_requests(runner, n: int, context: int, vocab: int, chunk: int, seed: int):
    """n requests with `context` cached tokens and a random pending token. The first is prefilled from random
    tokens; the others get copies of its target and drafter KV (the same cost to attend, 1/n of the prefill)."""
    from ddtree.engine.scheduling.request import Req, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=1 << 30, ignore_eos=True)
    ids = torch.randint(0, vocab, (context + n,), generator=gen).tolist()
    reqs = [
        Req(prompt_ids=ids[:context], params=params, output_ids=[ids[context + i]])
        for i in range(n)
    ]
    for start in range(0, context, chunk):
        runner.prefill([reqs[0]], [min(chunk, context - start)])
    pos = torch.arange(context, device=runner.device)[None]
    src = runner.slots_of(runner.bm.block_table[reqs[0].slot][None], pos).flatten()
    for r in reqs[1:]:
        runner.bm.allocate(r, context)
        dst = runner.slots_of(runner.bm.block_table[r.slot][None], pos).flatten()
        for pool in (runner.kv, runner.draft_kv):
            if pool is not None:
                pool.move(src, dst)
        r.kv_len = context
    return reqs


def run_case(
    runner, spec, reqs, context: int, rounds: int, warmup: int, clock, override=None
) -> dict:
    """Median per-round time and stage split over `rounds` rounds after `warmup`; KV trimmed back each round."""
    from ddtree.bench.bench_decoder import BenchDecoder
    from ddtree.bench.round_timing import PhaseMarks, percentile

    marks = PhaseMarks(clock)
    decoder = BenchDecoder(runner, spec, times=marks, override=override)
    max_context = runner.cfg.max_context
    totals, phases, emitted = [], {p: [] for p in PHASES}, []
    for i in range(warmup + rounds):
        a = clock.mark()
        out = decoder.round(reqs, max_context)
        b = clock.mark()
        clock.sync()
        split = marks.take()
        for r, toks in zip(reqs, out):
            r.kv_len = context
            runner.release(r, context)
            r.output_ids[-1] = toks[-1]
        if i < warmup:
            continue
        totals.append(clock.ms(a, b))
        for p in PHASES:
            phases[p].append(split.get(p, 0.0))
        emitted.extend(len(t) for t in out)
    ms = statistics.median(totals)
    ph = {p: statistics.median(v) for p, v in phases.items()}
    return {
        "rounds": rounds,
        "ms": ms,
        "ms_p10": percentile(totals, 0.1),
        "ms_p90": percentile(totals, 0.9),
        "phases_ms": ph,
        "phases_pct": {p: 100 * v / ms for p, v in ph.items()},
        "tree_accept_pct": 100 * (ph["tree"] + ph["accept"]) / ms,
        "emitted_mean": sum(emitted) / len(emitted),
        "emitted_min": min(emitted),
        "emitted_max": max(emitted),
    }


def quantize_pair(target, drafter, tcfg, dcfg) -> None:
    """--quantization fp8: the layouts `--quantization fp8 --speculative-draft-quantization fp8`
    serve (every decoder linear but the GDN's b / a rows), quantized in place."""
    from ddtree.models import checkpoint as ckpt
    from ddtree.models.quant import quantize_model

    for model, shapes, linears in (
        (target, ckpt.target_linear_shapes(tcfg), ckpt.TARGET_LINEARS),
        (drafter, ckpt.drafter_linear_shapes(dcfg), ckpt.DRAFTER_LINEARS),
    ):
        quantize_model(model, ckpt.at_load_layout(shapes, linears, None))


def measure_floor(target, drafter, device, copy_bytes: int) -> dict:
    from ddtree.bench.random_pair import drafter_read_bytes, embedding_bytes, read_bytes
    from ddtree.bench.round_timing import copy_bandwidth

    bw = copy_bandwidth(device, copy_bytes)
    tb, db, eb = read_bytes(target), drafter_read_bytes(drafter, target), embedding_bytes(target)
    s = bw["bandwidth_Bps"]
    return {
        **bw,
        "target_read_bytes": tb,
        "floor_ms": tb / s * 1e3,
        "counted": "decoder layers + final norm + LM head (embedding left out: a forward reads only its rows)",
        "floor_with_embedding_ms": (tb + eb) / s * 1e3,
        "drafter_read_bytes": db,
        "draft_floor_ms": db / s * 1e3,
    }


def main(argv: list[str]) -> int:
    ns = make_parser().parse_args(argv)
    threads = torch.get_num_threads()
    if ns.smoke:
        torch.set_num_threads(1)  # tiny ops gain nothing from a second thread on a shared box
    try:
        return run(ns)
    finally:
        torch.set_num_threads(threads)


def run(ns) -> int:
    from ddtree.bench.forced_accept import AcceptTrace
    from ddtree.bench.random_pair import QWEN3_8B, SMOKE, build_pair, pair_configs, shape_configs
    from ddtree.bench.round_timing import Clock
    from ddtree.engine.model_runner import ModelRunner
    from ddtree.engine.round.decoder import SpecConfig
    from ddtree.models.layers import torch_dtype

    t_start = time.perf_counter()
    if ns.peer_checkout:  # a wrong path fails before any weights are built
        from ddtree.bench.peer import resolve_checkout

        resolve_checkout(ns.peer_checkout)
    smoke = ns.smoke
    device = torch.device(
        ("cpu" if smoke or not torch.cuda.is_available() else "cuda")
        if ns.device == "auto"
        else ns.device
    )
    ns.attention_backend = ns.attention_backend or ("triton" if device.type == "cuda" else "torch")
    dtype = torch_dtype(ns.dtype or ("float32" if smoke else "bfloat16"))
    contexts = ints(ns.context) or [64 if smoke else 1024]
    rounds = ns.rounds or (3 if smoke else 50)
    warmup = ns.warmup if ns.warmup is not None else (1 if smoke else 5)
    batches, budgets = ints(ns.batch_sizes), ints(ns.budgets)
    trace = None
    if ns.accept_trace:
        with open(ns.accept_trace, encoding="utf-8") as f:
            trace = [int(x) for x in json.load(f)]
    forced = [[k] for k in ints(ns.accept_lengths)] + ([trace] if trace else [])
    torch.manual_seed(ns.seed)

    if ns.shape and ns.shape != "qwen3-8b":
        tcfg, dcfg = shape_configs(
            ns.shape, ns.drafter_layers, ns.block_size, str(dtype).removeprefix("torch."), smoke
        )
    else:
        tcfg, dcfg = pair_configs(
            SMOKE if smoke else QWEN3_8B,
            ns.drafter_layers or (2 if smoke else 5),
            ns.block_size,
            str(dtype).removeprefix("torch."),
        )
    if not tcfg.is_hybrid and ns.mamba_strategy is not None:
        raise SystemExit(
            f"--mamba-strategy {ns.mamba_strategy} applies to hybrid targets only (e.g. --shape "
            "qwen3.6-27b); drop it for this shape"
        )
    target, drafter = build_pair(tcfg, dcfg, device, dtype, ns.seed)
    if ns.quantization == "fp8":
        quantize_pair(target, drafter, tcfg, dcfg)
    floor = measure_floor(target, drafter, device, (ns.copy_mib or (16 if smoke else 2048)) << 20)
    clock = Clock(device)
    print(
        f"device {device}, {dtype}{' + block FP8' if ns.quantization else ''}, backend "
        f"{ns.attention_backend}; target {tcfg.num_hidden_layers}L "
        f"h{tcfg.hidden_size} V{tcfg.vocab_size}, drafter {dcfg.num_hidden_layers}L taps {dcfg.target_layer_ids}"
    )
    print(
        f"floor {floor['floor_ms']:.3f} ms = {floor['target_read_bytes'] / 1e9:.3f} GB ({floor['counted']}) / "
        f"{floor['bandwidth_Bps'] / 1e12:.3f} TB/s ({floor['convention']}); with embedding "
        f"{floor['floor_with_embedding_ms']:.3f} ms; drafter+LM head {floor['draft_floor_ms']:.3f} ms",
        flush=True,
    )

    # the order is the priority under --time-budget-s; forced DDTREE rows ride on the --forced-budget runner
    first = [b for b in budgets if b == ns.forced_budget][:1]
    runners = (
        [("NONE", 0)]
        + [("DDTREE", b) for b in first]
        + [("DFLASH", 0)]
        + [("DDTREE", b) for b in budgets if b not in first]
    )
    rows = []
    meta = {
        "device": str(device),
        "dtype": str(dtype),
        "quantization": ns.quantization,
        "attention_backend": ns.attention_backend,
        "cuda_graph": False,
        "target": {
            k: getattr(tcfg, k)
            for k in ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size")
        },
        "drafter_layers": dcfg.num_hidden_layers,
        "taps": list(dcfg.target_layer_ids),
        "floor": floor,
    }
    print_header()
    for context in contexts:
        for algo, budget in runners:
            cases = [(b, None) for b in batches]
            if (
                algo != "NONE"
                and context == contexts[0]
                and (algo == "DFLASH" or budget == ns.forced_budget)
            ):
                cases += [(b, tr) for tr in forced for b in batches]
            if _over(ns, t_start):
                rows += [
                    make_row(context, algo, budget, b, tr, skipped="time budget") for b, tr in cases
                ]
                continue
            t0 = time.perf_counter()
            rcfg = runner_config(algo, budget, max(batches), context, ns, device)
            runner = ModelRunner(target, drafter if algo != "NONE" else None, rcfg, device, dtype)
            graphs = getattr(runner, "graphs", None) is not None
            meta["cuda_graph"] = meta["cuda_graph"] or graphs
            t1 = time.perf_counter()
            reqs = prefilled_requests(
                runner, max(batches), context, tcfg.vocab_size, ns.prefill_chunk, ns.seed
            )
            clock.sync()
            print(
                f"# {make_row(context, algo, budget, 0, None)['config']} ctx {context}: runner {t1 - t0:.1f} s "
                f"(cuda graphs {'on' if graphs else 'off'}), prefill {time.perf_counter() - t1:.1f} s",
                flush=True,
            )
            for batch, tr in cases:
                if _over(ns, t_start):
                    rows.append(make_row(context, algo, budget, batch, tr, skipped="time budget"))
                    continue
                spec = SpecConfig(
                    algorithm=algo,
                    block_size=ns.block_size,
                    budget=max(budget, 1),
                    topk_cap=min(max(budget, 1), tcfg.vocab_size),
                    shadow_linear=tr is not None,
                )
                override = AcceptTrace(tr, device) if tr else None
                res = run_case(runner, spec, reqs[:batch], context, rounds, warmup, clock, override)
                row = make_row(
                    context,
                    algo,
                    budget,
                    batch,
                    tr,
                    **res,
                    x_floor=res["ms"] / floor["floor_ms"],
                    x_floor_with_embedding=res["ms"] / floor["floor_with_embedding_ms"],
                    cuda_graph=graphs,
                    verify_tokens=batch * rcfg.max_verify_width,
                )
                rows.append(row)
                print_row(row)
            for r in reqs:
                runner.release(r)
            del runner, reqs
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    add_vs_batch1(rows)
    if ns.peer_checkout:
        meta["peer"] = vs_peer(ns, target, drafter, contexts[0], rounds, device, rows)
    # the targets are about the Qwen3-8B shape
    checks = [] if smoke or ns.shape not in (None, "qwen3-8b") else target_checks(rows)
    print_checks(checks)
    meta["seconds"] = time.perf_counter() - t_start
    print(f"done in {meta['seconds']:.1f} s")
    if ns.output:
        with open(ns.output, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "floor": floor, "rows": rows, "checks": checks}, f, indent=1)
        print(f"wrote {ns.output}")
        if not ns.no_plot:
            plot(rows, floor, os.path.splitext(ns.output)[0] + ".png")
    return 0


def vs_peer(ns, target, drafter, context: int, rounds: int, device, rows: list[dict]) -> dict:
    """The paper's code on the same weights (ddtree/bench/peer.py) against our unforced DDTREE row, batch 1."""
    from ddtree.bench.peer import peer_round_ms

    res = peer_round_ms(
        ns.peer_checkout, target, drafter, context, ns.forced_budget, min(rounds, 20), device
    )
    res.pop("output_ids", None)
    ours = next(
        (
            r["ms"]
            for r in rows
            if r.get("ms")
            and r["context"] == context
            and r["batch"] == 1
            and r["config"] == f"DDTREE B={ns.forced_budget}"
            and r["forced_accept"] is None
        ),
        None,
    )
    res["ours_ms"] = ours
    res["speedup"] = res["ms"] / ours if ours else None
    print(
        f"peer (liranringel/ddtree) DDTREE B={ns.forced_budget} b1 ctx {context}: {res['ms']:.2f} ms/round "
        f"(p10 {res['ms_p10']:.2f}); ours {ours if ours is None else f'{ours:.2f}'} ms"
        + (f" -> {res['speedup']:.1f}x faster" if ours else ""),
        flush=True,
    )
    return res


def _over(ns, t_start: float) -> bool:
    return bool(ns.time_budget_s) and time.perf_counter() - t_start > ns.time_budget_s
