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
    from ddtree.engine.budget.planner import RoundRecord
    from ddtree.engine.round.clock import RoundTiming

    m = ServerMetrics("DDTREE", 17)
    rec = RoundRecord(17, [8, 8, 0, 16], [], [3, 0, 0, 5], timing=RoundTiming(round_s=0.01))
    m.on_round(rec, 0.0, 0.0)

    def depth(d):
        v = m.registry.get_sample_value(
            "ddtree_spec_accepted_by_depth_total", {"algorithm": "DDTREE", "depth": str(d)}
        )
        return v or 0.0

    drafts = m.registry.get_sample_value("ddtree_spec_drafts_total", {"algorithm": "DDTREE"})
    assert drafts == 3  # the AR row drafted nothing
    assert [depth(d) for d in range(1, 7)] == [2, 2, 2, 1, 1, 0]


def test_accept_length_histogram_and_verify_rows_per_round():
    """ddtree_spec_accept_length: one observation per request-round that drafted (accepted + 1,
    buckets 1..16); ddtree_spec_verify_rows: one per round, its rows in all (roots + drafts);
    the priced rounds' predicted and measured seconds side by side."""
    from ddtree.engine.budget.planner import RoundRecord
    from ddtree.engine.round.clock import RoundTiming

    m = ServerMetrics("DDTREE", 17)
    rec = RoundRecord(17, [8, 8, 0, 16], [], [3, 0, 0, 5], timing=RoundTiming(round_s=0.01))
    assert (rec.rows, rec.rows_mean) == (36, 9.0) and rec.rows_spread == pytest.approx(5.6568542)
    m.on_round(rec, 0.0, 0.0)
    priced = RoundRecord(
        5, [4], [], [4], predicted_s=0.02, timing=RoundTiming(round_s=0.05, device_s=0.03)
    )
    m.on_round(priced, 0.0, 0.0)

    def get(name, **labels):
        return m.registry.get_sample_value(name, labels) or 0.0

    le = {"algorithm": "DDTREE"}
    assert get("ddtree_spec_accept_length_count", **le) == 4  # 3 + 1 drafting request-rounds
    assert get("ddtree_spec_accept_length_sum", **le) == 4 + 1 + 6 + 5
    assert get("ddtree_spec_accept_length_bucket", le="1.0", **le) == 1
    assert get("ddtree_spec_accept_length_bucket", le="4.0", **le) == 2
    assert get("ddtree_spec_accept_length_bucket", le="16.0", **le) == 4
    assert get("ddtree_spec_verify_rows_count") == 2 and get("ddtree_spec_verify_rows_sum") == 41
    assert get("ddtree_spec_verify_rows_bucket", le="32.0") == 1  # the 5-row round
    # per round, the rows' spread across its batch: 5.66 (budgets 8, 8, 0, 16), then 0
    assert get("ddtree_spec_verify_rows_spread_count") == 2
    assert get("ddtree_spec_verify_rows_spread_sum") == pytest.approx(5.6568542)
    assert get("ddtree_spec_verify_rows_spread_bucket", le="4.0") == 1
    assert get("ddtree_spec_predicted_round_seconds_total") == pytest.approx(0.02)
    assert get("ddtree_spec_priced_round_seconds_total") == pytest.approx(0.03)  # device span
    assert get("ddtree_spec_priced_rounds_total") == 1
