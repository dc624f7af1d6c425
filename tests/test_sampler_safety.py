"""Degenerate sampling numbers stay numerically safe: a temperature near 0 samples as greedy and a
top_p that rounds to 0 keeps the top token, instead of NaN probabilities collapsing every draw onto
token id 0."""

import pytest
import torch

from ddtree.engine.round.sampler import NodePositions, filter_logits, sample_from, sample_nodes
from ddtree.engine.scheduling.request import SAMPLING_EPS, SamplingParams

TOP = 7  # the argmax is deliberately not token 0
POS = torch.arange(4)  # the rows' token positions


def logits(rows: int = 4, vocab: int = 32) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    x[:, TOP] = 10.0
    return x


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-45, 5e-324, SAMPLING_EPS / 2])
def test_tiny_temperature_is_greedy(temperature):
    p = SamplingParams(temperature=temperature)
    assert p.greedy
    tokens = sample_from(logits(), p, 1, POS)
    assert tokens.tolist() == [TOP] * 4


def test_temperature_at_the_threshold_samples():
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy
    assert not SamplingParams(temperature=0.7).greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-9])
def test_tiny_top_p_keeps_the_top_token(top_p):
    x = filter_logits(logits(), 1.0, -1, top_p)
    assert torch.isfinite(x[:, TOP]).all(), "the top token was filtered out"
    assert torch.isinf(x).sum() == x.numel() - 4  # everything else is dropped
    p = SamplingParams(temperature=1.0, top_p=top_p)
    tokens = sample_nodes(logits()[None], [p], [2], NodePositions(POS[:1], POS[None], 3))
    assert tokens.tolist() == [[TOP] * 4]


def test_huge_temperature_is_uniform_not_degenerate():
    p = SamplingParams(temperature=1e300)
    probs = torch.softmax(filter_logits(logits(), p.temperature, -1, 1.0), -1)
    assert torch.isfinite(probs).all() and torch.allclose(probs, torch.full_like(probs, 1 / 32))
    draws = torch.stack([sample_from(logits(), p, s, POS) for s in range(20)])
    assert len(set(draws.flatten().tolist())) > 5
