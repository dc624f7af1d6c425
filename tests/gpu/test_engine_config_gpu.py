"""On the GPU: the engine's pools are the memory plan's (`plan_pools` for the loaded weights, the device's
total memory), and they fit in what is free."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    "flags",
    [
        (
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-ddtree-budget",
            "8",
            "--attention-backend",
            "triton",
        ),
        ("--speculative-algorithm", "DFLASH", "--attention-backend", "triton"),
    ],
)
def test_cuda_engine_allocates_the_plan(flags):
    from ddtree.config import prepare_server_args
    from ddtree.config.memory_plan import memory_plan
    from ddtree.engine.config import spec_config
    from ddtree.engine.setup import build_runner, device_bytes

    args = prepare_server_args(["--device", "cuda", "--mem-fraction-static", "0.3", *flags])
    dev = torch.device("cuda")
    plan = memory_plan(args, device_bytes=device_bytes(dev))
    runner, _ = build_runner(args, dev)
    assert runner.cfg.num_pages == runner.bm.num_pages == plan.num_pages
    assert runner.cfg.max_verify_width == plan.verify_width == spec_config(args).verify_width
    graph_width = getattr(runner.graphs, "n", None)  # the verify graphs' width, where captured
    assert graph_width in (None, plan.verify_width)


def test_cuda_graph_pool_is_within_the_plan():
    """The graph pool an engine captured (verify, draft, commit and extend graphs in one pool) is
    at most the memory plan's CUDA graph line for its resolved args."""
    from ddtree.engine.config import plan_pools
    from ddtree.engine.setup import device_bytes
    from ddtree.llm import LLM

    pytest.importorskip("triton")
    llm = LLM(
        device="cuda",
        attention_backend="triton",
        speculative_algorithm="DFLASH",
        mem_fraction_static=0.3,
        cuda_graph_max_bs=8,
    )
    graphs = llm.engine.runner.graphs
    planned = plan_pools(llm.args, device_bytes(torch.device("cuda")), 0, "cuda").graph_bytes
    try:
        assert graphs is not None and graphs.capture and planned > 0
        assert 0 < graphs.pool_bytes() <= planned, (graphs.pool_bytes(), planned)
    finally:
        llm.engine.runner.free_pools()
