"""The load-aware budget policy on its own: pure host math, no model. Costs are the H200's measured
8B-shape round times (BENCHMARKS / measured-2026-12), gains the embedded pair's acceptance."""

import numpy as np
import pytest

from ddtree.engine.budget.policy import (
    AnalyticCost,
    BudgetPolicy,
    CostTable,
    budget_ladder,
)

LADDER = (0, 8, 16, 32, 64)
# ms per round at widths 1, 9, 17, 33, 65 (bs 1 / 8 at 1k; 64 extrapolated as compute-bound)
MS = {
    1: [5.76, 8.0, 8.12, 8.15, 8.20],
    8: [6.16, 9.2, 9.71, 12.5, 18.25],
    64: [9, 30, 55, 105, 205],
}
TABLE = CostTable(LADDER, (1, 8, 64), (1024,), np.array([[MS[b]] for b in (1, 8, 64)]) / 1e3)
# expected accepted drafts per budget 1..64 (τ - 1: B=16 5.22, B=64 6.30)
CURVE = np.interp(np.arange(1, 65), [0, 8, 16, 32, 64], [0, 4.3, 5.22, 5.9, 6.3])


def seeded(bs: int, curve=CURVE, slots=64) -> tuple[BudgetPolicy, list[object]]:
    pol = BudgetPolicy(LADDER, TABLE, slots)
    owners = [object() for _ in range(bs)]
    pol.choose(range(bs), owners, [64] * bs, 1000)
    chain = [curve[14]] * bs  # the tree's spine: the chain's 15 drafts
    pol.observe(range(bs), [64] * bs, np.tile(curve, (bs, 1)), [curve[-1]] * bs, chain=chain)
    return pol, owners


def test_ladder():
    assert budget_ladder(64) == LADDER
    assert budget_ladder(100) == (0, 8, 16, 32, 64, 100)
    assert budget_ladder(4) == (0, 4)
    assert budget_ladder(8) == (0, 8)


@pytest.mark.parametrize("bs,want", [(1, 64), (8, 16), (64, 8)])
def test_width_follows_the_load(bs, want):
    pol, owners = seeded(bs)
    d = pol.choose(range(bs), owners, [64] * bs, 1000)
    assert d.width == want + 1 and (d.budgets == want).all()
    assert d.predicted == pytest.approx(np.full(bs, CURVE[want - 1]))


def test_speculation_off_when_it_does_not_pay():
    from ddtree.engine.budget.policy import EXPLORE_AFTER

    pol, owners = seeded(64, curve=np.full(64, 0.05))  # the drafter is almost never right
    widths = [
        pol.choose(range(64), owners, [64] * 64, 1000).width for _ in range(2 * EXPLORE_AFTER)
    ]
    d = pol.choose(range(64), owners, [64] * 64, 1000)
    assert d.width == 1 and (d.budgets == 0).all()
    # AR rounds learn nothing: one speculative round every EXPLORE_AFTER + 1 refreshes the curves
    assert [w for w in widths if w > 1] == [9] and widths.index(9) == EXPLORE_AFTER


def test_calibration_scales_an_optimistic_drafter():
    """Requests whose drafts are accepted at a tenth of the drafter's belief get a tenth of the gain;
    at batch 8 that makes AR the best round (it would be B=16 uncalibrated)."""
    pol, owners = seeded(8)
    for _ in range(30):
        pol.observe(range(8), [16] * 8, np.tile(CURVE, (8, 1)), [CURVE[15] / 10] * 8)
    d = pol.choose(range(8), owners, [64] * 8, 1000)
    assert d.width == 1
    # the tenth is the B=16 rung's factor (every request alike): the requests' ease stays ~1
    b16 = list(pol.rung_budget).index(16)
    g = pol.gains(np.arange(8)) * pol.rung_factors()[b16]
    assert g[:, 16] == pytest.approx(np.full(8, CURVE[15] / 10), rel=0.05)


def test_caps_and_new_requests_in_a_slot():
    pol, owners = seeded(2)
    d = pol.choose([0, 1], owners, [5, 64], 1000)
    assert d.budgets.tolist() == [5, 16] and d.width == 17  # batch 2 costs as bucket 8
    assert d.predicted[0] == pytest.approx(CURVE[4])
    # a new request in slot 0 starts from the server-wide curve (the chain's gain times the
    # server's tree-over-chain shape and growth), its calibration reset
    d = pol.choose([0, 1], [object(), owners[1]], [64, 64], 1000)
    assert pol.n_read[0] == 0 and pol.n_read[1] == 64
    assert d.predicted[0] == pytest.approx(CURVE[d.width - 2])


def test_unseen_batch_explores_the_largest_width():
    pol = BudgetPolicy(LADDER, TABLE, 8)
    d = pol.choose(range(8), [object() for _ in range(8)], [64] * 8, 1000)
    assert d.width == 65


def test_cost_table_round_trip_and_lookup():
    again = CostTable.from_json(TABLE.to_json())
    assert np.array_equal(again.table, TABLE.table)
    assert again.seconds(3, 500) == pytest.approx(np.array(MS[8]) / 1e3)  # bucket 8, ctx 1k
    assert again.seconds(100, 10**6) == pytest.approx(np.array(MS[64]) / 1e3)
    with pytest.raises(ValueError, match="shape"):
        CostTable.from_json({**TABLE.to_json(), "ladder": [0, 8]})


def test_analytic_cost_is_flat_then_compute_bound():
    c = AnalyticCost(LADDER, 16e9, 16e9, 2e9, 2e9, 16, 147456)
    one, many = c.seconds(1, 1024), c.seconds(64, 1024)
    assert one[0] < one[1] and one[-1] / one[1] < 1.1  # weight-bound at batch 1
    assert many[-1] / many[1] > 3  # compute-bound at 64 x 65 rows


def test_one_bad_first_round_does_not_switch_speculation_off():
    """A new request's ease starts at 1: a first round with nothing accepted (e.g. right after
    the prompt) lowers its gain by the EMA weight, not to zero."""
    pol, _ = seeded(1)
    new = [object()]
    pol.choose([1], new, [64], 1000)
    pol.observe([1], [64], CURVE[None, :], [0])
    g = pol.gains(np.array([1]))
    assert g[0, 64] == pytest.approx(0.75 * CURVE[-1], rel=0.01)
    # the round also lowers the B=64 rung's factor, by one round against RUNG_PRIOR drafts
    assert pol.rung_factors()[-1] > 0.7 * pol.rung_factors()[-2]
    assert pol.choose([1], new, [64], 1000).width > 1


def test_served_cost_corrects_the_profile():
    """Served rounds correct their rung at their batch bucket (EMA, a stalled round clipped); an
    unserved rung takes its profile plus the bucket's common overhead (served - profile over
    every rung served there; another bucket's where none was; never below the profile)."""
    from ddtree.engine.budget.policy import ServedCost

    cost = ServedCost(TABLE)
    base = TABLE.seconds(1, 1000)
    assert cost.seconds(1, 1000) == pytest.approx(base) and not cost.served(1, 4)
    cost.observe(1, 1000, 4, base[4] + 1e-3)  # B=64 served 1 ms dearer than profiled
    got = cost.seconds(1, 1000)
    assert got[4] == pytest.approx(base[4] + 1e-3) and cost.served(1, 4)
    assert got[:4] == pytest.approx(base[:4] + 1e-3)  # the overhead, whatever the rung
    cost.observe(1, 1000, 1, base[1] + 3e-3)  # B=8: 3 ms; the overhead's EMA moves 10% of it
    got = cost.seconds(1, 1000)
    assert got[1] == pytest.approx(base[1] + 3e-3)
    assert got[0] == pytest.approx(base[0] + 1.2e-3)
    r4 = cost.correction(1)[4]
    cost.observe(1, 1000, 4, 100.0)  # a stalled round moves the EMA by at most 10% of 2x
    assert cost.seconds(1, 1000)[4] == pytest.approx((0.9 * r4 + 0.1 * 2.0) * base[4])
    # another bucket, none served there: its profile plus the nearest bucket's overhead
    over = cost.overhead(1)
    assert cost.seconds(8, 1000) == pytest.approx(TABLE.seconds(8, 1000) + over)
    assert cost.batches == TABLE.batches
    ratio = cost.correction(1)
    assert np.isnan(ratio[[0, 2, 3]]).all() and ratio[1] == pytest.approx(1 + 3e-3 / base[1])
    fast = ServedCost(TABLE)
    fast.observe(8, 1000, 2, 0.5 * TABLE.seconds(8, 1000)[2])  # served cheaper than profiled
    assert fast.seconds(8, 1000)[0] == pytest.approx(TABLE.seconds(8, 1000)[0])  # not below
