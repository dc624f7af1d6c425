"""Lossless: DFLASH and DDTREE emit exactly the AR tokens, on a pair whose drafts are really
accepted (the mean accepted length is asserted in the same test); at T=0, and at T>0 token for
token with the same seeds (sampling is keyed by seed and position: engine/round/sampler.py), beside the
distribution tests of test_engine_sampling.py."""

import dataclasses

import pytest
from engine_utils import GREEDY, accepted_prompts, mean_accept, run, toy_prompts

from ddtree import SamplingParams

# T=0.8: drafts accepted; T=1.5: spread-out samples; top-k and top-p filters
SAMPLED = [
    SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=40, ignore_eos=True, seed=77 + i)
    for i, (t, p, k) in enumerate(
        [
            (0.8, 0.9, -1),
            (1.5, 1.0, -1),
            (0.8, 1.0, -1),
            (1.0, 0.95, 5),
            (0.8, 0.9, -1),
            (1.2, 1, 8),
        ]
    )
]


@pytest.fixture(scope="module")
def ar_tokens(toy_pair):
    return [o.token_ids for o in run(toy_pair, toy_prompts())]


def test_dflash_is_lossless_and_accepts(toy_pair, ar_tokens):
    outs = run(toy_pair, toy_prompts(), algorithm="DFLASH")
    assert [o.token_ids for o in outs] == ar_tokens
    assert mean_accept(outs) > 2


@pytest.mark.parametrize("budget", [4, 16, 64])
@pytest.mark.parametrize("shadow", [False, True])
@pytest.mark.parametrize("cap", ["1", "4", "B"])
def test_ddtree_is_lossless_and_accepts(toy_pair, ar_tokens, budget, shadow, cap):
    topk = budget if cap == "B" else int(cap)
    outs = run(
        toy_pair,
        toy_prompts(),
        algorithm="DDTREE",
        speculative_ddtree_budget=budget,
        speculative_ddtree_topk_cap=topk,
        speculative_ddtree_shadow_linear=shadow,
    )
    assert [o.token_ids for o in outs] == ar_tokens
    if budget >= 16:
        assert mean_accept(outs) > 2


@pytest.fixture(scope="module")
def ar_sampled(toy_pair):
    return [o.token_ids for o in run(toy_pair, accepted_prompts(), SAMPLED)]


@pytest.mark.parametrize(
    "algorithm,budget,shadow",
    [("DFLASH", None, False), ("DDTREE", 4, False), ("DDTREE", 16, True), ("DDTREE", 64, False)],
)
def test_sampling_is_lossless_token_for_token(toy_pair, ar_sampled, algorithm, budget, shadow):
    kw = {} if budget is None else dict(speculative_ddtree_budget=budget)
    outs = run(
        toy_pair,
        accepted_prompts(),
        SAMPLED,
        algorithm=algorithm,
        speculative_ddtree_shadow_linear=shadow,
        **kw,
    )
    assert [o.token_ids for o in outs] == ar_sampled
    assert mean_accept([outs[0], outs[2], outs[4]]) > 2


def test_sampled_token_for_token_check_can_fail(toy_pair, ar_sampled):
    """Meta: other seeds give other tokens, so the comparison above is not vacuous."""
    other = [dataclasses.replace(p, seed=p.seed + 100) for p in SAMPLED]
    outs = run(
        toy_pair, accepted_prompts(), other, algorithm="DDTREE", speculative_ddtree_budget=16
    )
    assert sum(o.token_ids != a for o, a in zip(outs, ar_sampled)) >= 3


@pytest.mark.parametrize("algorithm", ["NONE", "DFLASH", "DDTREE"])
def test_batch_equals_batch_of_one(toy_pair, algorithm):
    prompts = toy_prompts()
    batched = run(toy_pair, prompts, algorithm=algorithm, speculative_ddtree_budget=16)
    for p, o in zip(prompts, batched):
        alone = run(toy_pair, [p], algorithm=algorithm, speculative_ddtree_budget=16)[0]
        assert alone.token_ids == o.token_ids
    if algorithm != "NONE":
        assert mean_accept(batched) > 2


def test_preemption_under_kv_pressure_is_lossless(toy_pair, ar_tokens):
    # a pool too small for all requests at once forces preempt-and-recompute
    outs = run(
        toy_pair,
        toy_prompts(),
        algorithm="DDTREE",
        speculative_ddtree_budget=16,
        max_total_tokens=256,
        page_size=8,
    )
    assert [o.token_ids for o in outs] == ar_tokens and mean_accept(outs) > 2


def test_pools_are_clean_after_drain(toy_pair):
    from engine_utils import make_llm

    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16)
    llm.generate([list(p) for p in toy_prompts()], GREEDY)
    bm = llm.engine.runner.bm
    bm.check_integrity()
    assert bm.num_available_pages == bm.num_pages  # all cached pages unreferenced
    assert bm.num_free_slots == llm.engine.runner.cfg.max_running_requests


def test_per_request_budgets_in_one_batch(toy_pair, ar_tokens):
    """Requests may ask for smaller trees than the server's budget; they share one verify forward."""
    from engine_utils import make_llm

    from ddtree import SamplingParams

    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=32)
    budgets = [1, 4, None, 16, 8, 2]
    params = [
        SamplingParams(
            temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, ddtree_budget=b
        )
        for b in budgets
    ]
    outs = llm.generate([list(p) for p in toy_prompts()], params)
    assert [o.token_ids for o in outs] == ar_tokens
    assert mean_accept([outs[2], outs[3]]) > 2
    assert max(outs[0].accept_lengths) <= 2  # a budget-1 tree holds one drafted node


def test_the_accept_check_can_fail(toy_pair, tmp_path, one_torch_thread):
    """Meta: the lossless tests' `mean_accept(outs) > 2` fails for a pair whose drafts are not
    accepted: the toy target with a random-weight drafter, on the prompts the toy drafter accepts."""
    from pair_fixtures import save_random_drafter

    from ddtree.tools.train.data import MASK_ID

    target, drafter = toy_pair
    save_random_drafter(target, tmp_path, block_size=8, mask_token_id=MASK_ID, layer_ids=[0, 1])
    outs = run((target, str(tmp_path)), accepted_prompts(), algorithm="DFLASH")
    assert [o.token_ids for o in outs] == [o.token_ids for o in run(toy_pair, accepted_prompts())]
    assert mean_accept(outs) < 1.5
