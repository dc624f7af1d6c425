"""Grammar mask work is bounded per request and never holds the others (issue 54 item 1,
engine/round/grammar_jobs.py): a grammar whose fill never returns fails its request alone after the
step budget while the batch's other requests decode what they decode alone; a slow grammar's tree
shrinks to the root (an AR row) and still decodes what AR decodes; a request over its total budget
fails; a job that finds every mask thread held fails with a 503, never a false "too complex".
Slowness is injected (a fill that blocks until the test releases it, or sleeps a fixed time), so
nothing depends on how fast this machine is. ~20 s on one thread."""

import threading
import time
from types import SimpleNamespace

import pytest
from engine_utils import accepted_prompts, make_llm

from ddtree import SamplingParams
from ddtree.engine.round import grammar_jobs
from ddtree.engine.round.grammar_jobs import MaskBudget, MaskFailure, MaskWorkers
from ddtree.grammar import Grammars, GrammarSpec
from ddtree.grammar.backend import MaskCancelled, Matcher

NO_ZERO = GrammarSpec.regex(r"[1-9]*")  # as test_grammar_engine.py: bites, drafts accepted
SLOW = GrammarSpec.regex(r"[1-9]*(x)?")  # the same language; its matchers' fills are made slow
GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture
def slow_fills(monkeypatch):
    """Matchers of SLOW fill only after `delay` seconds, or when `release` is set (delay None)."""
    state = SimpleNamespace(delay=None, release=threading.Event(), entered=0)
    real_matcher, real_fill = Grammars.matcher, Matcher._fill

    def matcher(self, spec):
        m = real_matcher(self, spec)
        m.slow = spec == SLOW
        return m

    def fill(self, masks, index):
        if getattr(self, "slow", False):
            state.entered += 1
            if state.delay is None:
                state.release.wait(60)
            else:
                time.sleep(state.delay)
        real_fill(self, masks, index)

    monkeypatch.setattr(Grammars, "matcher", matcher)
    monkeypatch.setattr(Matcher, "_fill", fill)
    yield state
    state.release.set()


@pytest.fixture(scope="module")
def prompts():
    return [list(p) for p in accepted_prompts(3)]


def _budget(llm, **kw) -> MaskBudget:
    b = llm.engine.decoder.mask_workers.budget
    for k, v in kw.items():
        setattr(b, k, v)
    return b


def test_tree_nodes_shrink_with_the_slowest_fill():
    b = MaskBudget(round_s=1.0, total_s=10.0, tree_s=0.05)
    fast, slow, slower = (SimpleNamespace(slowest_fill_s=s) for s in (1e-5, 0.01, 0.2))
    assert b.nodes(fast, 16) == 16  # 17 fills x 10 us: the whole tree
    assert b.nodes(slow, 16) == 4  # 5 fills (the root's and four nodes') in 50 ms
    assert b.nodes(slower, 16) == 0  # the root alone: an AR row


@pytest.mark.parametrize("algorithm", ["NONE", "DDTREE"])
def test_a_grammar_that_never_finishes_a_mask_fails_alone(
    toy_pair, prompts, slow_fills, algorithm, one_torch_thread
):
    kw = {"speculative_ddtree_budget": 16} if algorithm == "DDTREE" else {}
    llm = make_llm(toy_pair, algorithm, **kw)
    want = llm.generate(prompts[1:], [SamplingParams(grammar=NO_ZERO, **GREEDY)] * 2)
    _budget(llm, round_s=0.3)
    params = [SamplingParams(grammar=g, **GREEDY) for g in (SLOW, NO_ZERO, None)]
    alone_free = llm.generate(prompts[2:], SamplingParams(**GREEDY))
    t0 = time.monotonic()
    outs = llm.generate(prompts, params)
    took = time.monotonic() - t0
    assert not slow_fills.release.is_set()  # its fill never returned, and the others finished
    assert outs[0].finish_reason == "abort" and "regex" in outs[0].error
    assert "took over 0.3 s in one decoding step" in outs[0].error
    assert outs[1].token_ids == want[0].token_ids and outs[1].finish_reason == "length"
    assert outs[2].token_ids == alone_free[0].token_ids
    assert took < 30  # a wait on the blocked fill would not end before the fixture's 60 s
    assert llm.engine.decoder.mask_workers.timed_out == 1
    slow_fills.release.set()
    # the straggler stops at its next fill: the pool's thread comes back, the engine goes on
    again = llm.generate(prompts[1:2], SamplingParams(grammar=NO_ZERO, **GREEDY))
    assert again[0].token_ids == want[0].token_ids


def test_a_slow_grammar_decodes_with_a_root_only_tree(toy_pair, prompts, slow_fills):
    """Every fill of SLOW takes >= 20 ms: its tree is the root alone (the tree budget is 10 ms),
    one token a round, and the tokens are AR's under the same language."""
    ar = make_llm(toy_pair, "NONE").generate(prompts, SamplingParams(grammar=NO_ZERO, **GREEDY))
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16)
    _budget(llm, round_s=30.0, tree_s=0.01)
    slow_fills.delay = 0.02
    outs = llm.generate(
        prompts, [SamplingParams(grammar=g, **GREEDY) for g in (SLOW, NO_ZERO, SLOW)]
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    assert set(outs[0].accept_lengths) == {1} and set(outs[2].accept_lengths) == {1}
    assert max(outs[1].accept_lengths) > 1  # the fast grammar keeps its tree


def test_a_grammar_over_its_total_budget_fails(toy_pair, prompts, slow_fills):
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16)
    _budget(llm, round_s=30.0, total_s=0.1)
    slow_fills.delay = 0.03
    outs = llm.generate(prompts[:2], [SamplingParams(grammar=g, **GREEDY) for g in (SLOW, NO_ZERO)])
    assert outs[0].finish_reason == "abort" and "in all" in outs[0].error
    assert 0 < len(outs[0].token_ids) < GREEDY["max_tokens"]
    assert outs[1].finish_reason == "length"


def test_a_job_without_a_thread_is_told_the_server_is_busy(monkeypatch):
    monkeypatch.setattr(grammar_jobs, "STRAGGLERS", 0)
    workers = MaskWorkers(1, MaskBudget(round_s=0.2))
    release = threading.Event()

    def matcher():
        return SimpleNamespace(fill_s=0.0, slowest_fill_s=0.0, cancelled=False)

    stuck, waiting = matcher(), matcher()
    try:
        out = workers.run({0: (stuck, "regex", lambda: release.wait(60))})
        assert isinstance(out[0], MaskFailure) and out[0].status == 400 and stuck.cancelled
        out = workers.run({1: (waiting, "regex", lambda: "mask")})  # the one thread is held
        assert out[1] == MaskFailure(
            "the server is busy with other requests' grammar work; retry", 503, "server_busy"
        )
    finally:
        release.set()
    workers.pool.submit(lambda: None).result(timeout=30)  # the thread is back
    assert workers.run({2: (matcher(), "regex", lambda: "mask")}) == {2: "mask"}
    workers.close()


def test_a_cancelled_matcher_fills_no_more(toy_pair):
    from ddtree import LLM

    grammars = LLM(toy_pair[0], dtype="float32", device="cpu").engine.grammars
    m = grammars.matcher(NO_ZERO)
    m.cancelled = True
    import torch

    with pytest.raises(MaskCancelled):
        m.fill(torch.zeros((1, grammars.words), dtype=torch.int32), 0)


def test_lockstep_budget_has_no_clock():
    """Under tensor parallelism every rank builds the trees: no deadline, no size from a clock."""
    b = MaskBudget.lockstep()
    assert b.nodes(SimpleNamespace(slowest_fill_s=5.0), 16) == 16
    workers = MaskWorkers(1, b)
    m = SimpleNamespace(fill_s=1e9, slowest_fill_s=0.0, cancelled=False)
    assert workers.run({0: (m, "regex", lambda: time.sleep(0.05) or "mask")}) == {0: "mask"}
    workers.close()
