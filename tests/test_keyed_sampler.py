"""The keyed sampler (engine/round/sampler.py): Gumbel noise from a hash of (seed, position, token) is a pure
function of those three on any device, and argmax(filtered logits + noise) is an exact sample of the
filtered target distribution: chi-square goodness of fit over a fixed set of seeds (and positions), so
the test cannot flake, and independence between positions and between seeds. A sampler with the wrong
noise is caught by the same tests."""

import collections

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from ddtree.engine.round import sampler
from ddtree.engine.round.sampler import filter_logits, gumbel_noise, sample_from
from ddtree.engine.scheduling.request import SamplingParams

PROBS = torch.tensor([0.32, 0.22, 0.16, 0.11, 0.08, 0.06, 0.03, 0.02])
LOGITS = PROBS.log() + 1.7  # unnormalised: only differences matter
V = len(PROBS)
P_MIN = 1e-3  # fixed seeds: each p-value is a constant, this only says how far from the target


def draws(seeds, positions, params=SamplingParams(temperature=1.0)):
    """Tokens `sample_from` draws from LOGITS for every (seed, position): [len(seeds),
    len(positions)] (a tensor of seeds broadcasts against the positions: one call)."""
    pos = torch.as_tensor(positions, dtype=torch.int64)
    seed = torch.as_tensor(list(seeds), dtype=torch.int64)[:, None]
    return sample_from(LOGITS.expand(len(pos), V), params, seed, pos)


def fit(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.flatten(), minlength=V).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a filtered token was sampled"
    kept = probs[keep].double()
    expected = kept / kept.sum() * counts.sum()
    return chisquare(counts[keep].numpy(), expected.numpy()).pvalue


def independent(a: torch.Tensor, b: torch.Tensor) -> float:
    table = collections.Counter(zip(a.tolist(), b.tolist()))
    xs, ys = sorted({x for x, _ in table}), sorted({y for _, y in table})
    return chi2_contingency([[table[(x, y)] for y in ys] for x in xs])[1]


def test_over_seeds_at_one_position_the_sample_is_the_target():
    tokens = draws(range(4000), [37])
    assert fit(tokens, PROBS) > P_MIN


def test_over_positions_of_one_seed_the_sample_is_the_target():
    tokens = draws([123456789], range(20_000))
    assert fit(tokens, PROBS) > P_MIN


def test_filtered_distribution_with_temperature_top_k_top_p():
    p = SamplingParams(temperature=0.7, top_k=6, top_p=0.85)
    target = torch.softmax(filter_logits(LOGITS, 0.7, 6, 0.85), -1)
    assert (target == 0).sum() >= 2  # the filters really drop tokens
    assert fit(draws([99], range(20_000), p), target) > P_MIN


def test_positions_and_seeds_are_independent():
    """The token at p and at p + 1 of one request, and the same position under seeds s and s + 1
    (the n > 1 choices of one request): joint counts factor."""
    t = draws(range(3000), [10, 11])
    assert independent(t[:, 0], t[:, 1]) > P_MIN
    by_seed = draws(range(6000), [10])[:, 0]
    assert independent(by_seed[0::2], by_seed[1::2]) > P_MIN


def test_wrong_noise_is_caught(monkeypatch):
    """Meta: exponential instead of Gumbel noise (a plausible slip: one log too few) skews the
    sample; the goodness-of-fit test above rejects it on the same seeds."""

    def one_log(seed, pos, vocab):
        u = torch.exp(-torch.exp(-gumbel_noise(seed, pos, vocab)))  # the uniform behind the noise
        return -torch.log(u)

    assert fit(draws([123456789], range(20_000)), PROBS) > P_MIN
    monkeypatch.setattr(sampler, "gumbel_noise", one_log)
    assert fit(draws([123456789], range(20_000)), PROBS) < 1e-6


def test_noise_is_a_pure_function_of_seed_position_and_token():
    pos = torch.tensor([0, 5, 5, 1 << 40])
    a = gumbel_noise(2**63 - 1, pos, 50)
    assert torch.equal(a, gumbel_noise(2**63 - 1, pos, 50))
    assert torch.equal(a[1], a[2])  # the same position: the same noise
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a, gumbel_noise(2**63 - 2, pos, 50))  # seeds differ in the low bits
    assert not torch.equal(a, gumbel_noise(2**62 - 1, pos, 50))  # and in the high bits only
    assert torch.equal(gumbel_noise(7, pos, 80)[:, :50], gumbel_noise(7, pos, 50))  # vocab-free
    assert torch.isfinite(a).all() and len(set(a[0].tolist())) == 50  # no ties within a row
    # a sampled request draws the same tokens tomorrow: pinned values (a changed hash changes
    # every seeded output a client may have stored)
    got = gumbel_noise(1000, torch.tensor([3]), 4)[0].tolist()
    assert got == pytest.approx(PINNED, abs=1e-6)


PINNED = [-0.88584757, 0.47497967, 0.23782456, -0.6368531]


@pytest.mark.parametrize("x", [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF])
def test_mix32_is_exact_in_int64(x):
    """The tensor hash (and its in-place form) equals the one on Python's exact integers at the
    extremes of the 32-bit range: no int64 overflow, no sign, and a bijection's distinct values."""
    want = sampler._mix32(x)
    assert 0 <= want < 2**32
    assert int(sampler._mix32(torch.tensor([x]))) == want
    assert int(sampler._mix32_(torch.tensor([x]))) == want
    near = torch.tensor([x ^ (1 << k) for k in range(32)])
    assert len(set(sampler._mix32_(near).tolist()) | {want}) == 33
