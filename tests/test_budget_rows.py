"""engine/budget/rows.py: a round's cost as (batch, total verify rows, context, prefill tokens) on
a synthetic table, the throughput-optimal row budget against a brute force, and the start-up
measurement (engine/budget/profile.py `measure_rows` / `row_cost`) on the toy pair, cached."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree.engine.budget.rows import RowCost

# a convex verify cost: flat while the weights dominate, then linear in the rows
TABLE = RowCost(
    batches=(1, 8, 64),
    draft_s=(1e-3, 1.5e-3, 4e-3),
    rows=(1, 64, 256, 1024),
    verify_s=(5e-3, 5.5e-3, 8e-3, 20e-3),
    prefill=(0, 512, 2048),
    prefill_s=(0.0, 10e-3, 35e-3),
    kv_s_per_token=1e-8,
)


def test_predict_sums_the_parts():
    # batch 8 (a measured point), 64 rows, context 1000, no prefill
    assert TABLE.predict(8, 64, 1000) == pytest.approx(5.5e-3 + 1.5e-3 + 8 * 1000 * 1e-8)
    # between points: linear; prefill tokens add their own curve
    s = TABLE.predict(36, 160, 0, prefill_tokens=256)
    assert s == pytest.approx((1.5e-3 + 4e-3) / 2 + (5.5e-3 + 8e-3) / 2 + 5e-3)
    # past the last point: the last slope (batch 256 at 2048 rows)
    s = TABLE.predict(256, 2048, 0)
    verify = 20e-3 + (20e-3 - 8e-3) / 768 * 1024
    draft = 4e-3 + (4e-3 - 1.5e-3) / 56 * (256 - 64)
    assert s == pytest.approx(verify + draft)
    # an AR round drafts nothing; rows never below the batch (every request has its root)
    assert TABLE.predict(8, 8, 0, draft=False) == pytest.approx(TABLE.verify(8))
    assert TABLE.predict(8, 1, 0) == TABLE.predict(8, 8, 0)
    assert TABLE.predict(0, 0, 0, prefill_tokens=512) == pytest.approx(10e-3)


def test_json_round_trip_and_bad_tables():
    assert RowCost.from_json(TABLE.to_json()) == TABLE
    with pytest.raises(ValueError, match="rows"):
        RowCost((1,), (1e-3,), (64, 8), (1e-3, 2e-3))
    with pytest.raises(ValueError, match="batches"):
        RowCost((1, 8), (1e-3,), (8,), (1e-3,))


def test_from_points_fewer_rows_never_cost_more():
    cost = RowCost.from_points(
        {1: 1e-3}, {8: [3e-3, 2e-3], 16: [1.5e-3], 32: [4e-3]}, {128: 2e-3}, 0.0
    )
    # 8 rows measured at 2 ms but 16 at 1.5: 8 rows padded to 16 cost 1.5
    assert cost.rows == (8, 16, 32) and cost.verify_s == (1.5e-3, 1.5e-3, 4e-3)
    assert cost.prefill == (0, 128) and cost.prefill_cost(0) == 0.0


def _brute_best(cost, batch, ctx, gain, prefill, buckets):
    rates = {0: batch / cost.predict(batch, batch, ctx, prefill, draft=False)}
    for r in range(1, len(gain)):
        up = [t for t in buckets if t >= batch + r] if buckets else [batch + r]
        if up:
            rates[r] = (batch + gain[r]) / cost.predict(batch, up[0], ctx, prefill)
    best = max(rates.values())
    near = [r for r, x in rates.items() if x >= best * (1 - 1e-12)]
    return near  # the rates within rounding of the best


@pytest.mark.parametrize("batch", [1, 8, 64, 256])
@pytest.mark.parametrize("buckets", [None, (16, 64, 128, 256, 512, 1024, 2048)])
def test_best_rows_is_the_brute_force_optimum(batch, buckets):
    rng = np.random.default_rng(batch)
    # the batch's node probabilities, best first: a few confident requests, a long tail
    probs = np.sort(rng.beta(0.6, 1.5, size=batch * 16))[::-1]
    gain = np.concatenate([[0.0], np.cumsum(probs)])
    for ctx, prefill in ((100, 0), (4000, 512)):
        got = TABLE.best_rows(batch, ctx, gain, prefill, buckets)
        near = _brute_best(TABLE, batch, ctx, gain, prefill, buckets)
        assert got in near and (got == 0 or 0 not in near)


def test_best_rows_goes_deep_alone_and_to_no_drafts_when_drafts_are_worthless():
    deep = np.concatenate([[0.0], np.cumsum(np.full(64, 0.9) ** np.arange(1, 65))])
    assert TABLE.best_rows(1, 100, deep) > 8
    worthless = np.concatenate([[0.0], np.cumsum(np.full(256 * 8, 1e-4))])
    assert TABLE.best_rows(256, 100, worthless) == 0


@pytest.mark.usefixtures("one_torch_thread")
def test_row_costs_measured_on_the_toy_pair_and_cached(toy_pair, tmp_path, monkeypatch):
    """Eager: timed target forwards; with graphs (here run, not captured): the draft graph per
    batch bucket and every verify graph per (bucket, width); the file is read on the next start."""
    from engine_utils import make_llm
    from test_cuda_graph import attach_graphs

    from ddtree import envs
    from ddtree.engine.budget import profile as budget_profile

    monkeypatch.setattr(budget_profile, "PREFILL_POINTS", (16, 64))
    monkeypatch.setattr(budget_profile, "EAGER_ROWS", (1, 16))
    llm = make_llm(toy_pair, "DDTREE", max_running_requests=2, speculative_ddtree_budget=4)
    runner, spec = llm.engine.runner, llm.engine.spec
    eager = budget_profile.measure_rows(runner, spec, replays=1)
    assert eager.rows == (1, 16) and all(x > 0 for x in eager.verify_s + eager.draft_s)
    assert eager.prefill == (0, 16, 64) and eager.predict(2, 10, 50, 16) > eager.predict(2, 10, 50)
    g = attach_graphs(llm, 2)
    table = budget_profile.measure_rows(runner, spec, replays=1)
    assert table.batches == tuple(g.buckets)
    assert set(table.rows) == {bs * w for bs in g.buckets for w in g.widths}
    g.capture = True  # row_cost caches only captured graphs' costs; the runs stand in
    monkeypatch.setenv(envs.BUDGET_PROFILE_DIR.name, str(tmp_path))
    monkeypatch.setattr(budget_profile, "measure_rows", lambda r, s: table)
    first = budget_profile.row_cost(runner, spec)
    assert [p.name.endswith("-rows.json") for p in tmp_path.iterdir()] == [True]
    monkeypatch.setattr(budget_profile, "measure_rows", lambda r, s: pytest.fail("re-measured"))
    assert budget_profile.row_cost(runner, spec) == first == table
