"""What the differential fuzzer found (issue 39), each as a direct regression test on the toy pair
(the seeds themselves: tests/test_fuzz_engine.py REGRESSION_SEEDS). About 5 s."""

import pytest
from engine_utils import make_llm, toy_pattern

from ddtree import SamplingParams
from ddtree.engine import integrity


def drain(llm) -> None:
    e = llm.engine
    while e.has_unfinished():
        e.step()
        integrity.check(e, deep=True)
    integrity.check_drained(e, deep=True)


def test_stop_hit_is_the_stop_string(toy_pair):
    """A stop string that ends inside a token: the request records the stop string it matched
    (what /generate reports as `matched`), not the text from it to the token's end."""
    llm = make_llm(toy_pair, "DFLASH")
    prompt = [0] + toy_pattern("prog", 5, 12, 1)
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    words = full.text.split()
    stop = f"{words[2]} {words[3][0]}"  # ends on the first character of a word
    assert len(words[3]) > 1
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, stop=[stop], ignore_eos=True)
    )[0]
    req_text = full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.text == req_text
    assert llm.engine.requests == {}
    # the engine's record of the finish
    e = llm.engine
    r = e.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=8, stop=[stop], ignore_eos=True)
    )
    drain(llm)
    assert r.stop_hit == stop


def test_chunked_prefill_keeps_the_pages_admission_counted(toy_pair):
    """Admission counts the whole prompt's pages as available but took only the first chunk's:
    requests admitted after a chunked prompt took its later chunks' pages and its next chunk
    failed the step ('out of KV pages'). 6 pages of 4 tokens, 8-token chunks."""
    llm = make_llm(
        toy_pair,
        "NONE",
        page_size=4,
        max_total_tokens=24,
        chunked_prefill_size=8,
        disable_radix_cache=True,
    )
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i, n in enumerate([4, 17, 10, 3]):
        llm.engine.add_request(toy_pattern("prog", 5 + 7 * i, n), sp)
    drain(llm)


@pytest.mark.parametrize("algorithm", ["NONE", "DFLASH"])
def test_pool_holds_a_request_at_full_context(toy_pair, algorithm):
    """The pool planned for max_running_requests requests at full context plus a verify width
    rounded the tokens down to pages: one page short, a lone request near the context's end was
    preempted, could never be readmitted, and finished early with 'length'."""
    llm = make_llm(toy_pair, algorithm, context_length=43, page_size=4, max_running_requests=1)
    e = llm.engine
    width = e.scheduler.verify_width
    assert e.runner.bm.num_pages * 4 >= 43 + width
    prompt = [0] + toy_pattern("walk", 9, 32)
    r = e.add_request(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    drain(llm)
    assert r.finish_reason == "length" and r.seq_len == 43
    assert e.scheduler.num_preemptions == 0


def test_a_request_that_outgrows_the_pool_leaves_no_state(toy_pair):
    """`_starved` ends a request whose output outgrew the pool (preempted, never readmitted); it
    forgot its detokenizer, which a finish in `emit` drops."""
    llm = make_llm(toy_pair, "NONE", page_size=4, max_total_tokens=16)
    e = llm.engine
    r = e.add_request([0] + toy_pattern("prog", 3, 7), SamplingParams(max_tokens=30))
    drain(llm)
    assert r.finish_reason == "length" and 0 < r.num_output_tokens < 30
    assert e.scheduler.num_preemptions == 1
    assert e.emitter.detok == {} and e.emitter.lag == {}


def test_prompt_filling_the_pool_is_admitted_beside_a_copy_on_write_match(toy_pair):
    """A cached page that starts like the prompt's next one (a copy-on-write candidate) was
    counted as taken for the whole admission, so a prompt needing every page was refused and
    finished with no tokens; the page is locked only while its copy is made."""
    llm = make_llm(toy_pair, "NONE", page_size=2, max_total_tokens=20)
    e = llm.engine
    base = [0] + toy_pattern("prog", 11, 18)  # 19 tokens: the whole pool with its verify slot
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    e.add_request(base[:5], sp)  # caches pages [0:2), [2:4)
    drain(llm)
    forked = base[:3] + [base[3] + 1] + base[4:]  # page 1 only starts like the cached one
    hit = e.runner.match_prefix(_req(forked, sp))
    assert hit.cow is not None and len(hit.nodes) == 1
    r = e.add_request(forked, sp)
    drain(llm)
    assert r.finish_reason == "length" and len(r.output_ids) == 1


@pytest.mark.parametrize("algorithm", ["NONE", "DDTREE"])
def test_a_request_failed_in_its_emission_keeps_one_log_prob_per_token(
    toy_pair, algorithm, monkeypatch
):
    """Fault isolation fails a request whose emission raises; the round had already recorded the
    log-probs of the tokens it was emitting, which the failed request kept (2 entries for 1 token)."""
    from ddtree.engine.outputs.emitter import TokenEmitter

    llm = make_llm(
        toy_pair, algorithm, **({"speculative_ddtree_budget": 8} if algorithm != "NONE" else {})
    )
    e = llm.engine
    sp = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    ok = e.add_request([0] + toy_pattern("prog", 3, 12), sp)
    bad = e.add_request([0] + toy_pattern("walk", 9, 12), sp)
    real = TokenEmitter.emit

    def emit(self, req, tokens):
        if req is bad and req.num_output_tokens >= 1:
            raise RuntimeError("injected")
        return real(self, req, tokens)

    monkeypatch.setattr(TokenEmitter, "emit", emit)
    drain(llm)
    assert bad.finish_reason == "abort" and "injected" in bad.error
    assert len(bad.logprobs) == bad.num_output_tokens == 1
    assert ok.error is None and ok.num_output_tokens == 20 and len(ok.logprobs) == 20


def _req(prompt, sp):
    from ddtree.engine.scheduling.request import Req

    return Req(prompt_ids=list(prompt), params=sp)
