"""Fault isolation (issue 39, engine/faults.py): a kernel, sampler or host failure for one request
while three others run fails that request alone; the others finish with the tokens they would have
had, everything is released and the pools stay whole. What cannot be isolated kills the engine
(EngineDead) instead of leaving a silently degraded one."""

import pytest
from engine_utils import accepted_prompts, make_llm, mean_accept

from ddtree import SamplingParams
from ddtree.engine.faults import MAX_FAILURES_IN_A_ROW, EngineDead
from ddtree.engine.round import decoder as decoder_mod

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(toy_pair, one_torch_thread):
    return make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=8, page_size=4)


@pytest.fixture(scope="module")
def reference(llm):
    prompts = [list(p) for p in accepted_prompts(4)]
    outs = llm.generate(prompts, GREEDY)
    assert mean_accept(outs) > 2
    return prompts, [o.token_ids for o in outs]


def assert_clean(engine):
    bm = engine.runner.bm
    bm.check_integrity()
    bm.check_slots(engine.scheduler.running)
    assert not engine.has_unfinished() and not engine.requests
    assert bm.num_free_slots == engine.runner.cfg.max_running_requests
    assert not bm.pages, "a request still holds pages"


def check_isolated(llm, reference, reqs, culprit=1):
    prompts, expected = reference
    for i, r in enumerate(reqs):
        if i == culprit:
            assert r.error and "injected" in r.error and r.finish_reason == "abort"
        else:
            assert r.error is None and r.output_ids == expected[i], f"request {i} changed"
    assert_clean(llm.engine)


def test_a_kernel_failing_for_one_request_fails_it_alone(llm, reference, monkeypatch):
    engine = llm.engine
    prompts, _ = reference
    state = {"culprit": None, "fails": 0}
    real = engine.decoder.round

    def round_(reqs, max_context):
        if state["culprit"] in reqs and len(state["culprit"].output_ids) >= 3:
            state["fails"] += 1
            raise RuntimeError("injected kernel failure")
        return real(reqs, max_context)

    monkeypatch.setattr(engine.decoder, "round", round_)
    before = engine.faults.stats.batch_failures
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    state["culprit"] = reqs[1]
    for _ in range(400):
        if all(r.is_finished for r in reqs):
            break
        engine.step()
    check_isolated(llm, reference, reqs)
    # one batched failure, rolled back; the culprit then failed alone
    assert engine.faults.stats.batch_failures - before == 2 and state["fails"] == 2
    assert engine.faults.dead is None


def test_a_sampler_failing_for_one_request_fails_it_alone(llm, reference, monkeypatch):
    """The sampler raises whenever the culprit's (sampled) request is in the batch."""
    engine = llm.engine
    prompts, expected = reference
    sampled = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=7)
    real = decoder_mod.sample_nodes

    def sample_nodes(logits, params, *a, **kw):
        if any(p is sampled for p in params):
            raise ValueError("injected sampler failure")
        return real(logits, params, *a, **kw)

    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    for _ in range(3):  # the others are running when the culprit arrives
        engine.step()
    monkeypatch.setattr(decoder_mod, "sample_nodes", sample_nodes)
    bad = engine.add_request(prompts[0], sampled)
    for _ in range(400):
        if all(r.is_finished for r in reqs + [bad]):
            break
        engine.step()
    assert bad.error and "injected sampler failure" in bad.error
    assert bad.finish_reason == "abort"
    for r, exp in zip(reqs, expected):
        assert r.error is None and r.output_ids == exp
    assert_clean(engine)


def test_a_host_failure_fails_only_its_request_without_a_rollback(llm, reference, monkeypatch):
    engine = llm.engine
    prompts, _ = reference
    real = engine.emitter.emit
    target = {}

    def emit(req, tokens):
        if req is target.get("req") and len(req.output_ids) >= 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")
        return real(req, tokens)

    monkeypatch.setattr(engine.emitter, "emit", emit)
    rolled = engine.faults.stats.rolled_back
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    target["req"] = reqs[1]
    for _ in range(400):
        if all(r.is_finished for r in reqs):
            break
        engine.step()
    check_isolated(llm, reference, reqs)
    assert engine.faults.stats.rolled_back == rolled, "a host failure rolled the batch back"


def test_a_failing_release_still_frees_the_request(llm, reference, monkeypatch):
    """Caching a finished request's prefix raises: its slot and pages are freed all the same and
    the cache stays whole."""
    engine = llm.engine
    prompts, _ = reference
    bm = engine.runner.bm
    real = bm.cache_prefix
    target = {}

    def cache_prefix(req, tokens, num_tokens):
        if req is target.get("req") and req.is_finished:
            raise RuntimeError("injected cache failure")
        return real(req, tokens, num_tokens)

    monkeypatch.setattr(bm, "cache_prefix", cache_prefix)
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    target["req"] = reqs[1]
    for _ in range(400):
        if all(r.is_finished for r in reqs):
            break
        engine.step()
    prompts, expected = reference
    for i, r in enumerate(reqs):
        assert r.output_ids == expected[i]
    assert reqs[1].error and "injected cache failure" in reqs[1].error
    assert_clean(engine)


def test_a_prefill_failing_for_one_prompt_fails_it_alone(llm, reference, monkeypatch):
    engine = llm.engine
    prompts, expected = reference
    real = engine.runner.prefill
    poison = prompts[2][:5] + [prompts[2][5] + 1]

    def prefill(reqs, q_lens):
        if any(r.prompt_ids == poison for r in reqs):
            raise RuntimeError("injected prefill failure")
        return real(reqs, q_lens)

    monkeypatch.setattr(engine.runner, "prefill", prefill)
    reqs = [engine.add_request(p, GREEDY) for p in prompts[:2] + [poison] + prompts[3:]]
    for _ in range(400):
        if all(r.is_finished for r in reqs):
            break
        engine.step()
    assert reqs[2].error and "injected prefill failure" in reqs[2].error
    for i in (0, 1, 3):
        assert reqs[i].error is None and reqs[i].output_ids == expected[i]
    assert_clean(engine)


def test_a_device_error_kills_the_engine_and_says_so(toy_pair, one_torch_thread, monkeypatch):
    llm = make_llm(toy_pair, "DFLASH")
    engine = llm.engine

    def broken(*a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.decoder, "round", broken)
    prompts = [list(p) for p in accepted_prompts(2)]
    for p in prompts:
        engine.add_request(p, GREEDY)
    with pytest.raises(EngineDead, match="device error"):
        for _ in range(10):
            engine.step()
    with pytest.raises(EngineDead, match="illegal memory access"):
        engine.step()  # dead for good, with the first reason


def test_failures_that_fail_every_request_end_in_a_dead_engine(toy_pair, one_torch_thread):
    """A fault that is no request's (every round raises) is not isolated forever: after a bounded
    run of failures the engine is dead, not a server failing every request silently."""
    llm = make_llm(toy_pair, "NONE")
    engine = llm.engine

    def broken(*a, **kw):
        raise RuntimeError("injected: every round fails")

    engine.decoder.round = broken
    for p in accepted_prompts(8) * 3:
        engine.add_request(list(p), GREEDY)
    with pytest.raises(EngineDead, match="in a row failed"):
        for _ in range(10 * MAX_FAILURES_IN_A_ROW):
            engine.step()


def test_a_prompt_larger_than_the_pool_is_refused_at_admission(toy_pair, one_torch_thread):
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=8, max_total_tokens=64)
    bm = llm.engine.runner.bm
    with pytest.raises(ValueError, match="more KV cache than the server has"):
        llm.engine.add_request(list(range(5, 5 + bm.num_pages * bm.page_size)), GREEDY)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("strategy", ["extra_buffer", "no_buffer"])
def test_a_rolled_back_hybrid_batch_recomputes_its_state(
    toy_hybrid_pair, one_torch_thread, monkeypatch, strategy
):
    """Hybrid target: a batched round that raised after the recurrent state moved is rolled back
    to the tokens; the innocent requests' state is recomputed and their tokens are unchanged."""
    llm = make_llm(
        toy_hybrid_pair, "DDTREE", speculative_ddtree_budget=8, mamba_scheduler_strategy=strategy
    )
    engine = llm.engine
    prompts = [list(p) for p in accepted_prompts(4)]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    real = engine.decoder.round
    state = {}

    def round_(reqs, max_context):
        out = real(reqs, max_context)  # the state and KV have moved: fail after the commit
        if state.get("culprit") in reqs and len(state["culprit"].output_ids) >= 4:
            raise RuntimeError("injected failure after the commit")
        return out

    monkeypatch.setattr(engine.decoder, "round", round_)
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    state["culprit"] = reqs[2]
    for _ in range(400):
        if all(r.is_finished for r in reqs):
            break
        engine.step()
    assert reqs[2].error and "injected" in reqs[2].error
    for i in (0, 1, 3):
        assert reqs[i].error is None and reqs[i].output_ids == expected[i], f"request {i}"
    assert engine.faults.stats.rolled_back >= 4
    assert_clean(engine)
