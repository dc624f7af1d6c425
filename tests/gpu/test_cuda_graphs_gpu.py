"""CUDA graphs vs eager on the device, on the embedded pair: token-identical outputs for greedy AR
(NONE), DFLASH and DDTREE, fp32 and bf16, batch 1 and a ragged batch of 5, and the graph path really
replayed (verify; for DFLASH / DDTREE the fused draft -> tree and the in-graph accept walk).
Formerly the check of studies/gpu_cuda_graphs.py, which now only times."""

import inspect

import pytest
import torch
from engine_utils import mean_accept

pytestmark = pytest.mark.gpu

MAX_TOKENS = 32
ALGOS = [("NONE", None), ("DFLASH", None), ("DDTREE", 16)]


def _prompts(llm, n):
    import argparse
    import json.decoder
    import statistics
    import textwrap

    lengths = [17, 40, 9, 63, 28][:n]
    srcs = [inspect.getsource(m) for m in (textwrap, json.decoder, statistics, argparse, textwrap)]
    return [
        llm.tokenizer.encode(s[200 * i :], add_special_tokens=False)[:k]
        for i, (s, k) in enumerate(zip(srcs, lengths))
    ]


def _count_replays(graphs, counts):
    for name in ("verify", "draft_tree"):
        fn = getattr(graphs, name)

        def counted(*a, _fn=fn, _name=name):
            out = _fn(*a)
            counts[_name] = counts.get(_name, 0) + 1
            if _name == "verify" and out[3] is not None:
                counts["accept"] = counts.get("accept", 0) + 1
            return out

        setattr(graphs, name, counted)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algo,budget", ALGOS)
def test_graphs_match_eager(pair, dtype, algo, budget):
    from ddtree import LLM, SamplingParams

    pytest.importorskip("triton")
    target, drafter = pair
    kw = dict(
        dtype=dtype,
        device="cuda",
        attention_backend="triton",
        cuda_graph_max_bs=8,
        max_running_requests=8,
        context_length=2048,
        max_total_tokens=8 * (2048 + 80),
        speculative_algorithm=algo,
    )
    if algo != "NONE":
        kw["speculative_draft_model_path"] = drafter
    if budget:
        kw["speculative_ddtree_budget"] = budget
    llm = LLM(target, **kw)
    runner = llm.engine.runner
    graphs = runner.graphs
    assert graphs is not None, "CUDA graphs were not enabled (see the log)"
    counts: dict = {}
    _count_replays(graphs, counts)
    decoder, recs = llm.engine.decoder, []
    read_clock = decoder._read_clock
    decoder._read_clock = lambda *a: read_clock(*a) or recs.append(decoder.budgets.last)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        for b in (1, 5):
            prompts = _prompts(llm, b)
            runner.graphs = None
            eager = [o.token_ids for o in llm.generate(prompts, params)]
            runner.graphs = graphs
            counts.clear()
            recs.clear()
            outs = llm.generate(prompts, params)
            graph = [o.token_ids for o in outs]
            _check_round_clock(recs, phases=algo != "NONE")
            assert counts.get("verify"), f"b={b}: no verify replay {counts}"
            if algo != "NONE":
                assert counts.get("draft_tree") and counts.get("accept"), f"b={b}: {counts}"
                assert mean_accept(outs) > 2, f"b={b}: {[o.accept_lengths for o in outs]}"
            bad = [i for i, (x, y) in enumerate(zip(eager, graph)) if x != y]
            if dtype == "float32":
                assert not bad, f"b={b}: requests {bad} differ"
            else:  # batch-shape-dependent bf16 rounding can flip a near-tie: at most one request
                assert len(bad) <= max(1, b // 5), f"b={b}: requests {bad} differ"
    finally:
        runner.graphs = graphs
        del llm
        torch.cuda.empty_cache()


def _check_round_clock(recs, phases: bool) -> None:
    """engine/round/clock.py: every graphed round has its device span, inside its host wall time;
    the idle time is known after a decode round; the phases cut the span."""
    assert recs and all(r.timing.device_s is not None and r.timing.device_s > 0 for r in recs)
    assert all(r.timing.device_s <= r.timing.round_s + 1e-4 for r in recs), [
        (r.timing.device_s, r.timing.round_s) for r in recs
    ]
    idle = [r.timing.idle_s for r in recs if r.timing.idle_s is not None]
    assert len(idle) >= len(recs) // 2 and min(idle) >= 0, idle
    if phases:
        for r in recs:
            assert set(r.timing.device_phases) == {"plan", "draft", "verify", "commit"}
            assert sum(r.timing.device_phases.values()) == pytest.approx(
                r.timing.device_s, abs=1e-5
            )
