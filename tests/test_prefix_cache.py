"""The prefix cache's bookkeeping without a model: radix matching (full pages, then a copy-on-write
page), reference counts, LRU eviction of unreferenced leaves only, the shared-page write check, hybrid
hits truncated to a checkpoint, and the memory plan's checkpoint rows; meta-tests show the integrity
and write checks can fail."""

import pytest
import torch

from ddtree.engine.memory.block_manager import NO_HIT, BlockManager
from ddtree.engine.scheduling.request import Req, SamplingParams

P = 4  # page size


def bm(num_pages=8, max_reqs=4):
    return BlockManager(num_pages, P, max_reqs, 8, "cpu", prefix_cache=True)


def req(tokens):
    return Req(prompt_ids=list(tokens), params=SamplingParams())


def prefill(b, r, n, copies=None):
    """Admit `r` with its hit, allocate n tokens and cache its full pages (as the runner does)."""
    hit = b.match(r.prompt_ids, n - 1)
    b.attach(r, hit, lambda s, d, k: copies.append((s, d, k)) if copies is not None else None)
    b.allocate(r, n)
    b.cache_prefix(r, r.prompt_ids, n)
    return hit


def test_match_full_pages_then_a_copy_on_write_page():
    b = bm()
    a = req(range(10))
    prefill(b, a, 10)
    assert b.num_cached_pages == 2  # tokens 0..7; the partial third page stays private
    hit = b.match(list(range(6)) + [99, 98], 7)
    assert hit.length == 6 and len(hit.nodes) == 1 and hit.cow[1] == 2
    assert hit.cow[0].page == b.pages[a.slot][1]
    copies = []
    r = req(list(range(6)) + [99, 98])
    prefill(b, r, 8, copies)
    # the branch mid-page copied page 1's first two slots into a private page instead of sharing it
    assert copies == [(b.pages[a.slot][1], b.pages[r.slot][1], 2)]
    assert b.shared[r.slot] == 2 and b.pages[r.slot][0] == b.pages[a.slot][0]
    assert b.pages[r.slot][1] != b.pages[a.slot][1]  # its own page 1 was inserted as a sibling
    b.check_integrity()


def test_a_full_hit_keeps_the_last_prompt_token_uncached():
    b = bm()
    prefill(b, req(range(8)), 8)
    hit = b.match(list(range(8)), 7)
    assert hit.length == 7 and len(hit.nodes) == 1 and hit.cow[1] == 3


def test_ref_counts_and_lru_eviction_of_unreferenced_leaves_only():
    b = bm(num_pages=8)
    old, new, live = req(range(100, 108)), req(range(200, 208)), req(range(300, 308))
    for r in (old, new, live):
        prefill(b, r, 8)
    b.free(old, old.prompt_ids, 8)
    b.free(new, new.prompt_ids, 8)
    # 6 cached pages; `live` references its 2, the other 4 are evictable
    assert b.num_cached_pages == 6 and b.num_free_pages == 2 and b.num_available_pages == 6
    b.check_integrity()
    x = req(range(500, 520))
    assert b.can_allocate(x, 24) and not b.can_allocate(x, 28)
    b.allocate(x, 16)  # 2 free + 2 evicted: old's leaf first, then old's root page
    assert b.match(list(range(100, 108)), 8) is NO_HIT
    assert len(b.match(list(range(200, 208)), 8).nodes) == 2
    assert len(b.match(list(range(300, 308)), 8).nodes) == 2  # locked: never evicted
    assert b.cache.stats.evicted_pages == 2
    b.check_integrity()
    for r in (live, x):
        b.free(r, r.prompt_ids, 8 if r is live else 0)
    b.check_integrity()
    assert b.num_available_pages == b.num_pages
    assert all(n.lock == 0 for n in b.cache.nodes())


def test_duplicate_pages_are_replaced_by_the_cached_copy():
    b = bm()
    a, c = req(range(8)), req(range(8))
    for r in (a, c):  # admitted together: neither hits
        b.attach(r, NO_HIT, None)
        b.allocate(r, 8)
    b.cache_prefix(a, a.prompt_ids, 8)
    mine = list(b.pages[c.slot])
    b.cache_prefix(c, c.prompt_ids, 8)
    assert b.pages[c.slot] == b.pages[a.slot] and set(mine) <= set(b.free_pages)
    assert b.cache.nodes()[0].lock == 2
    b.check_integrity()


def test_integrity_and_write_checks_can_fail():
    b = bm()
    r = req(range(10))
    prefill(b, r, 10)
    shared_slot = b.pages[r.slot][0] * P + 1
    private_slot = b.pages[r.slot][2] * P
    b.check_writes(torch.tensor([private_slot]))
    with pytest.raises(AssertionError, match="shared cached pages"):
        b.check_writes(torch.tensor([private_slot, shared_slot]))
    node = b.node[r.slot]
    node.lock += 1
    with pytest.raises(AssertionError, match="ref count"):
        b.check_integrity()
    node.lock -= 1
    b.free_pages.append(b.pages[r.slot][0])
    with pytest.raises(AssertionError, match="owned twice"):
        b.check_integrity()


def test_hybrid_hits_stop_at_the_deepest_checkpoint():
    b = bm()
    prefill(b, req(range(13)), 13)
    nodes = b.cache.nodes()
    assert len(nodes) == 3
    # no checkpoint: nothing to reuse, and the 3 cached pages are counted as missed for it
    none = b.match(list(range(13)), 12, checkpointed=True)
    assert (none.length, none.nodes, none.state_miss) == (0, (), 12)
    first = b.match(list(range(4)), 4).nodes[0]
    b.cache.set_checkpoint(first, 0)
    hit = b.match(list(range(13)), 12, checkpointed=True)
    assert hit.length == 4 and hit.cow is None and hit.nodes == (first,) and hit.state_miss == 8
    assert b.cache.take_lru_checkpoint() == 0 and first.checkpoint is None
    assert b.cache.stats.checkpoint_drops == 1


def _level(ttft, tput, hit=0.0, failed=0):
    return {
        "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
        "output_throughput": tput,
        "cache_hit_rate": hit,
        "failed": failed,
    }


def test_bench_prefix_cache_checks_the_targets():
    from ddtree.tools.studies.prefix_cache import format_report, make_parser, verdict

    ns = make_parser().parse_args(["--model-path", "m"])
    res = {
        "cache": {"shared": _level(20, 1010, 0.9), "distinct": _level(100, 990)},
        "no cache": {"shared": _level(120, 1000), "distinct": _level(100, 1000)},
    }
    rows = verdict(res, ns)
    assert [ok for *_, ok in rows] == [True, True, True, True]
    assert "PASS  shared TTFT p50" in format_report(res, rows)
    res["cache"]["shared"] = _level(30, 990, 0.9)  # 4x, and slower
    res["cache"]["distinct"] = _level(100, 970, failed=1)  # 3% down, a failure
    assert [ok for *_, ok in verdict(res, ns)] == [False, False, False, False]


def test_multiturn_conversations_share_one_system_prompt_unless_distinct():
    from ddtree.bench import multiturn
    from ddtree.bench.serving import make_parser

    ns = make_parser().parse_args(["--workload", "multiturn", "--num-prompts", "3"])
    convs = multiturn.conversations(ns)
    assert len(convs) == 3 and len(convs[0][0]) == 2048 and len(convs[0][1]) == 4
    assert convs[0][0] == convs[2][0] and convs[0][1] != convs[1][1]
    ns.distinct_system_prompts = True
    assert multiturn.conversations(ns)[0][0] != multiturn.conversations(ns)[1][0]
    ns.token_id_max = ns.token_id_min
    assert multiturn.check(ns) is not None


def test_the_lru_heap_stays_bounded_without_evictions():
    b = bm(num_pages=8)
    for _ in range(200):  # the same prompt again and again: each release pushes its leaf
        r = req(range(8))
        prefill(b, r, 8)
        b.free(r, r.prompt_ids, 8)
    assert len(b.cache._heap) <= 2 * b.num_cached_pages + 64
    b.allocate(req(range(50, 82)), 32)  # all 8 pages: both cached ones evicted, newest last
    assert b.num_cached_pages == 0 and b.cache.stats.evicted_pages == 2
    b.check_integrity()


def test_checkpoints_reuse_the_least_recently_used_row_when_full():
    import types

    from ddtree.engine.memory.state_checkpoints import StateCheckpoints

    pool = types.SimpleNamespace(
        conv=torch.zeros(2, 3, 4, 1), ssm=torch.zeros(2, 3, 2, 2, 2), device=torch.device("cpu")
    )
    ck = StateCheckpoints(pool, 1)
    b = bm()
    old, new = req(range(4)), req(range(10, 14))
    for r, value in ((old, 1.0), (new, 2.0)):
        prefill(b, r, 4)
        pool.ssm[:, r.slot] = value
        ck.keep(b.cache, b.node[r.slot], r.slot)
    assert b.node[old.slot].checkpoint is None and b.node[new.slot].checkpoint == 0
    ck.restore(0, 2)
    assert (pool.ssm[:, 2] == 2.0).all()
    b.free(new, new.prompt_ids, 4)
    b.drop_checkpoint = ck.give_back  # as the runner wires it
    b.allocate(req(range(20, 48)), 28)  # evicts new's page: its checkpoint row comes back
    assert list(ck.free_rows) == [0] and not b.cache.checkpoints
    b.check_integrity()


def test_decode_evicts_cached_pages_before_preempting():
    import types

    from ddtree.engine.scheduling.scheduler import Scheduler

    b = bm(num_pages=8)
    cold = req(range(100, 116))  # 4 pages, then cached and unreferenced
    prefill(b, cold, 16)
    b.free(cold, cold.prompt_ids, 16)
    hot = req(range(8))
    hot.output_ids = [1]
    prefill(b, hot, 8)
    hot.kv_len = 8
    runner = types.SimpleNamespace(
        bm=b, release=lambda r: b.free(r), checkpoint_align=0, match_prefix=None, admit=None
    )
    s = Scheduler(runner, max_running=4, chunk_tokens=64, verify_width=16)
    s.running.append(hot)
    assert b.num_free_pages == 2 and b.num_available_pages == 6
    batch = s._schedule_decode()  # needs 4 more pages: 2 free + 2 evicted, nobody preempted
    assert batch.reqs == [hot] and s.num_preemptions == 0
    b.allocate(hot, 8 + 16)
    assert b.cache.stats.evicted_pages == 2 and b.num_free_pages == 0
    b.check_integrity()


def test_multiturn_refuses_single_workload_flags():
    from ddtree.bench.serving import main

    assert main(["--workload", "multiturn", "--chat"]) == 2
    assert main(["--workload", "multiturn", "--request-rate", "4"]) == 2
