"""CUDA graphs vs eager on the device for hybrid (Gated DeltaNet) targets, on the toy hybrid pair in
fp32: token-identical outputs for greedy AR (NONE), DFLASH and DDTREE, under both commit strategies
(extra_buffer, no_buffer), batch 1 and a ragged batch of 5, with the graphs really replayed (verify,
commit, and for DFLASH / DDTREE the fused draft -> tree). Speculative runs also match AR (lossless on
the GPU paths: fla prefill / replay, the Triton tree kernel, the chunk-form tree rule). Issue 19's GPU
correctness target; formerly section (e) of studies/gpu_gdn_tree.py.

The pair: $DDTREE_CACHE/toy_hybrid_pair (the device scripts point DDTREE_CACHE at a carried
`.toycache`), built there (~1 min on the CPU) when missing, or in a temporary directory."""

import os

import pytest
import torch
from engine_utils import mean_accept

pytestmark = pytest.mark.gpu

MAX_TOKENS = 24
RUNS = [("NONE", None), ("DFLASH", None), ("DDTREE", 16)]
STRATEGIES = ["extra_buffer", "no_buffer"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from ddtree import envs
    from ddtree.tools.train.toy import build_toy_hybrid_pair

    out = (
        os.path.join(envs.CACHE.get(), "toy_hybrid_pair")
        if envs.CACHE.get()
        else str(tmp_path_factory.mktemp("toy_hybrid_pair"))
    )
    return build_toy_hybrid_pair(out)


def _prompts(n):
    from engine_utils import accepted_prompts

    return [list(p) for p in accepted_prompts(n)]  # the toy drafter accepts these


def _llm(pair, algo, budget, strategy, graphs):
    from ddtree import LLM

    kw = {}
    if algo != "NONE":
        kw["speculative_draft_model_path"] = pair[1]
    if budget:
        kw["speculative_ddtree_budget"] = budget
    return LLM(
        pair[0],
        speculative_algorithm=algo,
        dtype="float32",
        device="cuda",
        mamba_scheduler_strategy=strategy,
        max_running_requests=5,
        max_total_tokens=4096,
        disable_cuda_graph=not graphs,
        **kw,
    )


def _count(graphs, counts):
    for name in ("verify", "commit", "draft_tree"):
        fn = getattr(graphs, name)

        def counted(*a, _fn=fn, _name=name):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*a)

        setattr(graphs, name, counted)


def _generate(llm, n):
    from ddtree import SamplingParams

    # ragged max_tokens, so the live batch shrinks and rounds pad into buckets
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS - 3 * i, ignore_eos=True)
        for i in range(n)
    ]
    return llm.generate(_prompts(n), params)


def _tokens(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def ar(pair):
    llm = _llm(pair, "NONE", None, "extra_buffer", graphs=False)
    out = {n: _tokens(_generate(llm, n)) for n in (5, 1)}
    del llm
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("algo,budget", RUNS)
def test_hybrid_graphs_match_eager(pair, ar, algo, budget, strategy):
    torch.backends.cuda.matmul.allow_tf32 = False
    eager = _llm(pair, algo, budget, strategy, graphs=False)
    want = {n: _tokens(_generate(eager, n)) for n in (5, 1)}
    del eager
    llm = _llm(pair, algo, budget, strategy, graphs=True)
    g = llm.engine.runner.graphs
    assert g is not None, "no CUDA graphs for the hybrid target"
    counts: dict = {}
    _count(g, counts)
    outs = {n: _generate(llm, n) for n in (5, 1)}
    got = {n: _tokens(o) for n, o in outs.items()}
    assert got == want, f"{algo} {strategy}: graphs differ from eager"
    assert got == ar, f"{algo} {strategy}: not lossless vs AR"
    assert counts.get("verify") and counts.get("commit"), counts
    if algo != "NONE":
        assert counts.get("draft_tree"), counts
        assert mean_accept(outs[5]) > 2 and mean_accept(outs[1]) > 2  # drafts really accepted
