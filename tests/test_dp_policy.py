"""The --dp-size dispatcher's pieces without processes: the dispatch policies, the approximate
prefix index behind cache_aware, the /get_server_info merge, the /metrics merge, and DPEngine over
fake replicas (re-dispatch, back-pressure, seeds, health) (< 1 s)."""

from __future__ import annotations

import asyncio
import random
import types

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddtree import SamplingParams
from ddtree.server.async_engine import EngineUnavailable
from ddtree.server.dp.client import ReplicaBusy, ReplicaGone
from ddtree.server.dp.engine import DPEngine, Frontend, merge_snapshots
from ddtree.server.dp.metrics import DPMetrics
from ddtree.server.dp.policy import (
    BALANCE_ABS,
    CacheAware,
    RoundRobin,
    ShortestQueue,
    make_policy,
)
from ddtree.server.dp.prefix_index import PrefixIndex
from ddtree.server.metrics import ServerMetrics

PAGE = 4


def prompt(seed: int, n: int = 16) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def test_round_robin_cycles_over_the_live_replicas():
    rr = RoundRobin(3)
    loads = {0: 0, 1: 0, 2: 0}
    assert [rr.pick([], loads) for _ in range(4)] == [0, 1, 2, 0]
    # replica 1 died: the turn passes over it, and it comes back in order
    assert [rr.pick([], {0: 0, 2: 0}) for _ in range(3)] == [2, 0, 2]
    assert rr.pick([], loads) == 0


def test_shortest_queue_picks_the_fewest_in_flight_and_breaks_ties_in_turn():
    sq = ShortestQueue(3)
    assert sq.pick([], {0: 5, 1: 2, 2: 7}) == 1
    assert [sq.pick([], {0: 1, 1: 1, 2: 1}) for _ in range(3)] == [2, 0, 1]


def test_cache_aware_sends_a_shared_prefix_where_it_went():
    ca = CacheAware(2, PAGE)
    system = prompt(1, 12)
    first = ca.pick(system + [7, 7, 7, 7], {0: 0, 1: 0})
    # the other replica is idler, but the prefix (12 of 16 tokens, above the threshold) is there
    loads = {first: 3, 1 - first: 0}
    assert ca.pick(system + [8, 8, 8, 8], loads) == first
    # an unrelated prompt goes to the shortest queue
    assert ca.pick(prompt(2), loads) == 1 - first


def test_cache_aware_gives_up_the_hit_when_the_load_is_out_of_balance():
    ca = CacheAware(2, PAGE)
    ca.pick(prompt(1), {0: 0, 1: 1})  # -> 0
    assert ca.pick(prompt(1), {0: 8, 1: 2}) == 0  # within the thresholds: the hit
    busy = BALANCE_ABS + 4
    assert ca.pick(prompt(1), {0: busy, 1: 2}) == 1  # 20 vs 2: the load first
    assert ca.index.match(prompt(1)) == {0: 16, 1: 16}  # which then caches it too


def test_cache_aware_ignores_a_hit_below_the_threshold_and_spreads_new_prefixes():
    ca = CacheAware(2, PAGE)
    ca.pick(prompt(1, 8), {0: 0, 1: 1})  # replica 0 caches 2 pages
    # 4 of 40 tokens shared (10% < 30%): no hit; equal queues -> the replica with less cached
    assert ca.pick(prompt(1, 4) + prompt(9, 36), {0: 0, 1: 0}) == 1


def test_cache_aware_learns_the_finished_output():
    """A conversation's next turn = the last prompt + its answer + more: the replica that served
    the turn caches the answer too (the dispatcher marks prompt + output at the finish)."""
    ca = CacheAware(2, PAGE)
    turn = prompt(1, 8)
    r = ca.pick(turn, {0: 0, 1: 0})
    answer = prompt(5, 24)
    ca.on_finish(r, turn + answer)
    nxt = turn + answer + prompt(6, 8)  # 32 of 40 tokens known only through the output
    assert ca.index.match(nxt) == {r: 32}
    assert ca.pick(nxt, {r: 2, 1 - r: 0}) == r


def test_prefix_index_matches_whole_pages_only():
    idx = PrefixIndex(PAGE)
    idx.insert(0, list(range(10)))  # 2 full pages; the last 2 tokens are no page
    assert idx.match(list(range(10))) == {0: 8}
    assert idx.match(list(range(7))) == {0: 4}
    assert idx.match([1, 2, 3, 4]) == {}
    idx.insert(1, list(range(4)) + [9, 9, 9, 9])
    assert idx.match(list(range(12))) == {0: 8, 1: 4}


def test_prefix_index_evicts_the_least_recent_pages_within_capacity():
    idx = PrefixIndex(PAGE)
    idx.capacity[0] = 10
    old, new = prompt(1, 6 * PAGE), prompt(2, 6 * PAGE)
    idx.insert(0, old)
    idx.insert(0, new)  # 12 pages > 10: down to 9, the oldest (old's deepest) first
    assert idx.pages[0] == 9
    assert idx.match(new) == {0: 6 * PAGE}
    assert idx.match(old) == {0: 3 * PAGE}  # its first pages stay: the marks stay a prefix
    idx.forget(0)
    assert idx.match(new) == {} and idx.root.children == {}


def test_prefix_index_eviction_keeps_a_shared_parent_another_replica_uses():
    idx = PrefixIndex(PAGE)
    idx.capacity[0] = 2
    shared = prompt(1, 3 * PAGE)
    idx.insert(1, shared)
    idx.insert(0, shared)  # 3 pages > 2 for replica 0: down to 1; replica 1 keeps all 3
    assert idx.match(shared) == {1: 3 * PAGE, 0: PAGE}
    assert idx.pages == {1: 3, 0: 1}


def test_make_policy_names():
    assert isinstance(make_policy("round_robin", 2, 16), RoundRobin)
    assert type(make_policy("shortest_queue", 2, 16)) is ShortestQueue
    assert isinstance(make_policy("cache_aware", 2, 16), CacheAware)
    with pytest.raises(ValueError, match="unknown"):
        make_policy("random", 2, 16)


def test_server_info_merge_sums_counts_and_names_a_failed_integrity():
    a = {"num_running_requests": 2, "kv_pages_free": 10, "page_size": 16, "prefix_cache": True}
    b = {"num_running_requests": 1, "kv_pages_free": 30, "page_size": 16, "prefix_cache": True}
    merged = merge_snapshots([(0, a | {"kv_integrity": "ok"}), (1, b | {"kv_integrity": "ok"})])
    assert merged == {
        "num_running_requests": 3,
        "kv_pages_free": 40,
        "page_size": 16,
        "prefix_cache": True,
        "kv_integrity": "ok",
    }
    bad = merge_snapshots([(0, {"kv_integrity": "ok"}), (1, {"kv_integrity": "FAILED: leak"})])
    assert bad == {"kv_integrity": "replica 1: FAILED: leak"}
    assert merge_snapshots([]) == {}


def test_metrics_merge_labels_every_replica_sample_and_keeps_one_loop_lag():
    replicas = {}
    for rank, tokens in ((0, 5), (1, 7)):
        m = ServerMetrics("DDTREE", 8)
        m.on_progress(tokens, [3])
        m.on_finish("stop", 0.1)
        m.loop_lag.observe(0.5)  # a replica's own loop-lag family is never reported
        replicas[rank] = m.render()
    dp = DPMetrics()
    dp.dispatched.labels("0").inc(2)
    dp.loop_lag.observe(0.001)
    fams = {f.name: f for f in text_string_to_metric_families(dp.render(replicas).decode())}
    tokens = {s.labels["dp_rank"]: s.value for s in fams["ddtree_generation_tokens"].samples}
    assert tokens == {"0": 5.0, "1": 7.0}
    lag = [s for s in fams["ddtree_http_loop_lag_seconds"].samples if s.name.endswith("_count")]
    assert [(s.labels, s.value) for s in lag] == [({}, 1.0)]
    assert fams["ddtree_dp_dispatched_requests"].samples[0].labels == {"dp_rank": "0"}


class FakeReplica:
    """What DPEngine reads of a ReplicaClient, without a process: `outcome` raised by `add`."""

    def __init__(self, rank: int, outcome: Exception | None = None):
        self.rank, self.outcome = rank, outcome
        self.info, self.page_size = {"kv_pages_total": 100, "page_size": 16}, 16
        self.proc = types.SimpleNamespace(pid=1000 + rank, exitcode=0)
        self.gpus, self.failure, self.reported = None, None, None
        self.streams, self.added, self.dispatched = {}, [], 0
        self.keep_ids, self.on_finish, self.loop = False, None, None

    @property
    def load(self) -> int:
        return len(self.streams)

    def problem(self):
        return self.failure or self.reported

    async def add(self, st, ids, params, arrival):
        if self.outcome is not None:
            raise self.outcome
        self.streams[st.rid] = st
        self.added.append(params)


def dp_engine(*replicas, seed=7):
    args = types.SimpleNamespace(load_balance_method="round_robin", random_seed=seed)
    return DPEngine(args, list(replicas), Frontend(None, 100, 64, (0,)))


def submit(eng, params, n=1):
    async def go():
        eng.start()
        return [await eng.submit(lambda e: ([1, 2, 3], params)) for _ in range(n)]

    return asyncio.run(go())


GREEDY = SamplingParams(temperature=0)


def test_a_request_a_replica_could_not_admit_goes_to_the_next():
    gone, busy, ok = (
        FakeReplica(0, ReplicaGone("replica 0 was killed")),
        FakeReplica(1, ReplicaBusy("queue full")),
        FakeReplica(2),
    )
    eng = dp_engine(gone, busy, ok)
    (st,) = submit(eng, GREEDY)
    assert list(ok.streams) == [st.rid] and eng._owner[st.rid] is ok


def test_every_replica_full_is_a_503_with_retry_after():
    eng = dp_engine(FakeReplica(0, ReplicaBusy("queue full")), FakeReplica(1, ReplicaBusy("full")))
    with pytest.raises(EngineUnavailable, match="every replica is at capacity") as e:
        submit(eng, GREEDY)
    assert e.value.retry_after == 1
    dead = FakeReplica(0)
    dead.failure = "replica 0 was killed by SIGKILL"
    eng = dp_engine(dead)
    eng._started = True
    with pytest.raises(EngineUnavailable, match="killed by SIGKILL") as e:
        submit(eng, GREEDY)
    assert e.value.retry_after is None


def test_unseeded_sampled_requests_get_the_seed_stream_one_engine_would_draw():
    a, b = FakeReplica(0), FakeReplica(1)
    sampled = SamplingParams(temperature=1.0)
    submit(dp_engine(a, b, seed=7), sampled, n=4)
    draws = random.Random(7)
    expected = [draws.getrandbits(63) for _ in range(4)]
    assert [p.seed for p in a.added + b.added] == expected[0::2] + expected[1::2]
    c = FakeReplica(0)
    submit(dp_engine(c), SamplingParams(temperature=1.0, seed=5))
    submit(dp_engine(c), GREEDY)
    assert [p.seed for p in c.added] == [5, None]


def test_health_503_while_starting_then_degraded_while_one_replica_serves():
    a, b = FakeReplica(0), FakeReplica(1)
    eng = dp_engine(a, b)
    b.reported = "replica 1: warming up"
    assert eng.health_problem() == "replica 1: warming up"
    b.reported = None
    assert eng.health_problem() is None and eng.degraded() is None
    b.failure = "replica 1 (pid 1001) was killed by SIGKILL"
    assert eng.health_problem() is None
    assert eng.degraded() == "1 of 2 replicas serving; replica 1 (pid 1001) was killed by SIGKILL"
    a.reported = "the engine cannot go on: a device error"
    assert "killed by SIGKILL" in eng.health_problem()
