"""The CUDA graph pool is a line of the memory plan (issue 56): the static pool's bytes it takes
come out of what KV and state get, a plan that the graphs tip over is refused naming the flags
that shrink them, and the line bounds the pools measured on an H100."""

import dataclasses
import json
import pathlib

from ddtree.config.args import ServerArgs
from ddtree.config.memory_plan import memory_plan
from ddtree.config.resolve import resolve_server_args
from ddtree.engine.config import plan_pools
from ddtree.models.weight_bytes import rank_weight_bytes

GIB = 2**30
MEASURED = pathlib.Path(__file__).resolve().parent.parent / "docs/results"
MEASURED = MEASURED / "graph_memory_h100_2026-12-06.json"


def inflated_8b(algorithm="DFLASH", max_bs=64, budget=None, graph_bs=None) -> ServerArgs:
    """The study's engine (studies/gpu_graph_memory.py) planned for a GPU (resolving is
    torch-free), with its graphs on: on a host without triton a cuda plan resolves with the torch
    backend and no graphs."""
    kw = {} if budget is None else {"speculative_ddtree_budget": budget}
    args = resolve_server_args(
        ServerArgs(
            model_path="inflate:qwen3-8b",
            device="cuda",
            max_running_requests=max_bs,
            cuda_graph_max_bs=graph_bs or max_bs,
            disable_radix_cache=True,
            speculative_algorithm=algorithm,
            **kw,
        )
    )
    return dataclasses.replace(
        args,
        attention_backend="triton",
        disable_cuda_graph=False,
        cuda_graph_max_bs=graph_bs or max_bs,
    )


def without_graphs(args) -> ServerArgs:
    return dataclasses.replace(args, disable_cuda_graph=True, cuda_graph_max_bs=None)


def weights(args) -> int:
    return rank_weight_bytes(args.target_config, args.drafter_config, 1, args.dtype, (None, None))


def test_graph_line_is_none_without_graphs_and_grows_with_the_captured_batch():
    args = inflated_8b(max_bs=256)
    w = weights(args)
    assert plan_pools(args, 80 * GIB, w, "cpu").graph_bytes == 0  # graphs only on CUDA
    off = without_graphs(args)
    assert plan_pools(off, 80 * GIB, w, "cuda").graph_bytes == 0
    sizes = [
        plan_pools(inflated_8b(max_bs=256, graph_bs=bs), 80 * GIB, w, "cuda").graph_bytes
        for bs in (1, 16, 64, 256)
    ]
    assert 0 < sizes[0] < sizes[1] < sizes[2] < sizes[3]
    plan = memory_plan(args, device_bytes=80 * GIB)
    assert plan.graph_bytes == sizes[3]
    # KV gets what the weights, verify buffers and graphs leave (a dense target: no state pool)
    assert plan.kv_room_bytes == (
        plan.static_bytes - plan.weight_bytes_per_device - plan.workspace_bytes - sizes[3]
    )
    assert f"CUDA graphs          pool at batch 256: {sizes[3] / GIB:.2f} GiB" in plan.format()
    assert "CUDA graphs          none (--disable-cuda-graph)" in (
        memory_plan(off, device_bytes=80 * GIB).format()
    )


def test_a_plan_the_graphs_tip_over_is_refused_naming_their_flags():
    args = inflated_8b(max_bs=64)
    plan = plan_pools(args, 80 * GIB, 0, "cuda")
    # weights that fill the static pool but for half the graph pool
    w = plan.static_bytes - plan.workspace_bytes - plan.graph_bytes // 2
    why = plan_pools(args, 80 * GIB, w, "cuda").refusal()
    assert why is not None and "CUDA graphs" in why, why
    assert "--cuda-graph-max-bs" in why and "--disable-cuda-graph" in why
    assert plan_pools(without_graphs(args), 80 * GIB, w, "cuda").refusal() is None


def test_graph_line_bounds_the_pools_measured_on_an_h100():
    """Never under a measured pool, and not far over it (1.5 x + 256 MiB)."""
    rows = json.loads(MEASURED.read_text())
    assert len(rows) == 4
    for row in rows:
        budget = None if row["budget"] == "-" else row["budget"]
        args = inflated_8b(row["algorithm"], row["max_bs"], budget)
        assert list(args.spec.verify_widths) == row["verify_widths"]
        planned = plan_pools(args, 80 * GIB, weights(args), "cuda").graph_bytes
        measured = row["graph_pool_bytes"]
        assert measured <= planned <= 1.5 * measured + 256 * 2**20, (row, planned)
