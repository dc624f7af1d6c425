"""The prefix cache end to end on the toy pairs (fp32 CPU, T=0): multi-turn conversations sharing a
system prompt that ends mid-page give the same tokens with the cache as with --disable-radix-cache
(AR / DFLASH / DDTREE; dense and hybrid under both state strategies), while prompts really hit the
cache (a copy-on-write page included) and drafts are really accepted (mean accepted length > 2);
small pools force eviction and preemption and stay lossless; no KV write of a round reaches a shared
page (checked on every write); pools and ref counts drain clean."""

import logging
import re

import pytest
from engine_utils import make_llm, mean_accept, toy_pattern, toy_prompts

from ddtree import SamplingParams

MAX_TOKENS = 16
# log-probs too: on text this predictable a lost KV page can leave the argmax tokens unchanged
# (a skipped copy-on-write moves them by ~2e-2), while cache on vs off differ by < 1e-6
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True)
LOGPROB_TOL = 1e-4
PAGE = 4
pytestmark = pytest.mark.usefixtures("one_torch_thread")
LOGGED = re.compile(r"^Prefill batch\..*#cached-token: (\d+),")
SYSTEM = list(toy_prompts(6)[5][:10])  # 10 tokens of a corpus row: the branches start mid-page
USER, NEXT = 8, 4  # tokens of the first user turn, of each later one
# Each conversation's user turns are one clean corpus segment (the drafters' in-distribution text;
# unrelated cuts + filler tokens accepted only 1.1-1.4): turn 1 its first USER tokens, turn t + 1
# the NEXT tokens that follow the reply, where the segment goes on if the reply continued it.
TOPICS = [
    toy_pattern("prog", 3, 80, 2),
    toy_pattern("walk", 30, 80),
    toy_pattern("prog", 17, 80, -3),
]


def chat(llm, turns=2, n=3):
    """Turn 1: system + user; turn t: the conversation so far + the next user tokens."""
    convs = [SYSTEM + topic[:USER] for topic in TOPICS[:n]]
    outs = []
    for t in range(turns):
        got = llm.generate([list(c) for c in convs], PARAMS)
        outs += got
        at = USER + (t + 1) * MAX_TOKENS + t * NEXT
        convs = [c + o.token_ids + topic[at : at + NEXT] for c, o, topic in zip(convs, got, TOPICS)]
    return outs


def assert_same(outs, ref):
    """The same tokens and (to LOGPROB_TOL) the same target log-probs as the reference run."""
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    worst = max(
        abs(a.logprob - b.logprob)
        for o, r in zip(outs, ref)
        for a, b in zip(o.logprobs, r.logprobs)
    )
    assert worst < LOGPROB_TOL, f"log-probs differ by {worst:.2e}"


def assert_drained(llm):
    bm = llm.engine.runner.bm
    bm.check_integrity()
    assert bm.num_free_pages + bm.num_cached_pages == bm.num_pages
    assert bm.num_available_pages == bm.num_pages  # every cached page unreferenced
    assert all(n.lock == 0 for n in bm.cache.nodes())
    assert bm.num_free_slots == llm.engine.runner.cfg.max_running_requests


def conversation(pair, algorithm, cache, **kw):
    if algorithm == "DDTREE":
        kw.setdefault("speculative_ddtree_budget", 8)
    llm = make_llm(pair, algorithm, page_size=PAGE, disable_radix_cache=not cache, **kw)
    llm.engine.runner.check_writes = True
    return llm, chat(llm)


@pytest.fixture(scope="module")
def dense_reference(toy_pair):
    llm, outs = conversation(toy_pair, "NONE", False)
    # --disable-radix-cache: no cache, nothing reported cached
    assert llm.engine.runner.bm.cache is None and not any(o.cached_tokens for o in outs)
    return outs


@pytest.mark.parametrize("algorithm", ["NONE", "DFLASH", "DDTREE"])
def test_dense_cache_is_lossless_and_hits(toy_pair, dense_reference, algorithm):
    llm, outs = conversation(toy_pair, algorithm, True)
    assert_same(outs, dense_reference)
    if algorithm != "NONE":
        assert mean_accept(outs) > 2  # the comparison exercises accepted drafts
    cached = [o.cached_tokens for o in outs]
    # turn 1 runs as one batch (nothing cached yet); turn 2 reuses the whole conversation's full
    # pages (its prompt and all but the last output token are cached)
    assert cached[:3] == [0, 0, 0]
    assert all(c >= len(SYSTEM) + 4 for c in cached[3:])
    assert llm.engine.runner.bm.cache.stats.hit_tokens == sum(cached)
    assert_drained(llm)


def test_system_prompt_branches_mid_page_within_one_turn(toy_pair, dense_reference, caplog):
    # one request at a time: the second and third find the first's system prompt (2 full pages,
    # then the tokens they share of the cached page they branch off, copied)
    caplog.set_level(logging.INFO, logger="ddtree")
    llm, outs = conversation(toy_pair, "DDTREE", True, max_running_requests=1)
    assert_same(outs, dense_reference)
    assert mean_accept(outs) > 2
    cached = [o.cached_tokens for o in outs[:3]]
    assert cached[0] == 0 and all(c >= len(SYSTEM) for c in cached[1:])
    assert any(c % PAGE for c in cached[1:])  # a copy-on-write page
    logged = [int(m[1]) for r in caplog.records if (m := LOGGED.search(r.getMessage()))]
    assert sum(logged) == sum(o.cached_tokens for o in outs)  # the Prefill batch lines
    assert_drained(llm)


def test_eviction_and_preemption_stay_lossless(toy_pair, dense_reference):
    # 24 pages of 4 tokens: running requests preempt each other and the cache evicts
    llm, outs = conversation(toy_pair, "DDTREE", True, max_total_tokens=96)
    assert_same(outs, dense_reference)
    assert mean_accept(outs) > 2
    bm = llm.engine.runner.bm
    assert bm.cache.stats.evicted_pages > 0
    assert llm.engine.scheduler.num_preemptions > 0
    assert_drained(llm)


@pytest.mark.parametrize("strategy", ["extra_buffer", "no_buffer"])
def test_hybrid_cache_is_lossless_with_state_checkpoints(toy_hybrid_pair, strategy):
    kw = {"mamba_scheduler_strategy": strategy}
    ref = conversation(toy_hybrid_pair, "NONE", False, **kw)[1]
    llm, outs = conversation(toy_hybrid_pair, "DDTREE", True, **kw)
    assert_same(outs, ref)
    assert mean_accept(outs) > 2
    cached = [o.cached_tokens for o in outs]
    # a hybrid hit ends where a checkpoint is: the previous turn's prompt, cut to whole pages
    assert cached[:3] == [0, 0, 0]
    assert all(c > 0 and c % PAGE == 0 for c in cached[3:])
    assert llm.engine.runner.checkpoints is not None
    assert_drained(llm)


def test_hybrid_eviction_and_preemption_stay_lossless(toy_hybrid_pair):
    kw = {"mamba_scheduler_strategy": "no_buffer"}
    ref = conversation(toy_hybrid_pair, "NONE", False, **kw)[1]
    llm, outs = conversation(toy_hybrid_pair, "DFLASH", True, max_total_tokens=96, **kw)
    assert_same(outs, ref)
    assert mean_accept(outs) > 2
    assert llm.engine.runner.bm.cache.stats.evicted_pages > 0
    assert llm.engine.scheduler.num_preemptions > 0
    assert_drained(llm)


def test_a_skipped_copy_on_write_is_detected(toy_pair, dense_reference, monkeypatch):
    """Meta: if the branching request's copied page were left unwritten, the comparison would fail
    (on these conversations by the log-probs: the argmax tokens survive)."""
    from ddtree.engine.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "_copy_page", lambda self, src, dst, n: None)
    llm, outs = conversation(toy_pair, "DDTREE", True, max_running_requests=1)
    with pytest.raises(AssertionError):
        assert_same(outs, dense_reference)


def test_the_write_check_catches_a_round_writing_into_a_shared_page(toy_pair, monkeypatch):
    """Meta: cache one page too many (the one the next rounds write into) and the write check,
    wired into extend / verify / commit, fires."""
    from ddtree.engine.faults import EngineDead
    from ddtree.engine.memory.block_manager import BlockManager

    real = BlockManager.cache_prefix

    def greedy(self, req, tokens, num_tokens):
        return real(self, req, list(tokens) + [0] * PAGE, num_tokens + PAGE)

    monkeypatch.setattr(BlockManager, "cache_prefix", greedy)
    # broken bookkeeping is not one request's fault: the engine stops (engine/faults.py)
    with pytest.raises(EngineDead, match="shared cached pages"):
        conversation(toy_pair, "DDTREE", True)
