"""Speculation is lossless relative to the served FP8 model: the toy pairs quantized at load (target and
drafter, --quantization fp8 --speculative-draft-quantization fp8) decode at T=0 exactly the tokens of
the FP8 target's AR (fp32 activations, float32 accumulation), dense and hybrid, DFLASH and DDTREE,
batch 1 and a ragged batch, with drafts really accepted (mean accepted length > 2, asserted); at T>0
DDTREE's first tokens follow the FP8 AR distribution (chi-square, as tests/test_engine_sampling.py),
and the FP8 server differs from the model-dtype one (the quantization really acts). ~40 s."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from engine_utils import GREEDY, accepted_prompts, make_llm, mean_accept
from test_engine_sampling import first_tokens, same_distribution

from ddtree.models.quant import Fp8Linear

FP8 = {"quantization": "fp8"}
FP8_PAIR = {**FP8, "speculative_draft_quantization": "fp8"}
PROMPTS = [list(p) for p in accepted_prompts(4)]


@pytest.fixture(params=["dense", "hybrid"])
def pair(request, toy_pair, toy_hybrid_pair):
    return toy_pair if request.param == "dense" else toy_hybrid_pair


@functools.lru_cache(maxsize=None)
def _ar(pair: tuple[str, str], quantized: bool):
    llm = make_llm(pair, "NONE", **(FP8 if quantized else {}))
    if quantized:
        assert any(isinstance(m, Fp8Linear) for m in llm.engine.runner.target.modules())
    return tuple(tuple(o.token_ids) for o in llm.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize(
    "algorithm,kw", [("DFLASH", {}), ("DDTREE", {"speculative_ddtree_budget": 8})]
)
def test_fp8_speculation_is_fp8_ar(pair, algorithm, kw, one_torch_thread):
    llm = make_llm(pair, algorithm, **FP8_PAIR, **kw)
    drafter = llm.engine.runner.drafter
    assert any(isinstance(m, Fp8Linear) for m in drafter.modules())
    outs = llm.generate(PROMPTS, GREEDY)
    assert [tuple(o.token_ids) for o in outs] == list(_ar(tuple(pair), True))
    assert mean_accept(outs) > 2
    alone = llm.generate([PROMPTS[2]], GREEDY)[0]
    assert tuple(alone.token_ids) == _ar(tuple(pair), True)[2]


def test_fp8_is_not_the_model_dtype(toy_pair, one_torch_thread):
    """The FP8 target's log-probs are not the fp32 one's (the quantization acts: the tests above show
    speculation following the quantized model, not the fp32 one it happens to agree with on these
    confident prompts)."""
    params = dataclasses.replace(GREEDY, max_tokens=8, logprobs=True)
    lp = [
        [
            t.logprob
            for o in make_llm(toy_pair, "NONE", **kw).generate(PROMPTS, params)
            for t in o.logprobs
        ]
        for kw in (FP8, {})
    ]
    assert len(lp[0]) == len(lp[1]) == 32 and lp[0] != lp[1]


def test_fp8_ddtree_sampling_matches_fp8_ar(toy_pair, one_torch_thread):
    ar = first_tokens(make_llm(toy_pair, "NONE", max_running_requests=256, **FP8), 1000, n=800)
    llm = make_llm(
        toy_pair, "DDTREE", speculative_ddtree_budget=16, max_running_requests=256, **FP8_PAIR
    )
    dd = first_tokens(llm, 100_000, n=800)
    assert len(ar) > 5
    assert same_distribution(ar, dd) > 1e-3
