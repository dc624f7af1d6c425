"""Stop tokens, stop strings and max_tokens honoured exactly when they fall inside an accepted block."""

import pytest
from engine_utils import make_llm, toy_prompts

from ddtree import SamplingParams


@pytest.fixture(scope="module")
def reference(toy_pair):
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16)
    prompt = list(toy_prompts()[2])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0]
    # positions that sit strictly inside a round's accepted block (not its last token)
    inside, pos = [], 0
    for n in out.accept_lengths:
        inside += list(range(pos + 1, pos + n - 1)) if n > 2 else []
        pos += n
    assert inside, "no round accepted more than 2 tokens"
    return llm, prompt, out, inside


def test_max_tokens_inside_block(reference):
    llm, prompt, full, inside = reference
    m = inside[0] + 1
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))[0]
    assert out.token_ids == full.token_ids[:m] and out.finish_reason == "length"


def test_stop_token_inside_block(reference):
    llm, prompt, full, inside = reference
    for j in inside:
        tok = full.token_ids[j]
        first = full.token_ids.index(tok)
        if first == j:
            break
    else:
        pytest.skip("every in-block token occurred earlier")
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[tok], ignore_eos=True),
    )[0]
    assert out.token_ids == full.token_ids[: j + 1] and out.finish_reason == "stop"


def test_stop_string_inside_block(reference):
    llm, prompt, full, inside = reference
    tok = llm.tokenizer
    j = inside[len(inside) // 2]
    stop = tok.decode(full.token_ids[j : j + 1], skip_special_tokens=True).strip()
    assert stop
    cut = full.text.find(stop)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=48, stop=[stop], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert stop not in out.text
    assert full.token_ids[: len(out.token_ids)] == out.token_ids
