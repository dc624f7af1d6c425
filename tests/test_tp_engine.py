"""Tensor parallelism end to end on the CPU: ranks are spawned processes joined over gloo on localhost.

TP=2 (and 4 where the heads allow: the dense toy pair's 2 KV heads are replicated at tp 4) emits the
same tokens as TP=1 at T=0 for AR, DFLASH and DDTREE, dense and hybrid, through `LLM`; the server at
TP=2 answers the same tokens, and a killed rank turns /health 503 (naming the rank) and fails the next
request instead of hanging. The references are TP=1 AR outputs (speculation is lossless: the
lossless tests show DFLASH / DDTREE == AR at TP=1). fp32 all-reduces sum in another order than one
rank's GEMM; these pairs' top-2 logit margins are wide enough that no token flips (a flip would show
here as a mismatch, with the tokens printed)."""

from __future__ import annotations

import functools
import os
import signal
import time

import httpx
import pytest
from engine_utils import accepted_prompts, make_llm, mean_accept

from ddtree import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# prompts the toy drafters accept (toy_prompts' short cuts accepted 1.1-2.1 here), so the speculative
# runs compare accepted drafts across ranks, not mostly one-token rounds
PROMPTS = [list(p) for p in accepted_prompts(3)]


@functools.lru_cache(maxsize=None)
def _reference(pair: tuple[str, str]) -> tuple[tuple[int, ...], ...]:
    outs = make_llm(pair, "NONE").generate(PROMPTS, GREEDY)
    return tuple(tuple(o.token_ids) for o in outs)


@pytest.fixture(params=["dense", "hybrid"])
def pair(request, toy_pair, toy_hybrid_pair):
    return toy_pair if request.param == "dense" else toy_hybrid_pair


def _generate(pair, algorithm: str, tp: int, params):
    kw = {"speculative_ddtree_budget": 6} if algorithm == "DDTREE" else {}
    llm = make_llm(pair, algorithm, tp_size=tp, random_seed=7, **kw)
    try:
        return llm.generate(PROMPTS, params)
    finally:
        llm.engine.shutdown()


class _Engine:
    """What `TPRank.sync` touches of an engine: its requests, add and abort."""

    def __init__(self):
        self.requests = {}

    def add_request(self, ids, params, rid):
        from ddtree.engine.scheduling.request import Req

        self.requests[rid] = Req(prompt_ids=list(ids), params=params, rid=rid)

    def abort(self, rid):
        self.requests.pop(rid, None)


def test_lockstep_digest_catches_a_rank_that_diverged(monkeypatch):
    """A follower applies rank 0's commands, then checks rank 0's digest against its own state."""
    from ddtree.engine.tp.rank import Message, RankFailure, TPRank, state_digest

    leader, follower = _Engine(), _Engine()
    leader.add_request([5, 6], GREEDY, "a")
    rank = TPRank(1, 2, control=None)
    sent = Message([("add", [5, 6], GREEDY, "a")], state_digest(leader))
    monkeypatch.setattr(rank, "_broadcast", lambda msg: sent)
    rank.sync(follower)
    assert list(follower.requests) == ["a"]
    leader.requests["a"].output_ids.append(9)  # rank 0 emitted a token this rank did not
    sent = Message([], state_digest(leader))
    with pytest.raises(RankFailure, match="rank 1 diverged from rank 0 before step 2"):
        rank.sync(follower)


@pytest.mark.parametrize("algorithm", ["NONE", "DFLASH", "DDTREE"])
def test_tp2_matches_tp1(pair, algorithm, one_torch_thread):
    outs = _generate(pair, algorithm, 2, GREEDY)
    got = [tuple(o.token_ids) for o in outs]
    assert tuple(got) == _reference(pair), (got, _reference(pair))
    if algorithm != "NONE":
        assert mean_accept(outs) > 2


def test_tp4_replicated_kv_heads_sampling_and_a_rank_dying_mid_run(toy_pair, one_torch_thread):
    """tp 4 over 2 KV heads (each replicated on 2 ranks). The sampled request draws on every rank:
    a rank whose draw differed would fail the lockstep digest and end the run. Then a rank is
    killed between two steps of a running request: the next step raises, naming it, at once."""
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    llm = make_llm(toy_pair, "DDTREE", tp_size=4, random_seed=7, speculative_ddtree_budget=6)
    try:
        outs = llm.generate(PROMPTS, [GREEDY, GREEDY, sampled])
        assert [tuple(o.token_ids) for o in outs[:2]] == list(_reference(toy_pair)[:2])
        assert mean_accept(outs[:2]) > 2
        assert len(outs[2].token_ids) == 12
        engine = llm.engine
        engine.add_request(PROMPTS[0], GREEDY)
        engine.step()  # the prefill
        os.kill(engine.tp.watch.procs[2].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 20
        engine.tp.watch.poll(wait_s=5.0)
        assert "tensor-parallel rank 2" in (engine.tp_problem() or "")
    finally:
        llm.engine.shutdown()


def test_server_tp2_and_a_killed_rank_fails_loudly(toy_pair, one_torch_thread):
    from server_fixtures import server_argv, thread_server

    argv = server_argv(toy_pair, "DFLASH", "--tp-size", "2")
    with thread_server(argv) as srv:
        try:
            sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
            body = {"input_ids": PROMPTS[1], "sampling_params": sp}
            r = httpx.post(srv.base_url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert tuple(r.json()["output_ids"]) == _reference(toy_pair)[1]
            assert r.json()["meta_info"]["spec_accept_length"] > 2
            rank1 = srv.engine.tp.watch.procs[1]
            os.kill(rank1.pid, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                health = httpx.get(srv.base_url + "/health", timeout=5)
                if health.status_code == 503:
                    break
                time.sleep(0.2)
            assert health.status_code == 503 and "rank 1" in health.text, health.text
            r = httpx.post(srv.base_url + "/generate", json=body, timeout=30)
            assert r.status_code >= 500 and "rank 1" in r.text, r.text
        finally:
            srv.engine.shutdown()


def test_a_failed_startup_ends_the_ranks_it_started(toy_pair, monkeypatch):
    """Rank 0 fails to load after spawning: it ends its ranks (they may be anywhere in their own
    startup, so no collective is attempted) instead of waiting on them."""
    from ddtree.engine import engine as engine_mod
    from ddtree.engine import setup

    started = []

    def spy(*a):
        tp = real(*a)
        started.append(tp)
        return tp

    def boom(*a, **k):
        raise OSError("boom: unreadable weights")

    real = engine_mod.start_ranks
    monkeypatch.setattr(engine_mod, "start_ranks", spy)
    monkeypatch.setattr(setup, "load_target", boom)
    t0 = time.monotonic()
    with pytest.raises(OSError, match="boom"):
        make_llm(toy_pair, "NONE", tp_size=2)
    (proc,) = started[0].watch.procs.values()
    assert proc.exitcode is not None and time.monotonic() - t0 < 30
