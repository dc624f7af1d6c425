"""T>0: DDTREE's output distribution is the target's (chi-square against AR on the joint distribution of the
first tokens), a biased walk is caught by the same test, and a fixed seed reproduces."""

import collections

import pytest
from engine_utils import biased_sample_nodes, make_llm, toy_prompts
from scipy.stats import chi2_contingency

from ddtree import SamplingParams

N = 1500
PROMPT = list(toy_prompts()[1])


def first_tokens(llm, seed0, n=N, k=3, **params):
    """Counter of the first k tokens of n seeded samples. Callers give AR and speculative runs disjoint seeds:
    with equal seeds both draw the same tokens (sampling is keyed by seed and position; the token-for-token
    test is in test_engine_lossless.py), which would make the two samples one."""
    sp = [
        SamplingParams(
            temperature=params.get("temperature", 1.5),
            top_p=params.get("top_p", 1.0),
            top_k=params.get("top_k", -1),
            max_tokens=k,
            ignore_eos=True,
            seed=seed0 + i,
        )
        for i in range(n)
    ]
    outs = llm.generate([PROMPT] * n, sp)
    return collections.Counter(tuple(o.token_ids[:k]) for o in outs)


def same_distribution(a: collections.Counter, b: collections.Counter) -> float:
    keys = sorted(set(a) | set(b))
    # pool rare outcomes so the expected counts suit a chi-square test
    common = [x for x in keys if a[x] + b[x] >= 10]
    rare_a = sum(a[x] for x in keys if x not in common)
    rare_b = sum(b[x] for x in keys if x not in common)
    table = [[a[x] for x in common] + [rare_a], [b[x] for x in common] + [rare_b]]
    table = [list(col) for col in zip(*table) if sum(col) > 0]
    return chi2_contingency(list(zip(*table)))[1]


@pytest.fixture(scope="module")
def ar_counts(toy_pair):
    return first_tokens(make_llm(toy_pair, "NONE", max_running_requests=256), seed0=1000)


def test_ddtree_sampling_matches_ar(toy_pair, ar_counts):
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16, max_running_requests=256)
    dd = first_tokens(llm, seed0=100_000)
    assert len(ar_counts) > 5, "the test needs a spread-out distribution"
    assert same_distribution(ar_counts, dd) > 1e-3
    assert "verify" in llm.engine.decoder.times.seconds


def test_biased_acceptance_is_detected(toy_pair, ar_counts, monkeypatch):
    """Accepting a drafted child whenever it is the target's top-2 token biases the output: the chi-square
    test above must notice (so it is able to fail)."""
    import ddtree.engine.round.decoder as dec

    monkeypatch.setattr(dec, "sample_nodes", biased_sample_nodes(dec.sample_nodes))
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16, max_running_requests=256)
    assert same_distribution(ar_counts, first_tokens(llm, seed0=100_000)) < 1e-3


def test_top_k_top_p_distribution_matches_ar(toy_pair):
    kw = dict(temperature=1.0, top_k=5, top_p=0.9)
    ar = first_tokens(make_llm(toy_pair, "NONE", max_running_requests=256), 1000, n=800, k=2, **kw)
    dd = first_tokens(
        make_llm(toy_pair, "DFLASH", max_running_requests=256), 100_000, n=800, k=2, **kw
    )
    assert same_distribution(ar, dd) > 1e-3


def test_fixed_seed_reproduces_across_batches(toy_pair):
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16)
    sp = SamplingParams(temperature=1.0, max_tokens=30, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPT], sp)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=30, seed=8, ignore_eos=True)
    batched = llm.generate([list(toy_prompts()[0]), PROMPT, PROMPT], [other, sp, other])
    assert batched[1].token_ids == alone
    assert batched[2].token_ids != alone  # a different seed gives a different sample
