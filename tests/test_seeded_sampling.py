"""Seeded sampling is keyed by (seed, position) (engine/round/sampler.py), so a seeded request emits the
same tokens in AR, DFLASH, DDTREE at fixed budgets and under `auto` (the real policy, and a policy
whose budgets change every round and per request), alone and batched with other requests (greedy,
unseeded, other filters), on the dense and the hybrid toy pair, fp32. The comparisons exercise
speculation: the seeded runs' mean accepted length is asserted."""

import dataclasses

import pytest
from engine_utils import accepted_prompts, make_llm, mean_accept
from test_budget_engine import AUTO, CyclingPolicy

from ddtree import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, ignore_eos=True)
# (algorithm, engine kwargs, scripted policy)
MODES = {
    "dflash": ("DFLASH", {}, False),
    "ddtree4": ("DDTREE", {"speculative_ddtree_budget": 4}, False),
    "ddtree16": ("DDTREE", {"speculative_ddtree_budget": 16}, False),
    "auto": ("DDTREE", AUTO, False),
    "auto-cycling": ("DDTREE", AUTO, True),
}


def seeded(i: int, **kw) -> SamplingParams:
    return dataclasses.replace(SAMPLED, seed=1000 + i, **kw)


def batch():
    """Seeded requests among a greedy and an unseeded one: at T=0.8 the toy drafts are accepted
    (speculation runs); at T=1.5 the samples spread out (a peaked distribution would repeat even
    where the noise differs); one with top-k, one cut by its budget."""
    prompts = [list(p) for p in accepted_prompts(6)]
    params = [seeded(i) for i in range(4)]
    params[1] = seeded(1, temperature=1.5, top_p=0.95)
    params[2] = seeded(2, temperature=1.0, top_k=5, top_p=1.0)
    params[3] = seeded(3, ddtree_budget=2)
    params += [
        SamplingParams(temperature=0, max_tokens=30),
        dataclasses.replace(SAMPLED, seed=None),
    ]
    return prompts, params


def generate(pair, algorithm, kw, cycling, prompts, params, **extra):
    llm = make_llm(pair, algorithm, max_running_requests=8, **kw, **extra)
    if cycling:
        llm.engine.set_budget_policy(CyclingPolicy())
    return llm.generate(prompts, params)


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def target(request):
    pair = request.getfixturevalue("toy_pair" if request.param == "dense" else "toy_hybrid_pair")
    prompts, params = batch()
    ar = generate(pair, "NONE", {}, False, prompts, params)
    return pair, [o.token_ids for o in ar[:4]]


@pytest.mark.parametrize("mode", list(MODES))
def test_seeded_request_is_the_same_in_every_mode(target, mode):
    pair, ar = target
    algorithm, kw, cycling = MODES[mode]
    prompts, params = batch()
    outs = generate(pair, algorithm, kw, cycling, prompts, params)
    assert [o.token_ids for o in outs[:4]] == ar
    assert mean_accept(outs[:1]) > 2, "speculation barely ran: the comparison tests little"
    alone = generate(pair, algorithm, kw, cycling, prompts[1:2], params[1:2])[0]
    assert alone.token_ids == ar[1]
