"""Where a round's time goes on the GPU (issue 4): torch.profiler over engine rounds of the Qwen3-8B-shaped random
pair, plus the GEMM chain alone (separate vs fused q|k|v and gate|up projections) replayed from CUDA graphs.

    python3 studies/gpu_profile_round.py            # H200, about 2 minutes
    python3 studies/gpu_profile_round.py --context 16384 --cases DDTREE:64:1 --skip-gemm-chain --rounds 5
    python3 studies/gpu_profile_round.py --shape qwen3.6-27b --skip-gemm-chain \
        --cases NONE:0:1,DDTREE:64:1:extra_buffer,DDTREE:64:1:no_buffer,DDTREE:64:8,DDTREE:64:1::16384
A case is ALGO:budget:batch[:strategy[:context]][@VAR=VALUE[+VAR=VALUE...]] (strategy: the hybrid
state commit, default extra_buffer; context: default --context; after @, environment switches set for
that case only, e.g. DDTREE_DISABLE=pdl+DDTREE_REFERENCE=tree_build: ddtree/envs.py).
--shape as `ddtree bench rounds` (the hybrid shape builds
its random pair on the GPU; its GEMM chain is not modelled here: pass --skip-gemm-chain).
Prints, per case: wall ms/round, GPU kernel ms/round (busy), the top kernels, and the GEMM-only floor ratios.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ddtree.bench.cuda_timing import time_graph
from ddtree.bench.random_pair import (
    QWEN3_8B,
    build_pair,
    pair_configs,
    read_bytes,
    shape_configs,
)
from ddtree.bench.rounds import measure_floor, prefilled_requests, runner_config
from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.round.decoder import SpecConfig, SpecDecoder


def profile_case(target, drafter, algo, budget, batch, context, rounds, top, strategy):
    ns = SimpleNamespace(
        block_size=16,
        page_size=16,
        attention_backend="triton",
        disable_cuda_graph=False,
        mamba_strategy=strategy or "extra_buffer",
    )
    cfg = runner_config(algo, budget, batch, context, ns, torch.device("cuda"))
    runner = ModelRunner(target, drafter if algo != "NONE" else None, cfg, "cuda", torch.bfloat16)
    reqs = prefilled_requests(runner, batch, context, target.config.vocab_size, 4096, 0)
    dec = SpecDecoder(runner, SpecConfig(algo, 16, budget, budget, algo == "DDTREE"))

    def one_round():
        out = dec.round(reqs, cfg.max_context)
        for r, toks in zip(reqs, out):
            r.kv_len = context
            runner.release(r, context)
            r.output_ids[-1] = toks[-1]

    for _ in range(5):
        one_round()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        one_round()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / rounds
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            one_round()
        torch.cuda.synchronize()
    events = [
        e
        for e in prof.key_averages()
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0
    ]
    kern = sorted(
        (
            (e.key, e.self_device_time_total / 1e3 / rounds, e.count / rounds)
            for e in events
            if e.self_device_time_total > 0
        ),
        key=lambda x: -x[1],
    )
    busy = sum(k[1] for k in kern)
    name = f"{algo}{'' if algo == 'NONE' else ' B=' + str(budget)} b{batch} ctx{context}"
    if target.config.is_hybrid:
        name += f" {ns.mamba_strategy}"
    print(
        f"\n== {name}: wall {wall:.3f} ms/round, GPU kernels {busy:.3f} ms/round ({100 * busy / wall:.0f}% busy), "
        f"{sum(k[2] for k in kern):.0f} kernel launches/round"
    )
    for key, ms, n in kern[:top]:
        print(f"   {ms:8.3f} ms  {n:6.1f}x  {key[:110]}")
    del runner, reqs, dec
    torch.cuda.empty_cache()
    return dict(name=name, wall_ms=wall, gpu_ms=busy, launches=sum(k[2] for k in kern))


def gemm_chain(target, m, fused):
    """The 36 layers' projections only (no attention, norms or activations), as one CUDA graph."""
    ws = []
    for layer in target.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        if fused:  # the model's own fused weights
            ws.append(
                [a.qkv_proj.weight, a.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
            )
        else:  # HF's separate projections: row views of the fused weights (contiguous)
            qkv = list(a.qkv_proj.weight.split([a.q_size, a.kv_size, a.kv_size]))
            gu = list(mlp.gate_up_proj.weight.split([mlp.inter, mlp.inter]))
            ws.append(qkv + [a.o_proj.weight] + gu + [mlp.down_proj.weight])
    h = target.config.hidden_size
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    xo = torch.randn(
        m,
        target.config.num_attention_heads * target.config.head_dim,
        device="cuda",
        dtype=torch.bfloat16,
    )
    xd = torch.randn(m, target.config.intermediate_size, device="cuda", dtype=torch.bfloat16)

    def run():
        for w in ws:
            if fused:
                x @ w[0].t(), xo @ w[1].t(), x @ w[2].t(), xd @ w[3].t()
            else:
                for j in range(3):
                    x @ w[j].t()
                xo @ w[3].t(), x @ w[4].t(), x @ w[5].t(), xd @ w[6].t()
        x @ target.lm_head.weight.t()

    sec = time_graph(run, reps=20)
    nbytes = (
        sum(t.numel() * t.element_size() for w in ws for t in w) + target.lm_head.weight.numel() * 2
    )
    del ws
    torch.cuda.empty_cache()
    return sec * 1e3, nbytes


def table(rows, floor_ms: float) -> list[str]:
    """Markdown rows: case, switches, wall ms/round, x floor, GPU ms, launches."""
    out = [
        f"| case | switches | wall ms/round | x floor {floor_ms:.2f} | GPU ms | launches |",
        "|---|---|---|---|---|---|",
    ]
    for rec, env_part in rows:
        if rec.get("wall_ms") is None:
            out.append(f"| {rec['name']} | {env_part or '-'} | OOM | | | |")
            continue
        out.append(
            f"| {rec['name']} | {env_part or '-'} | {rec['wall_ms']:.2f} | "
            f"{rec['wall_ms'] / floor_ms:.2f}x | {rec['gpu_ms']:.2f} | {rec['launches']:.0f} |"
        )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(
        allow_abbrev=False,
    )
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument(
        "--cases",
        default="NONE:0:1,DDTREE:64:1,DFLASH:0:1,DDTREE:64:8",
        help="comma-separated ALGO:budget:batch",
    )
    p.add_argument("--skip-gemm-chain", action="store_true")
    p.add_argument(
        "--shape", default=None, help="as `ddtree bench rounds --shape` (default qwen3-8b)"
    )
    ns = p.parse_args(argv)
    if ns.shape and ns.shape != "qwen3-8b":
        tcfg, dcfg = shape_configs(ns.shape, 5, 16, "bfloat16", False)
    else:
        tcfg, dcfg = pair_configs(QWEN3_8B, 5, 16, "bfloat16")
    target, drafter = build_pair(tcfg, dcfg, torch.device("cuda"), torch.bfloat16, 0)
    floor = measure_floor(target, drafter, torch.device("cuda"), 2048 << 20)
    bw = floor["bandwidth_Bps"]
    print(
        f"floor {floor['floor_ms']:.3f} ms ({read_bytes(target) / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s)"
    )
    print("GEMM chain alone (36 layers' projections + LM head), CUDA graph:")
    for m in () if ns.skip_gemm_chain else (1, 8, 65, 520):
        for fused in (False, True):
            ms, nbytes = gemm_chain(target, m, fused)
            print(
                f"   M={m:4d} {'fused q|k|v, gate|up' if fused else 'separate          '}  {ms:7.3f} ms "
                f"= {ms / (nbytes / bw * 1e3):.2f}x its weight-read floor"
            )
    rows = []
    # cases split at commas that start a new ALGO: a switch's value may hold commas itself
    # (a list of tiles, say)
    for case in re.split(r",(?=(?:NONE|DFLASH|DDTREE):)", ns.cases):
        spec, _, env_part = case.partition("@")
        algo, budget, batch, strategy, context = (spec.split(":") + ["", ""])[:5]
        ctx = int(context or ns.context)
        env = dict(kv.split("=", 1) for kv in env_part.split("+") if kv)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            rec = profile_case(
                target, drafter, algo, int(budget), int(batch), ctx, ns.rounds, ns.top, strategy
            )
            rows.append((rec, env_part))
            print(table(rows[-1:], floor["floor_ms"])[-1], flush=True)  # grep '^|' if cut short
        except torch.OutOfMemoryError as e:  # e.g. extra_buffer's fp32 stash at batch 8, 27B
            print(f"\n== {case}: out of memory ({str(e)[:120]}); next case", flush=True)
            rows.append((dict(name=spec, wall_ms=None), env_part))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        gc.collect()  # the failed case's runner goes with its traceback
        torch.cuda.empty_cache()
    print("\n" + "\n".join(table(rows, floor["floor_ms"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
