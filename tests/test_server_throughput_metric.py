"""/metrics' generation throughput is over busy time: tokens of the window over the seconds the
loop spent running steps in it, not over the window's wall time."""

import time

import pytest

from ddtree.server.metrics import THROUGHPUT_WINDOW_S, ServerMetrics


def gauge(m: ServerMetrics) -> float:
    return m.registry.get_sample_value("ddtree_generation_throughput_tokens_per_second")


def test_throughput_divides_by_busy_seconds():
    m = ServerMetrics("NONE", 1)
    assert gauge(m) == 0.0
    for _ in range(4):  # four steps of 25 ms, 3 tokens each: 120 tok/s while busy
        m.on_progress(3, [])
        m.on_busy(0.025)
    assert gauge(m) == pytest.approx(120.0)
    time.sleep(0.05)
    m._update_throughput()
    assert gauge(m) == pytest.approx(120.0)


def test_throughput_window_forgets_old_busy_time(monkeypatch):
    m = ServerMetrics("NONE", 1)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    m.on_progress(10, [])
    m.on_busy(0.1)
    assert gauge(m) == pytest.approx(100.0)
    now[0] += THROUGHPUT_WINDOW_S + 1
    m._update_throughput()
    assert gauge(m) == 0.0  # the window emptied: no tokens, no busy time


def test_acceptance_by_depth():
    """Per-position acceptance: a request that accepted k drafts counts at depths 1..k; AR rows
    (budget 0) are no drafts; depth d's count over the drafts is the acceptance rate there."""
    from types import SimpleNamespace

    m = ServerMetrics("DDTREE", 17)
    m.on_round(
        SimpleNamespace(
            budgets=[8, 8, 0, 16],
            accepted=[3, 0, 0, 5],
            width=17,
            rung="",
            explore=False,
            predicted=[],
            timing=SimpleNamespace(
                round_s=0.01,
                host_s=0.0,
                grammar_s=None,
                device_s=None,
                idle_s=None,
                device_phases={},
            ),
        ),
        0.0,
        0.0,
    )

    def depth(d):
        v = m.registry.get_sample_value(
            "ddtree_spec_accepted_by_depth_total", {"algorithm": "DDTREE", "depth": str(d)}
        )
        return v or 0.0

    drafts = m.registry.get_sample_value("ddtree_spec_drafts_total", {"algorithm": "DDTREE"})
    assert drafts == 3  # the AR row drafted nothing
    assert [depth(d) for d in range(1, 7)] == [2, 2, 2, 1, 1, 0]
