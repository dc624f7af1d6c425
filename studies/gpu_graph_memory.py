"""The CUDA graph pool against the memory plan's line for it (issue 56), on the GPU.

For each case (shape, algorithm, budget, largest captured batch) an engine is built on the inflated
pair (`inflate:<shape>`, bf16, CUDA graphs captured at construction) and the graph pool's bytes
(`CudaGraphRunner.pool_bytes`) are printed beside the plan's line for them (`PoolPlan.graph_bytes`,
`engine.config.planned_graph_bytes` of the engine's resolved args) and the device memory in use.
One JSON row per case in --out.

    python3 studies/gpu_graph_memory.py --cases qwen3-8b:DFLASH:-:64,qwen3-8b:DDTREE:auto:64
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch


def measure(shape: str, algorithm: str, budget: str, bs: int, fraction: float) -> dict:
    from ddtree.engine.config import planned_graph_bytes
    from ddtree.llm import LLM

    kw = dict(
        max_running_requests=bs,
        cuda_graph_max_bs=bs,
        disable_radix_cache=True,
        mem_fraction_static=fraction,
    )
    if algorithm != "NONE":
        kw["speculative_algorithm"] = algorithm
    if algorithm == "DDTREE" and budget != "-":
        kw["speculative_ddtree_budget"] = int(budget) if budget.isdigit() else budget
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    llm = LLM(f"inflate:{shape}", **kw)
    built = time.perf_counter() - t0
    runner = llm.engine.runner
    pool = runner.graphs.pool_bytes() if runner.graphs is not None else 0
    row = {
        "shape": shape,
        "algorithm": algorithm,
        "budget": budget,
        "max_bs": bs,
        "verify_widths": list(runner.cfg.verify_widths or (runner.cfg.max_verify_width,)),
        "graph_pool_bytes": pool,
        "planned_graph_bytes": planned_graph_bytes(llm.args, "cuda"),
        "reserved_bytes": torch.cuda.memory_reserved() - base,
        "build_s": round(built, 1),
    }
    runner.free_pools()
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--cases", required=True, help="shape:ALGORITHM:budget:max_bs, comma-separated")
    p.add_argument("--out", default="graph_memory.json")
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    ns = p.parse_args()
    rows = []
    print(f"{'case':40s} {'pool GiB':>9s} {'planned':>8s} {'reserved':>9s} {'build s':>8s}")
    for case in ns.cases.split(","):
        shape, algorithm, budget, bs = case.split(":")
        try:
            row = measure(shape, algorithm, budget, int(bs), ns.mem_fraction_static)
        except Exception as e:  # noqa: BLE001 - one case's failure is reported, the rest run
            print(f"{case:40s} FAILED: {type(e).__name__}: {str(e)[:300]}")
            rows.append({"case": case, "error": str(e)[:2000]})
            gc.collect()
            torch.cuda.empty_cache()
            continue
        rows.append(row)
        planned = row["planned_graph_bytes"]
        print(
            f"{case:40s} {row['graph_pool_bytes'] / 2**30:9.3f} "
            f"{'-' if planned is None else f'{planned / 2**30:8.3f}'} "
            f"{row['reserved_bytes'] / 2**30:9.2f} {row['build_s']:8.1f}",
            flush=True,
        )
        with open(ns.out, "w") as f:
            json.dump(rows, f, indent=1)
    with open(ns.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
