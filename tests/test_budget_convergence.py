"""Issue 20's stale curve, in a synthetic world (tests/budget_world.py: the 8B-shape run's tau per
rung and measured round costs): fed the realised accept lengths of the rungs it picks, the policy
must reach within 3% of the best fixed rung's tokens / s at batch 1, 4, 16 and 64, from a fresh
server, after a warm-up on synthetic prompts (the drafter unsure, trees depth-limited: a flat
tail), with every request's last round depth-limited, and with a startup cost profile that is
off (the served rounds correct it). The policy before the fix (a curve past
the built rung carried forward from old increments, fed back as data) reached 0.79 at batch 1
after the warm-up: it settled on the chain and B=16 and never measured B=64 again. Pure numpy."""

import numpy as np
import pytest
from budget_world import (
    BATCHES,
    CAP,
    CHAIN,
    COST,
    LADDER,
    NAMES,
    SYNTHETIC,
    Result,
    World,
    profile,
    run,
)

import ddtree.engine.budget.policy as bp
from ddtree.engine.budget.policy import BudgetPolicy, Decision, ServedCost

ROUNDS, WARM = 300, 100
SCENARIOS = {
    "fresh": (World(), False),
    "after_synthetic_warmup": (World(), True),
    "depth_limited_last_rounds": (World(flat_last=True), False),
    "drafter_surer_of_deep_nodes": (World(tail_belief=1.3), False),
}
# startup profiles that are off (the served rounds correct them: ServedCost)
PROFILES = {
    "b64_dearer": {"tree64": 1.12},  # B=32 would win at batch 1 on the profile alone
    "chain_dearer": {"chain": 1.15},  # B=16 would win at 16
    "b8_cheaper": {"tree8": 0.8},  # B=8 would win at 4 and 16
    "all_cheaper": {n: 0.85 for n in NAMES},  # the replays miss a common overhead
}


def serve(bs: int, world: World, warmup: bool, policy=None, cost=COST) -> Result:
    """The policy as BudgetPlanner builds it (its cost corrected by the served rounds)."""
    pol = policy or BudgetPolicy(LADDER, ServedCost(cost), 64, CHAIN)
    if warmup:  # the start-up warm-up's decode rounds at batch 1 and the top batch
        run(pol, 1, SYNTHETIC, 6, seed=100)
        run(pol, 64, SYNTHETIC, 6, seed=100)
    return run(pol, bs, world, ROUNDS, seed=1, warm=WARM)


def test_the_world_needs_a_policy():
    """The best fixed rung changes with the load (so no one fixed budget passes)."""
    best = {bs: serve(bs, World(), False).best for bs in BATCHES}
    assert best == {1: "tree64", 4: "tree32", 16: "chain", 64: "tree8"}


@pytest.mark.parametrize("bs", BATCHES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reaches_the_best_fixed_rung(scenario, bs):
    world, warmup = SCENARIOS[scenario]
    r = serve(bs, world, warmup)
    assert r.of_best >= 0.97, (r.of_best, r.best, r.picks)


@pytest.mark.parametrize("bs", BATCHES)
@pytest.mark.parametrize("scenario", ["fresh", "after_synthetic_warmup"])
def test_decisions_carried_to_a_changed_batch_still_reach_the_best_rung(scenario, bs):
    """As the planner serves: the decision proposed after each round, carried (`carry`) to the
    next when a request left or joined (a request's life is 16 rounds, so from batch 16 up the
    batch changes nearly every round and the rung lags the batch by a round)."""
    world, warmup = SCENARIOS[scenario]
    pol = BudgetPolicy(LADDER, ServedCost(COST), 64, CHAIN)
    if warmup:
        run(pol, 1, SYNTHETIC, 6, seed=100, planner=True)
        run(pol, 64, SYNTHETIC, 6, seed=100, planner=True)
    calls = {"carry": 0}
    carry = pol.carry

    def counted(*a, **k):
        calls["carry"] += 1
        return carry(*a, **k)

    pol.carry = counted
    r = run(pol, bs, world, ROUNDS, seed=1, warm=WARM, planner=True)
    assert r.of_best >= 0.97, (r.of_best, r.best, r.picks)
    assert calls["carry"] > (ROUNDS // 2 if bs >= 16 else 0)  # the carry path really served


@pytest.mark.parametrize("order", [BATCHES, BATCHES[::-1]])
def test_one_server_through_the_levels(order):
    """`bench at-scale`'s protocol: one server (its policy state carried) through every level,
    load rising or falling, each level scored after a few rounds."""
    pol = BudgetPolicy(LADDER, ServedCost(COST), 64, CHAIN)
    run(pol, 1, SYNTHETIC, 6, seed=100)
    run(pol, 64, SYNTHETIC, 6, seed=100)
    for bs in order:
        r = run(pol, bs, World(), 150, seed=bs, warm=20)
        assert r.of_best >= 0.97, (bs, r.of_best, r.best, r.picks)


@pytest.mark.parametrize("bs", BATCHES)
@pytest.mark.parametrize("error", PROFILES)
def test_served_rounds_correct_a_wrong_profile(error, bs):
    r = serve(bs, World(), False, cost=profile(PROFILES[error]))
    assert r.of_best >= 0.97, (r.of_best, r.best, r.picks)


def test_a_wrong_profile_alone_misleads():
    """Without the served correction the B=64-dearer profile keeps batch 1 below the check
    above's 0.97 of B=64 (0.957 with decisions on the server-wide curve; the check can fail)."""
    pol = BudgetPolicy(LADDER, profile(PROFILES["b64_dearer"]), 64, CHAIN)
    assert serve(1, World(), False, policy=pol).of_best < 0.97


class Stuck:
    """A policy that settled on one rung and never looks again (what the stale curve did)."""

    def __init__(self, name: str):
        self.r = NAMES.index(name)

    def choose(self, slots, owners, caps, ctx, extra_s=0.0):
        pol = BudgetPolicy(LADDER, COST, 1, CHAIN)
        b, chain = int(pol.rung_budget[self.r]), bool(pol.rung_chain[self.r])
        return Decision(1 + b, np.full(len(slots), b), np.zeros(len(slots)), 0.0, chain)

    def observe(self, *args, **kw):
        pass


def test_the_check_can_fail():
    """A policy stuck on the chain or on B=16 at batch 1 is more than 3% below B=64."""
    for name in ("chain", "tree16"):
        assert serve(1, World(), False, Stuck(name)).of_best < 0.97


def test_exploration_is_rare_and_marked(monkeypatch):
    """Exploration rounds are flagged on the decision (the metrics count them), at most one in
    EXPLORE_EVERY, and without them the warm-up's flat tail is never measured again."""
    r = serve(64, World(), False)
    assert 0 < r.explored <= (ROUNDS + WARM) / bp.EXPLORE_EVERY
    monkeypatch.setattr(bp, "EXPLORE_EVERY", 10**9)
    # the tree64 rung's factor from the warm-up (its flat tail under-believed) also finds it;
    # without both (every rung at the server-wide ratio) batch 1 stays below B=64
    assert serve(1, World(), True).of_best >= 0.97
    monkeypatch.setattr(bp, "RUNG_PRIOR", 1e12)
    assert serve(1, World(), True).of_best < 0.9


def test_cap_exploration_costs_too_much_under_load(monkeypatch):
    """The alternative the simulation rules out: exploring at the cap every EXPLORE_EVERY
    rounds refreshes the whole curve but costs > 5% at batch 64 (a 71 ms round among 22 ms)."""

    def at_cap(self, rate, per, best, bs):
        return len(self.rung_budget) - 1

    monkeypatch.setattr(BudgetPolicy, "_explore_rung", at_cap)
    monkeypatch.setattr(bp, "EXPLORE_MARGIN", 1.0)
    assert serve(64, World(), False).of_best < 0.95


def test_reset_forgets_the_warmup():
    pol = BudgetPolicy(LADDER, COST, 64, CHAIN)
    run(pol, 1, SYNTHETIC, 6, seed=100)
    assert pol.shape.head is not None and pol.shape.growth_read.any()
    pol.reset()
    d = pol.choose(np.arange(4), [object() for _ in range(4)], [CAP] * 4, 1024)
    assert d.width == CAP + 1  # a fresh server's first round: every node believed accepted


def test_a_chain_believed_more_than_the_trees(monkeypatch):
    """The 8B-shape run of 2026-12-02 (per-rung counters): the drafter believed its DFLASH chain
    up to 1.6x more than its trees. The per-rung factor (realised over predicted where the rung
    served) finds it; with one factor for every rung (RUNG_PRIOR huge: each rung at the
    server-wide ratio) batch 1 settles on the chain, 20% below B=64."""
    world = World(chain_optimism=1.75)
    for bs in BATCHES:
        r = serve(bs, world, False)
        assert r.of_best >= 0.96, (bs, r.of_best, r.best, r.picks)
    monkeypatch.setattr(bp, "RUNG_PRIOR", 1e12)
    r = serve(1, world, False)
    assert r.of_best < 0.85 and max(r.picks, key=r.picks.get) == "chain", r.picks


def test_short_levels_and_a_profile_missing_the_common_overhead(monkeypatch):
    """`bench at-scale`'s levels are short (50-300 rounds at the 8B shape) and each opens a new
    batch bucket; the profile's replays miss a served round's common overhead (~1-1.8 ms at the
    8B shape). An unserved rung is rated at its profile plus the overhead the served rounds
    showed (`ServedCost.overhead`); at its bare profile the cheap rungs look cheaper by it. A
    fresh server's first level, 45 rounds at batch 1, over five draws: 0.96 of B=64 at the
    bare profile, 1.00 with the overhead."""
    cost = profile({}, minus_ms=1.5)

    def first_level() -> float:
        got = []
        for seed in range(5):
            pol = BudgetPolicy(LADDER, ServedCost(cost), 64, CHAIN)
            got.append(run(pol, 1, World(), 40, seed=1 + seed, warm=5).of_best)
        return float(np.mean(got))

    assert first_level() >= 0.98
    monkeypatch.setattr(ServedCost, "overhead", lambda self, bs: 0.0)
    assert first_level() < 0.97


def test_trees_survive_a_load_where_only_the_chain_served(monkeypatch):
    """At batch 16 the chain is the best rung and nearly the only one served; the drafter
    believes its chain 1.75x over the truth, its trees 1.25x. When the load falls to batch 1 the
    trees must be rated by the trees' own record, not by the server-wide ratio that the chain's
    rounds made (0.57 against the trees' 0.8): shrunk to that, every tree rung sat outside the
    exploration margin and batch 1 stayed on the chain at ~0.80 of B=64."""
    world = World(chain_optimism=1.75)

    def after_the_chain(seed: int) -> float:
        pol = BudgetPolicy(LADDER, ServedCost(COST), 64, CHAIN)
        run(pol, 16, world, 150, seed=seed)
        return run(pol, 1, world, 150, seed=seed + 10, warm=5).of_best

    assert min(after_the_chain(s) for s in range(3)) >= 0.95

    def server_prior(self):
        g = self._g()
        return (self.rung_real + bp.RUNG_PRIOR * g) / (self.rung_pred + bp.RUNG_PRIOR)

    monkeypatch.setattr(BudgetPolicy, "rung_factors", server_prior)
    # two of the three draws stay on the chain (0.79, 0.83); one escapes (0.995)
    assert np.median([after_the_chain(s) for s in range(3)]) < 0.9


def test_a_noisy_round_forecast_does_not_pick_the_rung(monkeypatch):
    """A round's own easiness, redrawn every round (log-normal sigma 1.0), makes last round's
    curve a poor forecast of this one's. Rated on the server-wide curve (times each request's
    ease), batch 1 stays on B=64 at every draw; rated on each request's last curve, as before
    (`_raw_curves`), it followed the noise: 0.75-0.98 of B=64 over five draws, 0.89 mean. On the
    embedded pair's real drafts the last-round forecast correlated 0.48-0.55 with the accepts
    (`studies/counterfactual_rungs.py`)."""
    world = World(sigma=1.0)

    def draws() -> list[float]:
        return [
            run(
                BudgetPolicy(LADDER, ServedCost(COST), 64, CHAIN), 1, world, 300, seed=s, warm=100
            ).of_best
            for s in range(5)
        ]

    assert min(draws()) >= 0.97
    monkeypatch.setattr(BudgetPolicy, "_decision_curves", BudgetPolicy._raw_curves)
    monkeypatch.setattr(
        BudgetPolicy, "chain_gains", lambda self, s: self._chain_raw(s) * self._ratio(s)
    )
    assert np.mean(draws()) < 0.93
