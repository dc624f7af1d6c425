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


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
def test_stop_inside_block_with_prefix_cache_keeps_pools_whole(toy_pair, algorithm):
    """Issue 39's crash: a stop inside an accepted block drops the block's later tokens, whose KV the
    round wrote; the request's release must hand the prefix cache only pages its tokens spell (the
    partial last page had tripped `insert_run`'s assertion and leaked the slot). Every in-block stop
    position, as a stop id, as max_tokens and as a stop string, with 4-token pages so the dropped
    tokens cross page boundaries; the cache stays whole, and a second request that hits the cached
    prefix decodes the same tokens."""
    llm = make_llm(toy_pair, algorithm, page_size=4, **_budget(algorithm))
    bm = llm.engine.runner.bm
    assert bm.cache is not None
    prompt = list(toy_prompts()[2])
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0]
    inside, pos = [], 0
    for n in full.accept_lengths:
        inside += list(range(pos, pos + n - 1)) if n > 1 else []
        pos += n
    assert len(inside) >= 8, f"too few in-block positions: {full.accept_lengths}"
    text_stops = 0
    for j in inside:
        tok = full.token_ids[j]
        if full.token_ids.index(tok) == j:
            out = llm.generate(
                [prompt],
                SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[tok], ignore_eos=True),
            )[0]
            assert out.token_ids == full.token_ids[: j + 1] and out.finish_reason == "stop"
        out = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=j + 1, ignore_eos=True)
        )[0]
        assert out.token_ids == full.token_ids[: j + 1] and out.finish_reason == "length"
        stop = llm.tokenizer.decode(full.token_ids[j : j + 1], skip_special_tokens=True)
        if stop.strip() and full.text.find(stop) >= 0:
            text_stops += 1
            out = llm.generate(
                [prompt], SamplingParams(temperature=0, max_tokens=48, stop=[stop], ignore_eos=True)
            )[0]
            assert out.finish_reason == "stop" and out.text == full.text[: full.text.find(stop)]
        bm.check_integrity()
        assert bm.num_free_slots == llm.engine.runner.cfg.max_running_requests
    assert text_stops, "no in-block token decodes to a stop string"
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0]
    assert again.cached_tokens > 0 and again.token_ids == full.token_ids
    bm.check_integrity()


def _budget(algorithm):
    return {"speculative_ddtree_budget": 16} if algorithm == "DDTREE" else {}


def test_embedded_pair_stop_string_repro():
    """The user's report, as sent: the embedded pair, DDTREE with the prefix cache (the server's
    default), a ':' stop string on a code prompt; it failed the step in `insert_run`."""
    from ddtree import LLM

    llm = LLM(None, speculative_algorithm="DDTREE", speculative_ddtree_budget=16, dtype="float32")
    bm = llm.engine.runner.bm
    for stop in ["\n\n", ":", ")", "\n", "return"]:
        for prompt in ["def quicksort(xs):", "class Foo:\n    def __init__(self"]:
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, stop=[stop]))
            assert out[0].finish_reason in ("stop", "length") and stop not in out[0].text
            bm.check_integrity()
    assert bm.num_free_slots == llm.engine.runner.cfg.max_running_requests
