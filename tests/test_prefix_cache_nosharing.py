"""Issue 22's no-sharing target: on a workload whose prompts share nothing, the cache-on engine
schedules exactly what --disable-radix-cache does: the same batch per step (prefill chunks, their
lengths, so the same extend passes and graphs; decode batches), while its pool is full of cached
pages it evicts. Distinct prompts that start alike (a BOS token, a template's opening tokens) must
not turn into copy-on-write "hits" that shift every chunk of a request by a token or two."""

import collections

import pytest
from engine_utils import make_llm, toy_pattern

from ddtree import SamplingParams
from ddtree.engine.config import EXTEND_BATCHES, EXTEND_WIDTHS
from ddtree.engine.graphs.extend import plan_passes
from ddtree.engine.memory.block_manager import BlockManager
from ddtree.engine.scheduling.request import Req
from ddtree.tools.train.data import BOS_ID

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PAGE, CHUNK, CONCURRENCY = 4, 24, 3
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def distinct_prompts(n: int) -> list[list[int]]:
    """BOS + a segment of its own: no two share a page, every one shares its first token."""
    return [[BOS_ID] + toy_pattern("prog", 7 * i + 1, 29 + i % 5, 1 + i % 3) for i in range(n)]


def closed_loop(llm, prompts):
    """CONCURRENCY requests at once, the next added when one finishes (a serving client's loop);
    returns the per-step trace: ("P", q_lens) or ("D", batch size), and the outputs."""
    eng = llm.engine
    trace, schedule = [], eng.scheduler.schedule

    def traced():
        b = schedule()
        if b is not None:
            trace.append(("P", tuple(b.q_lens)) if b.is_prefill else ("D", len(b.reqs)))
        return b

    eng.scheduler.schedule = traced
    queue, live, done = collections.deque(prompts), [], []
    while queue or live:
        while queue and len(live) < CONCURRENCY:
            live.append(eng.add_request(queue.popleft(), PARAMS))
        eng.step()
        done += [r for r in live if r.is_finished]
        live = [r for r in live if not r.is_finished]
    return trace, sorted((r.prompt_ids, r.output_ids) for r in done)


def test_no_sharing_schedules_the_same_batches_with_the_cache(toy_pair):
    prompts = distinct_prompts(12)
    runs = {}
    for cache in (True, False):
        llm = make_llm(
            toy_pair,
            "DDTREE",
            speculative_ddtree_budget=8,
            page_size=PAGE,
            chunked_prefill_size=CHUNK,
            max_total_tokens=36 * PAGE,
            disable_radix_cache=not cache,
        )
        runs[cache] = closed_loop(llm, prompts), llm.engine.runner
    (on, on_out), runner = runs[True]
    (off, off_out), runner_off = runs[False]
    bm = runner.bm
    assert bm.cache.stats.evicted_pages > 0  # the pool was full of cached pages
    assert any(q != CHUNK for kind, qs in on if kind == "P" for q in qs)  # chunks and tails
    assert on == off, "cache on schedules different batches on a no-sharing workload"
    assert bm.cache.stats.hit_tokens == 0
    plan = [
        plan_passes(list(qs), list(EXTEND_WIDTHS), EXTEND_BATCHES[-1]) for k, qs in on if k == "P"
    ]
    assert plan == [
        plan_passes(list(qs), list(EXTEND_WIDTHS), EXTEND_BATCHES[-1]) for k, qs in off if k == "P"
    ]
    assert on_out == off_out  # lossless
    # the per-step counters /metrics exports (and bench prefix-cache reports) agree, and count
    # what the trace saw
    host = ("schedule_s", "cache_insert_s")
    st_on, st_off = (
        {k: v for k, v in r.step_stats.as_dict().items() if k not in host}
        for r in (runner, runner_off)
    )
    assert st_on == st_off
    assert st_on["prefill_steps"] == sum(k == "P" for k, _ in on)
    assert st_on["decode_reqs"] == sum(n for k, n in on if k == "D")
    assert st_on["prompts_done"] == len(prompts) and st_on["graphed_steps"] == 0
    assert st_on["graphable_steps"] == sum(p is not None for p in plan)


def test_bench_prefix_cache_reports_the_step_plan():
    from ddtree.engine.scheduling.step_stats import StepStats, summarize
    from ddtree.tools.studies.prefix_cache import format_report

    st = StepStats(prefill_steps=4, graphed_steps=1, graph_passes=2, prefill_chunks=6)
    st.prompts_done, st.decode_steps, st.decode_reqs = 3, 10, 25
    level = {"ttft_ms": {"p50": 1.0, "p99": 2.0}, "output_throughput": 1.0, "cache_hit_rate": 0}
    res = {"cache": {"distinct": {**level, "steps": summarize(st.as_dict())}}}
    text = format_report(res, [])
    assert "per-step counters" in text
    row = text.splitlines()[-1].split()
    # prefill, graphed share, graphable, passes / graphed step, chunks / step, chunks / prompt
    assert row[2:8] == ["4", "0.25", "0.00", "2.00", "1.50", "2.00"]
    assert row[8:10] == ["10", "2.50"]


def test_evicted_pages_are_handed_out_in_ascending_order():
    # eviction walks a cached chain from its leaf up; the next request gets the pages ascending,
    # as a fresh free list hands them out (the cache-off server's layout)
    bm = BlockManager(12, PAGE, 2, 8, "cpu", prefix_cache=True)
    old = Req(prompt_ids=list(range(100, 132)), params=PARAMS)
    bm.allocate(old, 32)
    bm.free(old, old.prompt_ids, 32)  # 8 pages cached, unreferenced
    new = Req(prompt_ids=list(range(200, 232)), params=PARAMS)
    bm.allocate(new, 32)  # 4 free pages, then 4 evicted ones
    assert bm.cache.stats.evicted_pages == 4
    assert bm.pages[new.slot][4:] == sorted(bm.pages[new.slot][4:])
    bm.check_integrity()
