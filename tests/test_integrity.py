"""`ddtree.engine.integrity`: whole on a busy hybrid engine at every step (prefix cache,
checkpoints, preemption, a stop inside an accepted block), and each broken invariant named when
one is broken by hand (then put back). About 3 s."""

import contextlib

import pytest
import torch
from engine_utils import accepted_prompts, make_llm

from ddtree import SamplingParams
from ddtree.engine import integrity


@pytest.fixture(scope="module")
def busy(toy_hybrid_pair):
    """A hybrid DDTREE engine with requests in flight: some prefilling in chunks, some decoding,
    one waiting, cached pages and checkpoints in the pool."""
    llm = make_llm(
        toy_hybrid_pair,
        "DDTREE",
        speculative_ddtree_budget=8,
        page_size=4,
        max_total_tokens=160,
        chunked_prefill_size=8,
        max_running_requests=3,
    )
    e = llm.engine
    prompts = [list(p) for p in accepted_prompts(6)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=True)
    warm = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=12, stop=[" 1"]))
    assert any(o.finish_reason == "stop" for o in warm) or warm
    for p in prompts:
        e.add_request(p, sp)
    for _ in range(4):
        e.step()
        assert integrity.problems(e, deep=True) == []
    assert e.scheduler.running and e.scheduler.waiting
    assert e.runner.bm.num_cached_pages and e.runner.checkpoints.free_rows is not None
    return e


def test_whole_through_a_run(toy_hybrid_pair):
    llm = make_llm(
        toy_hybrid_pair, "DDTREE", speculative_ddtree_budget=8, page_size=4, max_total_tokens=120
    )
    e = llm.engine
    for p in accepted_prompts(8):
        e.add_request(list(p), SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[30]))
    while e.has_unfinished():
        e.step()
        assert integrity.problems(e, deep=True) == []
    assert e.scheduler.num_preemptions > 0 and e.runner.bm.cache.stats.evicted_pages > 0
    assert integrity.drained_problems(e, deep=True) == []


@contextlib.contextmanager
def broken(undo):
    try:
        yield
    finally:
        undo()


def found(e, needle: str, deep: bool = False) -> bool:
    bad = integrity.problems(e, deep)
    assert bad, "nothing found"
    return any(needle in b for b in bad)


def test_each_broken_invariant_is_named(busy):
    e = busy
    bm, sched = e.runner.bm, e.scheduler
    run = next(r for r in sched.running if not r.needs_prefill)
    page = bm.free_pages.popleft()
    with broken(lambda: bm.free_pages.appendleft(page)):
        assert found(e, "pages leaked")
    bm.free_slots.append(run.slot)  # free while held
    with broken(bm.free_slots.pop):
        assert found(e, "request slots")
    run.kv_len += 1
    with broken(lambda: setattr(run, "kv_len", run.kv_len - 1)):
        assert found(e, "outside 1..")
    waiting = sched.waiting[0]
    waiting.kv_len = 3
    with broken(lambda: setattr(waiting, "kv_len", 0)):
        assert found(e, "waiting with")
    node = next(n for n in bm.cache.nodes() if n.lock)
    key = node.key
    node.key = (key[0] + 1,) + key[1:]
    with broken(lambda: setattr(node, "key", key)):
        assert found(e, "not the request's tokens")
    run.logprobs.append(run.logprobs[-1])
    with broken(run.logprobs.pop):
        assert found(e, "log-prob entries")
    e.requests["ghost"] = run
    with broken(lambda: e.requests.pop("ghost")):
        assert found(e, "engine requests")
    e.emitter.lag["ghost"] = 1
    with broken(lambda: e.emitter.lag.pop("ghost")):
        assert found(e, "deferred text")
    assert integrity.problems(e, deep=True) == []


def test_checkpoint_rows_are_owned_once(busy):
    e = busy
    ck, cache = e.runner.checkpoints, e.runner.bm.cache
    row, node = next(iter(cache.checkpoints.items()))
    ck.free_rows.append(row)
    with broken(ck.free_rows.pop):
        assert found(e, "both free and held")
    node.checkpoint = None
    with broken(lambda: setattr(node, "checkpoint", row)):
        assert found(e, "names another row")
    held = cache.checkpoints.pop(row)
    with broken(lambda: cache.checkpoints.__setitem__(row, held)):
        assert found(e, "checkpoint")
    assert integrity.problems(e, deep=True) == []


def test_deep_checks_read_the_device(busy):
    e = busy
    bm, pool = e.runner.bm, e.runner.state_pool
    run = e.scheduler.running[0]
    old = bm.block_table[run.slot, 0].item()
    bm.block_table[run.slot, 0] = old + 1
    with broken(lambda: bm.block_table[run.slot].__setitem__(0, old)):
        assert not any("block-table" in b for b in integrity.problems(e))
        assert found(e, "block-table row", deep=True)
    saved = pool.ssm[0, run.slot].clone()
    pool.ssm[0, run.slot, 0, 0, 0] = torch.nan
    with broken(lambda: pool.ssm[0, run.slot].copy_(saved)):
        assert found(e, "non-finite ssm", deep=True)
    assert integrity.problems(e, deep=True) == []


def test_drained_means_nothing_held(toy_pair):
    llm = make_llm(toy_pair, "DFLASH", page_size=4)
    e = llm.engine
    llm.generate(
        [list(p) for p in accepted_prompts(3)], SamplingParams(temperature=0, max_tokens=9)
    )
    assert integrity.drained_problems(e) == []
    node = e.runner.bm.cache.nodes()[0]
    e.runner.bm.cache.lock(node)  # a reference nobody holds: the page is never available again
    with broken(lambda: e.runner.bm.cache.unlock(node)):
        bad = integrity.drained_problems(e)
        assert any("not available" in b for b in bad) and any("ref count" in b for b in bad)
    assert integrity.drained_problems(e) == []
    with pytest.raises(integrity.IntegrityError, match="not drained"):
        e.add_request(list(accepted_prompts(1)[0]), SamplingParams(max_tokens=2))
        integrity.check_drained(e)
