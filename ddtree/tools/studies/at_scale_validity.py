"""Validity of the inflated pair as a stand-in for a trained production pair, in the at-scale run:
per-round cost of the inflated target against a random-weight target of the same shape (`bench
rounds`' runner and clock), and τ of the inflated pair against the small pair on the same prompts.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch


def time_pair(
    label: str,
    target,
    drafter,
    vocab: int,
    batches: list[int],
    context: int,
    rounds: int,
    warmup: int,
    device,
    attention_backend: str,
    cuda_graph: bool,
    budget: int = 64,
) -> list[dict]:
    """ms per round (median) of NONE / DFLASH / DDTREE B=budget at each batch, as `bench rounds`
    times them (contexts of random tokens below `vocab`)."""
    from ddtree.bench.round_timing import Clock
    from ddtree.bench.rounds import prefilled_requests, run_case, runner_config
    from ddtree.engine.config import SpecConfig
    from ddtree.engine.model_runner import ModelRunner

    ns = argparse.Namespace(
        block_size=drafter.config.block_size,
        page_size=16,
        attention_backend=attention_backend,
        disable_cuda_graph=not cuda_graph,
    )
    dtype = next(target.parameters()).dtype
    clock, rows = Clock(device), []
    for algo, budget in (("NONE", 0), ("DFLASH", 0), ("DDTREE", budget)):
        runner = ModelRunner(
            target,
            drafter if algo != "NONE" else None,
            runner_config(algo, budget, max(batches), context, ns, device),
            device,
            dtype,
        )
        reqs = prefilled_requests(runner, max(batches), context, vocab, 2048, 0)
        for batch in batches:
            spec = SpecConfig(
                algorithm=algo,
                block_size=ns.block_size,
                budget=max(budget, 1),
                topk_cap=max(budget, 1),
                shadow_linear=False,
            )
            res = run_case(runner, spec, reqs[:batch], context, rounds, warmup, clock)
            rows.append(
                {
                    "pair": label,
                    "config": algo if algo != "DDTREE" else f"DDTREE B={budget}",
                    "batch": batch,
                    "context": context,
                    "ms": res["ms"],
                    "ms_p10": res["ms_p10"],
                    "ms_p90": res["ms_p90"],
                    "emitted_mean": res["emitted_mean"],
                }
            )
            print(
                f"# rounds {label:>8} {rows[-1]['config']:>12} b{batch}: {res['ms']:.2f} ms",
                flush=True,
            )
        for r in reqs:
            runner.release(r)
        del runner, reqs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def random_rounds(shape, dcfg_dict: dict, kw: dict) -> list[dict]:
    """The same timing on a random-weight pair of the inflated `shape` (dense or hybrid, built on the
    device; `random_pair.shape_configs`)."""
    from ddtree.bench.random_pair import build_pair, shape_configs

    device = kw["device"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = str(dtype).removeprefix("torch.")
    rcfg, rdcfg = shape_configs(
        shape, dcfg_dict["num_hidden_layers"], dcfg_dict["block_size"], name
    )
    target, drafter = build_pair(rcfg, rdcfg, device, dtype)
    try:
        return time_pair("random", target, drafter, rcfg.vocab_size, **kw)
    finally:
        del target, drafter
        gc.collect()


def rounds_ratios(rows: list[dict]) -> list[dict]:
    """inflated / random per (config, batch): the ±5% check of issue 18."""
    rand = {(r["config"], r["batch"]): r["ms"] for r in rows if r["pair"] == "random"}
    out = []
    for r in rows:
        if r["pair"] == "inflated" and (r["config"], r["batch"]) in rand:
            ratio = r["ms"] / rand[(r["config"], r["batch"])]
            out.append(
                {
                    "config": r["config"],
                    "batch": r["batch"],
                    "inflated_ms": r["ms"],
                    "random_ms": rand[(r["config"], r["batch"])],
                    "ratio": ratio,
                    "within_5pct": abs(ratio - 1) <= 0.05,
                }
            )
    return out


def small_pair_tau(
    prompts: list, max_tokens: int, configs: list, device: str, drafter: str | None = None
) -> dict:
    """τ (tokens per round, weighted by rounds) of the embedded pair, offline, T=0, bf16 on GPU, for
    each served `ServeConfig` (its algorithm and budget): {"tau", "se" (standard error of the mean
    per-prompt τ), "per_prompt"}. `drafter`: the small drafter the served pair was inflated from
    (default: the embedded one)."""
    from ddtree import LLM, SamplingParams
    from ddtree.assets import default_model_paths

    t, d = default_model_paths()
    d = drafter or d
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    dtype = "bfloat16" if device == "cuda" else "float32"
    out = {}
    for cfg in configs:
        budget = cfg.budget
        kw = {}
        if budget is not None:
            kw["speculative_ddtree_budget"] = int(budget) if budget.isdigit() else budget
        llm = LLM(
            t,
            speculative_algorithm=cfg.algorithm,
            speculative_draft_model_path=d,
            device=device,
            dtype=dtype,
            disable_cuda_graph=True,
            max_running_requests=8,
            **kw,
        )
        outs = llm.generate(list(prompts), params)
        lengths = [n for o in outs for n in o.accept_lengths]
        # per distinct prompt (the level cycles the held-out set): the sampling error of a τ over
        # this few texts, against which an inflated-vs-small difference is judged
        per = {p: o.mean_accept_length for p, o in zip(prompts, outs)}
        vals = list(per.values())
        se = statistics.stdev(vals) / len(vals) ** 0.5 if len(vals) > 1 else None
        out[cfg.name] = {"tau": sum(lengths) / max(len(lengths), 1), "se": se, "per_prompt": vals}
        del llm
        gc.collect()
    return out
