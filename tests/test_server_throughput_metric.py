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
