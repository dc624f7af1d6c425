"""Host time per round (issue 20): one publish hands its deltas to the handlers' event loop in one
call (not one self-pipe write, i.e. one GIL hand-off, per stream), in order; the rung counter; and
the policy's per-round host cost stays small at concurrency 64."""

import asyncio
import threading
import time

import numpy as np
import pytest

from ddtree.server.async_engine import Delta, Outbox, Stream


def test_one_call_per_loop_per_publish_in_order():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: calls.append(a) or real(*a)
        streams = [Stream(f"r{i}", 1, asyncio.Queue(), loop) for i in range(32)]
        box = Outbox()
        for k in range(3):
            for st in streams:
                box.put(st, Delta(text=f"{st.rid}.{k}"))
        assert not calls  # nothing leaves before send
        box.send()
        assert len(calls) == 1 and box.calls == 1
        deadline = time.monotonic() + 5
        while any(st.queue.qsize() < 3 for st in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        for st in streams:
            got = [st.queue.get_nowait().text for _ in range(3)]
            assert got == [f"{st.rid}.{k}" for k in range(3)]
        box.send()  # nothing pending: no call
        assert len(calls) == 1
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()
    box.put(streams[0], Delta(text="late"))
    box.send()  # a closed loop: dropped, no error


def test_rung_counter():
    from prometheus_client import generate_latest

    from ddtree.engine.budget.planner import RoundPlan, RoundRecord
    from ddtree.engine.round.clock import RoundTiming
    from ddtree.server.metrics import ServerMetrics

    assert RoundPlan(1, None).rung == "ar"
    assert RoundPlan(16, [15], chain=True).rung == "chain"
    assert RoundPlan(17, [16, 3]).rung == "tree16"
    m = ServerMetrics("DDTREE", 17)
    m.on_round(RoundRecord(16, [15], [1.0], [3], "chain"), 0.0, 0.0)
    text = generate_latest(m.registry).decode()
    assert 'ddtree_spec_rung_rounds_total{rung="chain"} 1.0' in text
    # an exploration round counts under its rung and, apart, as exploration
    m.on_round(RoundRecord(33, [32], [1.0], [3], "tree32", explore=True), 0.0, 0.0)
    text = generate_latest(m.registry).decode()
    assert 'ddtree_spec_rung_rounds_total{rung="tree32"} 1.0' in text
    assert 'ddtree_spec_explore_rounds_total{rung="tree32"} 1.0' in text
    # the policy's believed round costs: a gauge bench serving reads after each level
    from ddtree.bench import serving_metrics

    before = serving_metrics.parse(text)
    m.set_round_costs({1: {"chain": 0.007, "tree64": 0.0085}, 8: {"chain": 0.009}})
    m.on_round(RoundRecord(65, [64], [1.0], [3], "tree64", explore=True), 0.0, 0.0)
    m.on_round(
        RoundRecord(9, [8, 8], [2.0, 1.5], [4, 0], "tree8", timing=RoundTiming(0.006)), 0.0, 0.0
    )
    m.on_round(RoundRecord(9, [8], [3.5], [1], "tree8", timing=RoundTiming(0.008)), 0.0, 0.0)
    level = serving_metrics.delta(
        before, serving_metrics.parse(generate_latest(m.registry).decode())
    )
    assert level["policy_cost_ms"] == {
        "1": {"chain": pytest.approx(7.0), "tree64": pytest.approx(8.5)},
        "8": {"chain": pytest.approx(9.0)},
    }
    assert level["rung_rounds"] == {"tree64": 1, "tree8": 2}
    assert level["explore_rounds"] == {"tree64": 1}
    # per rung: what each choice delivered (3 request-rounds of tree8: 7 predicted, 5 accepted)
    t8 = level["per_rung"]["tree8"]
    assert t8["rounds"] == 2 and t8["batch"] == pytest.approx(1.5)
    assert t8["round_ms"] == pytest.approx(7.0)
    assert t8["predicted_accept_length"] == pytest.approx(1 + 7 / 3)
    assert t8["realised_accept_length"] == pytest.approx(1 + 5 / 3)
    assert level["per_rung"]["tree64"]["realised_accept_length"] == pytest.approx(4.0)
    from ddtree.tools.studies.at_scale_report import rung_summary

    assert rung_summary(level["per_rung"]).startswith("tree8 2 rd, b 1.5, 7.00 ms, tau 3.33 / 2.67")


def test_policy_round_cost_is_small_at_64():
    """choose + observe at batch 64 (the work the round's host side adds with auto): well under a
    millisecond per round, so it cannot be the per-round host time at concurrency 32."""
    from ddtree.engine.budget.policy import BudgetPolicy, CostTable

    ladder = (0, 8, 16, 32, 64)
    table = CostTable(ladder, (64,), (4096,), np.full((1, 1, 6), 0.01), chain=15)
    pol = BudgetPolicy(ladder, table, 64, 15)
    owners, slots = [object() for _ in range(64)], np.arange(64)
    curve = np.tile(np.linspace(0.5, 6, 64), (64, 1))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            d = pol.choose(slots, owners, [64] * 64, 1000)
            pol.observe(slots, d.budgets, curve, [3] * 64, chain=np.full(64, 4.0))
        best = min(best, (time.perf_counter() - t0) / 20)
    assert best < 1e-3, best


def test_run_detokenisation_equals_one_token_at_a_time():
    """`extend` (two decodes per run) gives the text of `append` per token, chunk by chunk, on
    text with multi-byte characters split across tokens."""
    import os
    import random

    from ddtree.assets import PACKAGE_PAIR
    from ddtree.engine.outputs.detokenizer import IncrementalDetokenizer
    from ddtree.engine.setup import load_tokenizer

    tok = load_tokenizer(os.path.join(PACKAGE_PAIR, "target"))
    text = "def f(x):\n    return x  # naïve — 数据 🙂 ok\n" * 3
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    one, many = IncrementalDetokenizer(tok, ids[:3]), IncrementalDetokenizer(tok, ids[:3])
    i, split = 3, False
    while i < len(ids):
        n = rng.randint(1, 8)
        chunk = ids[i : i + n]
        want = "".join(one.append(t) for t in chunk)
        split |= many.tok.decode(ids[: i + n]).endswith("\ufffd")
        assert many.extend(chunk) == want, i
        i += n
    assert split  # some chunk ended inside a character
    assert one.ids == many.ids


def test_an_idle_engine_publishes_what_waited_for_a_round_before_it_blocks():
    """A decode step's publishing waits for the next round (finished requests included); when no
    round comes (the other requests were aborted) the loop publishes it before it blocks for
    commands, not after the poll."""
    from engine_stub import IdleEngine

    from ddtree.server.async_engine import AsyncEngine

    aeng = AsyncEngine(IdleEngine(), overlap=True)
    calls = []
    aeng._publish_guarded = lambda: calls.append("publish")

    def run_commands(block):
        calls.append(("commands", block))
        aeng._stop.set()

    aeng._run_commands = run_commands
    aeng._unpublished = True
    aeng._loop()
    assert calls[:2] == ["publish", ("commands", True)], calls
