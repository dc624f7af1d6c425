"""Prometheus metrics for the server. One registry per server (tests run several in one process).

Everything is written by the engine thread (counters as requests advance, gauges after every step) and only
rendered by the HTTP side, so the pool gauges always describe a state between two engine steps.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ddtree.engine.boundary import EngineProtocol, EngineStats, FaultCounts, PrefixCacheStats
from ddtree.engine.round.clock import DEVICE_PARTS, PHASES
from ddtree.engine.scheduling.step_stats import StepStats, step_metric

THROUGHPUT_WINDOW_S = 5.0
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT_PART_BUCKETS = (
    1e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    5.0,
    30.0,
)
BUDGET_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ACCEPT_BUCKETS = tuple(float(k) for k in range(1, 17))  # tokens a request-round emits
# a round's verify rows in all: batch 1 at AR up to batch 256 of 65-node trees
ROWS_BUCKETS = tuple(float(1 << k) for k in range(15))
SPREAD_BUCKETS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
ROUND_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2e-3,
    4e-3,
    6e-3,
    8e-3,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.1,
)
ROUND_PARTS = ("round", "host", "server", "hidden")
LOOP_PROBE_S = 0.01  # the HTTP loop's lag probe period (`probe_loop_lag`)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, algorithm: str, max_accept_length: int):
        r = self.registry = CollectorRegistry()
        self.algorithm = algorithm
        self.requests = Counter(
            "ddtree_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "ddtree_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("ddtree_generation_tokens", "Generated tokens", registry=r)
        self.throughput = Gauge(
            "ddtree_generation_throughput_tokens_per_second",
            f"Generated tokens per second of busy time (engine steps and the server loop around "
            f"them; idle waits for requests excluded) over the last {THROUGHPUT_WINDOW_S:.0f} s",
            registry=r,
        )
        self.running = Gauge(
            "ddtree_num_running_requests", "Requests in the running batch", registry=r
        )
        self.waiting = Gauge(
            "ddtree_num_waiting_requests",
            "Queue depth: requests waiting to be scheduled",
            registry=r,
        )
        self.preemptions = Gauge(
            "ddtree_num_preemptions", "Preemptions (KV recomputed) since start", registry=r
        )
        self.kv_total = Gauge("ddtree_kv_pages_total", "KV cache pages", registry=r)
        self.kv_free = Gauge("ddtree_kv_pages_free", "Free KV cache pages", registry=r)
        self.kv_used = Gauge("ddtree_kv_pages_used", "KV cache pages owned by requests", registry=r)
        self.kv_usage = Gauge("ddtree_kv_usage_ratio", "Used / total KV pages", registry=r)
        self.slots_total = Gauge(
            "ddtree_request_slots_total", "Request slots (block-table rows)", registry=r
        )
        self.slots_free = Gauge("ddtree_request_slots_free", "Free request slots", registry=r)
        self.state_total = Gauge(
            "ddtree_state_pool_slots_total",
            "Recurrent-state pool rows (0: dense target)",
            registry=r,
        )
        self.state_used = Gauge(
            "ddtree_state_pool_slots_used", "Recurrent-state pool rows in use", registry=r
        )
        self.rounds = Counter(
            "ddtree_spec_rounds",
            "Decoding rounds (one verify forward per request)",
            ["algorithm"],
            registry=r,
        )
        self.accept_length = Histogram(
            "ddtree_accept_length",
            "Tokens emitted per round (accepted draft tokens + bonus)",
            ["algorithm"],
            buckets=tuple(float(k) for k in range(1, max(2, max_accept_length) + 1)),
            registry=r,
        )
        # per-position acceptance (vLLM's num_accepted_tokens_per_pos): of the request-rounds that
        # verified drafts, how many accepted a draft at depth d; their ratio is the acceptance
        # rate by depth, the drafter's quality position by position
        self.spec_drafts = Counter(
            "ddtree_spec_drafts",
            "Request-rounds that verified drafted tokens (budget > 0), per algorithm",
            ["algorithm"],
            registry=r,
        )
        self.accepted_by_depth = Counter(
            "ddtree_spec_accepted_by_depth",
            "Request-rounds whose accepted path reached draft depth d (d = 1 the first drafted "
            "token); over ddtree_spec_drafts: the acceptance rate by depth",
            ["algorithm", "depth"],
            registry=r,
        )
        self._depth_counters: list = []  # accepted_by_depth's children, depth 1 first
        self.spec_accept_length = Histogram(
            "ddtree_spec_accept_length",
            "Tokens a request-round that verified drafts emitted (accepted drafts + the bonus), "
            "per algorithm: the accepted-length distribution beside ddtree_spec_accepted_by_depth",
            ["algorithm"],
            buckets=ACCEPT_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "ddtree_time_to_first_token_seconds",
            "Arrival (HTTP handler) to the first token published to the stream",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # the TTFT by phase (vLLM's request_queue_time / request_prefill_time)
        self.queue_time = Histogram(
            "ddtree_request_queue_time_seconds",
            "Arrival to the first admission into a prefill batch (the wait for the running step "
            "included)",
            buckets=TTFT_PART_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "ddtree_request_prefill_time_seconds",
            "First admission to the first token sampled (every prompt chunk and the steps between)",
            buckets=TTFT_PART_BUCKETS,
            registry=r,
        )
        self.publish_time = Histogram(
            "ddtree_request_first_token_publish_seconds",
            "First token sampled to published to its stream",
            buckets=TTFT_PART_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "ddtree_e2e_request_latency_seconds",
            "Admission to finish",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_errors = Counter("ddtree_engine_errors", "Engine steps that raised", registry=r)
        # fault isolation (engine/faults.py)
        self.failed_alone = Counter(
            "ddtree_requests_failed_alone",
            "Requests failed by a fault of their own while the others went on",
            registry=r,
        )
        self.batch_failures = Counter(
            "ddtree_batch_failures",
            "Batched steps that raised and were rolled back to isolate the culprit",
            registry=r,
        )
        self.integrity_checks = Counter(
            "ddtree_pool_integrity_checks", "Pool integrity checks run after failures", registry=r
        )
        self.integrity_ok = Gauge(
            "ddtree_pool_integrity",
            "1 while the last pool integrity check passed (KV pages, cache ref counts, slots)",
            registry=r,
        )
        self.engine_dead = Gauge(
            "ddtree_engine_dead", "1 when the engine cannot go on (/health answers 503)", registry=r
        )
        self.integrity_ok.set(1)
        self._faults_seen = (0, 0, 0)
        self.gc_pause = Histogram(  # server/gc_watch.py: every collection, any thread
            "ddtree_gc_pause_seconds",
            "Python garbage-collector pauses by generation (each stops the engine and HTTP loops)",
            ["generation"],
            buckets=TTFT_PART_BUCKETS,
            registry=r,
        )
        self.kv_cached = Gauge(
            "ddtree_kv_pages_cached", "KV pages held by the prefix cache", registry=r
        )
        self.cache_queried = Counter(
            "ddtree_prefix_cache_queried_tokens",
            "Prefill tokens looked up in the prefix cache at admission",
            registry=r,
        )
        self.cache_hits = Counter(
            "ddtree_prefix_cache_hit_tokens", "Of those, tokens found cached", registry=r
        )
        self.cache_hit_rate = Gauge(
            "ddtree_prefix_cache_hit_rate", "Hit tokens / queried tokens since start", registry=r
        )
        self.cache_evictions = Counter(
            "ddtree_prefix_cache_evicted_pages", "Cached KV pages evicted (LRU)", registry=r
        )
        # hybrid targets: a hit ends at a recurrent-state checkpoint; these say why one did not
        self.cache_state_misses = Counter(
            "ddtree_prefix_cache_state_miss_tokens",
            "Hybrid: cached KV tokens recomputed because no recurrent-state checkpoint ended them",
            registry=r,
        )
        self.checkpoint_drops = Counter(
            "ddtree_prefix_cache_checkpoint_drops",
            "Hybrid: state checkpoints taken from their cached prefix for a newer one (LRU)",
            registry=r,
        )
        self.checkpoint_rows = Gauge(
            "ddtree_prefix_cache_checkpoint_rows",
            "Hybrid: recurrent-state checkpoint rows of the prefix cache (0: no prompt can hit)",
            registry=r,
        )
        self._cache_seen = (0, 0, 0, 0, 0)
        # ---- engine steps (engine/scheduling/step_stats.py): prefill path (graphed / eager), decode batches
        self.steps = {
            name: Counter(step_metric(name), f"Engine steps: {name} since start", registry=r)
            for name in StepStats().as_dict()
        }
        self._steps_seen: dict[str, float] = {}
        # ---- budgets and per-round host time (one observation per decode round / request-round)
        self.budget = Histogram(
            "ddtree_spec_budget",
            "DDTree budget per request-round (drafted nodes verified; DFLASH: the chain; 0: AR)",
            buckets=BUDGET_BUCKETS,
            registry=r,
        )
        self.verify_rows = Histogram(
            "ddtree_spec_verify_rows",
            "Verify rows a decode round chose in all: each request's root plus its drafted nodes "
            "(per request: ddtree_spec_budget + 1)",
            buckets=ROWS_BUCKETS,
            registry=r,
        )
        self.verify_rows_spread = Histogram(
            "ddtree_spec_verify_rows_spread",
            "Per decode round: the standard deviation of the verify rows per request across its "
            "batch (0: every request given the same budget)",
            buckets=SPREAD_BUCKETS,
            registry=r,
        )
        self.round_predicted = Counter(
            "ddtree_spec_predicted_round_seconds",
            "The cost model's seconds for the decode rounds it priced (auto)",
            registry=r,
        )
        self.round_priced = Counter(
            "ddtree_spec_priced_round_seconds",
            "Measured decoder round seconds of the rounds in ddtree_spec_predicted_round_seconds "
            "(the device span where the GPU clock is read, else the round's wall time)",
            registry=r,
        )
        self.rounds_priced = Counter(
            "ddtree_spec_priced_rounds", "Decode rounds the cost model priced (auto)", registry=r
        )
        self.verify_width = Counter(
            "ddtree_spec_verify_width_rounds",
            "Decode rounds by verify width (1 + the round's largest budget)",
            ["width"],
            registry=r,
        )
        self.rung = Counter(
            "ddtree_spec_rung_rounds",
            "Decode rounds by the budget policy's choice (ar, chain, tree<B>: built at budget B)",
            ["rung"],
            registry=r,
        )
        self.explore = Counter(
            "ddtree_spec_explore_rounds",
            "Of ddtree_spec_rung_rounds, the rounds the budget policy ran one rung above its best "
            "to measure the gain curve there (auto)",
            ["rung"],
            registry=r,
        )
        self.rung_cost = Gauge(
            "ddtree_spec_rung_cost_seconds",
            "The budget policy's round seconds per batch bucket and rung (profiled at startup, or "
            "its estimate; auto)",
            ["batch", "rung"],
            registry=r,
        )
        self.predicted = Counter(
            "ddtree_spec_predicted_accepted_drafts",
            "Accepted drafts the budget policy predicted (calibrated), request-rounds with a prediction",
            registry=r,
        )
        self.realised = Counter(
            "ddtree_spec_realised_accepted_drafts",
            "Accepted drafts realised in the same request-rounds as ddtree_spec_predicted_accepted_drafts",
            registry=r,
        )
        self.predicted_rounds = Counter(
            "ddtree_spec_predicted_request_rounds",
            "Request-rounds with a budget-policy prediction",
            registry=r,
        )
        # per rung (auto): what each choice delivered, so a rung that is chosen but does not pay
        # shows as itself (its realised accept length and served round time beside the others')
        self.rung_request_rounds = Counter(
            "ddtree_spec_rung_request_rounds",
            "Request-rounds per budget-policy rung (the batch size summed over its rounds)",
            ["rung"],
            registry=r,
        )
        self.rung_predicted = Counter(
            "ddtree_spec_rung_predicted_drafts",
            "Accepted drafts the budget policy predicted (calibrated) per rung",
            ["rung"],
            registry=r,
        )
        self.rung_accepted = Counter(
            "ddtree_spec_rung_accepted_drafts",
            "Accepted drafts realised per rung",
            ["rung"],
            registry=r,
        )
        self.rung_seconds = Counter(
            "ddtree_spec_rung_round_seconds",
            "Decoder round wall seconds per rung (ddtree_round_seconds' round part, split by rung)",
            ["rung"],
            registry=r,
        )
        self.rung_device_seconds = Counter(
            "ddtree_spec_rung_device_seconds",
            "Decoder round seconds on the GPU's clock per rung (the round's device span)",
            ["rung"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "ddtree_http_loop_lag_seconds",
            "How late the HTTP event loop ran a timer due every LOOP_PROBE_S: what every request's "
            "handling and every stream's write waited for (the loop starved of the GIL by the "
            "engine thread, or busy)",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.round_time = Histogram(
            "ddtree_round_seconds",
            "Per decode round: round = the decoder round's wall time (launches + device wait); host "
            "= the engine step outside it (schedule, emit, detokenise, stops); server = the loop "
            "outside the step (publish, commands, metrics); hidden = publishing run under the "
            "device's work; on the GPU's clock (CUDA): device = the round's span, idle = the GPU idle "
            "since the previous round, device_<phase> = the span's draft / verify / commit",
            ["part"],
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self._window: deque[tuple[float, int]] = deque()
        self._window_tokens = 0
        self._busy: deque[tuple[float, float]] = deque()
        self._busy_s = 0.0

    def on_gc_pause(self, generation: int, seconds: float) -> None:
        self.gc_pause.labels(generation=str(generation)).observe(seconds)

    def on_admit(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def on_first_token(self, times) -> None:
        """A request's first token was published: its `ReqTimes` by phase."""
        parts = times.breakdown()
        for hist, key in (
            (self.ttft, "ttft"),
            (self.queue_time, "queue"),
            (self.prefill_time, "prefill"),
            (self.publish_time, "publish"),
        ):
            if parts[key] is not None:
                hist.observe(parts[key])

    def on_busy(self, seconds: float) -> None:
        """One loop iteration that ran an engine step took `seconds` (step, publishing, metrics)."""
        self._busy.append((time.monotonic(), seconds))
        self._busy_s += seconds
        self._update_throughput()

    def on_progress(self, new_tokens: int, new_rounds: list[int]) -> None:
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
            now = time.monotonic()
            self._window.append((now, new_tokens))
            self._window_tokens += new_tokens
        if new_rounds:
            self.rounds.labels(self.algorithm).inc(len(new_rounds))
            hist = self.accept_length.labels(self.algorithm)
            for n in new_rounds:
                hist.observe(n)

    def on_round(self, rec, server_s: float, hidden_s: float) -> None:
        """One decode round's RoundRecord (engine/budget/planner.py) and the server's own times."""
        for b in rec.budgets:
            self.budget.observe(b)
        self.verify_rows.observe(rec.rows)
        self.verify_rows_spread.observe(rec.rows_spread)
        if rec.predicted_s is not None:
            t = rec.timing
            self.round_predicted.inc(rec.predicted_s)
            self.round_priced.inc(t.device_s if t.device_s is not None else t.round_s)
            self.rounds_priced.inc()
        self._on_depths(rec)
        self.verify_width.labels(str(rec.width)).inc()
        if rec.rung:
            self.rung.labels(rec.rung).inc()
            if rec.explore:
                self.explore.labels(rec.rung).inc()
            self.rung_request_rounds.labels(rec.rung).inc(len(rec.accepted))
            self.rung_accepted.labels(rec.rung).inc(sum(rec.accepted))
            self.rung_predicted.labels(rec.rung).inc(sum(rec.predicted))
            self.rung_seconds.labels(rec.rung).inc(rec.timing.round_s)
            if rec.timing.device_s is not None:
                self.rung_device_seconds.labels(rec.rung).inc(rec.timing.device_s)
        if rec.predicted:
            self.predicted.inc(sum(rec.predicted))
            self.realised.inc(sum(rec.accepted))
            self.predicted_rounds.inc(len(rec.predicted))
        parts = (rec.timing.round_s, rec.timing.host_s, server_s, hidden_s)
        for name, value in zip(ROUND_PARTS, parts):
            self.round_time.labels(name).observe(value)
        if rec.timing.grammar_s is not None:  # rounds with grammar requests only
            self.round_time.labels("grammar").observe(rec.timing.grammar_s)
        ph = rec.timing.device_phases
        device = (rec.timing.device_s, rec.timing.idle_s, *(ph.get(p) for p in PHASES))
        for name, value in zip(DEVICE_PARTS, device):
            if value is not None:
                self.round_time.labels(name).observe(value)

    def _on_depths(self, rec) -> None:
        """The round's accepted drafts by depth: a request that accepted k drafts reached depths
        1..k. One increment per depth reached in the round, not per request."""
        accepted = [a for a, b in zip(rec.accepted, rec.budgets) if b > 0]
        if not accepted:
            return
        self.spec_drafts.labels(self.algorithm).inc(len(accepted))
        hist = self.spec_accept_length.labels(self.algorithm)
        for a in accepted:
            hist.observe(a + 1)
        reached = [0] * (max(accepted) + 1)  # reached[d]: requests that accepted exactly d
        for a in accepted:
            reached[a] += 1
        while len(self._depth_counters) < len(reached) - 1:
            d = len(self._depth_counters) + 1
            self._depth_counters.append(self.accepted_by_depth.labels(self.algorithm, str(d)))
        at_least = 0
        for d in range(len(reached) - 1, 0, -1):
            at_least += reached[d]
            self._depth_counters[d - 1].inc(at_least)

    def set_round_costs(self, costs: dict[int, dict[str, float]]) -> None:
        """`BudgetPlanner.round_costs()`: what the policy believes each rung's round costs."""
        for bs, per in costs.items():
            for rung, seconds in per.items():
                self.rung_cost.labels(str(bs), rung).set(seconds)

    def on_finish(self, reason: str, latency: float) -> None:
        self.requests.labels(reason).inc()
        self.e2e.observe(latency)

    def on_stats(self, stats: EngineStats) -> None:
        """Gauges and counters from the engine's numbers between two steps (`engine.stats()`)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.preemptions.set(stats.num_preemptions)
        # unreferenced cached pages count as free: they are evicted on demand
        self.kv_total.set(stats.kv_pages_total)
        self.kv_free.set(stats.kv_pages_free)
        self.kv_used.set(stats.kv_pages_used)
        self.kv_usage.set(stats.kv_pages_used / max(stats.kv_pages_total, 1))
        self.kv_cached.set(stats.kv_pages_cached)
        if stats.prefix_cache is not None:
            self._on_cache(stats.prefix_cache)
        self.checkpoint_rows.set(stats.checkpoint_rows)
        self._on_faults(stats.faults)
        for name, value in (stats.steps or {}).items():
            seen = self._steps_seen.get(name, 0)
            if value > seen:
                self.steps[name].inc(value - seen)
            self._steps_seen[name] = value
        self.slots_total.set(stats.request_slots_total)
        self.slots_free.set(stats.request_slots_free)
        self.state_total.set(stats.state_pool_slots_total)
        self.state_used.set(stats.state_pool_slots_used)
        self._update_throughput()

    def _on_faults(self, st: FaultCounts) -> None:
        now = (st.isolated, st.batch_failures, st.integrity_checks)
        counters = (self.failed_alone, self.batch_failures, self.integrity_checks)
        for counter, new, old in zip(counters, now, self._faults_seen):
            if new > old:
                counter.inc(new - old)
        self._faults_seen = now
        self.integrity_ok.set(1 if st.last_integrity_ok else 0)
        self.engine_dead.set(1 if st.dead is not None else 0)

    def _on_cache(self, st: PrefixCacheStats) -> None:
        now = (
            st.queried_tokens,
            st.hit_tokens,
            st.evicted_pages,
            st.state_miss_tokens,
            st.checkpoint_drops,
        )
        counters = (
            self.cache_queried,
            self.cache_hits,
            self.cache_evictions,
            self.cache_state_misses,
            self.checkpoint_drops,
        )
        for counter, new, old in zip(counters, now, self._cache_seen):
            if new > old:
                counter.inc(new - old)
        self._cache_seen = now
        self.cache_hit_rate.set(st.hit_rate)

    def _update_throughput(self) -> None:
        now = time.monotonic()
        while self._window and now - self._window[0][0] > THROUGHPUT_WINDOW_S:
            self._window_tokens -= self._window.popleft()[1]
        while self._busy and now - self._busy[0][0] > THROUGHPUT_WINDOW_S:
            self._busy_s -= self._busy.popleft()[1]
        # tokens of the window over the busy seconds of the same window: a server that decodes
        # for 1 s of the 5 shows its decode rate, not a fifth of it
        busy = self._busy_s if self._busy else 0.0
        self.throughput.set(self._window_tokens / busy if busy > 1e-9 else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def server_info(engine: EngineProtocol) -> dict:
    """Plain numbers for /get_server_info; call on the engine thread."""
    st = engine.stats()
    # between two steps: the whole engine's invariants (pages, slots, lengths, cached tokens,
    # checkpoints, request bookkeeping: engine/integrity.py), host-only
    problems = engine.integrity_problems()
    kv_integrity = "ok" if not problems else "FAILED: " + "; ".join(problems[:8])
    return {
        "num_running_requests": st.num_running,
        "num_waiting_requests": st.num_waiting,
        "num_preemptions": st.num_preemptions,
        "kv_pages_total": st.kv_pages_total,
        "kv_pages_free": st.kv_pages_free,  # unreferenced cached pages included
        "kv_pages_cached": st.kv_pages_cached,
        "prefix_cache": st.prefix_cache is not None,
        "page_size": st.page_size,
        "request_slots_total": st.request_slots_total,
        "request_slots_free": st.request_slots_free,
        "state_pool_slots_total": st.state_pool_slots_total,
        "state_pool_slots_free": st.state_pool_slots_free,
        "kv_integrity": kv_integrity,
        "requests_failed_alone": st.faults.isolated,
        "batch_failures": st.faults.batch_failures,
        "engine_dead": st.faults.dead,
    }


async def probe_loop_lag(metrics: ServerMetrics, period: float = LOOP_PROBE_S) -> None:
    """Runs on the HTTP event loop until cancelled: each `period` a timer, and how late it fired
    into `ddtree_http_loop_lag_seconds`. A request that reaches the server waits that long before
    its handler stamps its arrival (`bench serving`'s `client` share of TTFT)."""
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(period)
        metrics.loop_lag.observe(max(time.monotonic() - t0 - period, 0.0))
