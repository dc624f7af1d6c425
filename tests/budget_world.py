"""A synthetic serving world for the budget policy (pure numpy, no model): the 8B-shape run's
per-rung acceptance and measured round costs per (batch bucket, rung), a drafter whose gain curve
follows each round's real acceptance up to an optimism factor, and requests that come and go.
`run` feeds a policy the realised accept lengths of the rungs it picks, as `BudgetPlanner.observe`
does (a tree's curve read back up to its built rung, the edge value past it; the chain's gain every
speculative round), and each round's served seconds to its cost when that learns (`ServedCost`),
and scores it and every fixed rung on the same requests and draws (at COST, the true costs)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.engine.budget.policy import CostTable, rung_name, rungs

LADDER, CHAIN, CAP = (0, 8, 16, 32, 64), 15, 64
BATCHES = (1, 4, 16, 64)
RUNGS = rungs(LADDER, CHAIN)  # AR, B8, chain, B16, B32, B64
NAMES = tuple(rung_name(b, c) for b, c in RUNGS)
# round ms per rung (RUNGS order). AR, chain, B16, B64: the fixed servers' /metrics round ms of
# the 8B-shape run (BENCHMARKS, 2026-12-01; AR: NONE's TPOT); B8 from auto's B8 rounds at 64, B32
# between B16 and B64 by verify rows.
MS = {
    1: (5.7, 8.1, 7.41, 8.20, 8.23, 8.28),
    4: (5.8, 8.5, 7.97, 9.09, 9.70, 10.95),
    16: (6.1, 10.5, 10.95, 12.76, 16.8, 24.84),
    64: (8.3, 22.0, 25.36, 29.29, 43.4, 71.48),
}
COST = CostTable(LADDER, BATCHES, (4096,), np.array([[MS[b]] for b in BATCHES]) / 1e3, chain=CHAIN)


def profile(scale: dict[str, float], minus_ms: float = 0.0) -> CostTable:
    """COST with some rungs' seconds scaled at every batch, less `minus_ms` at every rung: a
    startup profile that is off (the graph replays alone miss a served round's common overhead:
    ~1-1.8 ms at the 8B shape, 2026-12-02)."""
    k = np.array([scale.get(n, 1.0) for n in NAMES])
    return CostTable(LADDER, BATCHES, (4096,), COST.table * k - minus_ms / 1e3, chain=CHAIN)


# tau (tokens per round) per tree rung and the chain: the 8B run's DFLASH 6.8 / B16 7.5 / B64 9.5
TAU = {8: 6.1, 16: 7.5, 32: 8.5, 64: 9.5}
CHAIN_TAU = 6.8


@dataclass(frozen=True)
class World:
    optimism: float = 1.25  # the drafter's expected accepted drafts over the realised mean
    tail_belief: float = 1.0  # the drafter's belief in the tree past budget 16, over the truth
    sigma: float = 0.5  # log-normal spread of a round's easiness (head and tail apart)
    request_sigma: float = 0.3  # the same per request, for its whole life
    life: int = 16  # rounds a request lives (128 tokens at tau ~8)
    flat_last: bool = False  # a request's last round is depth-limited (max_tokens): no tail
    cost_noise: float = 0.03  # log-normal spread of a served round's seconds around COST's
    # the drafter's belief in its chain over the truth (None: `optimism`). The 8B-shape run of
    # 2026-12-02 saw the chain believed ~1.05-1.6x more than the trees (per-rung counters)
    chain_optimism: float | None = None


# the warm-up's synthetic prompts: drafts the drafter is unsure of, trees depth-limited by the
# warm-up requests' few tokens (a flat tail past budget 16)
SYNTHETIC = World(optimism=0.3, tail_belief=0.0)


@dataclass
class Result:
    rate: float  # the policy's tokens / s
    fixed: np.ndarray  # [R] each fixed rung's tokens / s on the same requests and draws
    picks: dict[str, int]  # rounds per rung the policy chose
    explored: int  # rounds the policy marked as exploration

    @property
    def of_best(self) -> float:
        return self.rate / float(self.fixed.max())

    @property
    def best(self) -> str:
        return NAMES[int(np.argmax(self.fixed))]


def _curve() -> tuple[np.ndarray, np.ndarray]:
    """([CAP] head, [CAP] tail): true mean accepted drafts at budgets 1..CAP, split at 16."""
    knots = (0, 8, 16, 32, 64)
    g = np.interp(np.arange(1, CAP + 1), knots, [0.0] + [TAU[k] - 1 for k in knots[1:]])
    return np.minimum(g, g[15]), np.maximum(g - g[15], 0.0)


def run(
    policy, bs: int, world: World, rounds: int, seed: int = 0, warm: int = 0, planner=False
) -> Result:
    """`warm` + `rounds` rounds at batch bs; the last `rounds` are scored, in expectation given
    each request's easiness (not the Poisson draws the policy sees): low variance. `planner`:
    each round's decision as `BudgetPlanner.plan` takes it (`decide`), not `choose` in line."""
    rng = np.random.default_rng(seed)
    head, tail = _curve()
    slots, owners = np.arange(bs), [object() for _ in range(bs)]
    age = rng.integers(0, world.life, bs)  # staggered arrivals
    mu_r, mu = -0.5 * world.request_sigma**2, -0.5 * world.sigma**2  # E[lognormal] = 1
    easy = rng.lognormal(mu_r, world.request_sigma, (2, bs))  # per request: head, tail
    tokens = seconds = 0.0
    fixed_tokens, fixed_seconds = np.zeros(len(RUNGS)), np.zeros(len(RUNGS))
    picks: dict[str, int] = {}
    explored = 0
    proposal = None  # planner: (the requests it was proposed for, the Decision)
    for k in range(warm + rounds):
        for i in np.flatnonzero(age >= world.life):  # finished: a new request takes the slot
            owners[i], age[i] = object(), 0
            easy[:, i] = rng.lognormal(mu_r, world.request_sigma, 2)
        if planner:
            d = decide(policy, slots, owners, proposal)
        else:
            d = policy.choose(slots, owners, [CAP] * bs, 1024)
        deep = ~(world.flat_last & (age == world.life - 1))  # rows drafted at full depth
        u, v = rng.lognormal(mu, world.sigma, (2, bs)) * easy
        v = np.where(deep, v, 0.0)
        truth = head[None, :] * u[:, None] + tail[None, :] * v[:, None]  # [bs, CAP]
        belief = world.optimism * (truth + (world.tail_belief - 1) * tail[None, :] * v[:, None])
        chain_true = (CHAIN_TAU - 1) * u
        budgets = np.asarray(d.budgets)
        r = _rung_index(d)
        if d.width == 1:
            mean, curves = np.zeros(bs), None
        elif d.chain:
            mean, curves = chain_true, None
        else:
            mean = truth[slots, budgets - 1]
            built = RUNGS[r][0]
            edge = np.repeat(belief[:, built - 1 : built], CAP - built, 1)
            curves = np.concatenate([belief[:, :built], edge], 1)
        accepted = np.minimum(rng.poisson(mean), CHAIN)  # capped at the block's depth
        c_opt = world.optimism if world.chain_optimism is None else world.chain_optimism
        chain = None if d.width == 1 else c_opt * chain_true
        kw = {} if deep.all() else {"full": deep}
        policy.observe(slots, budgets, curves, accepted, chain=chain, **kw)
        served = COST.seconds(bs, 1024)[r] * rng.lognormal(0.0, world.cost_noise)
        if hasattr(getattr(policy, "cost", None), "observe"):  # as BudgetPlanner.plan does
            policy.cost.observe(bs, 1024, r, served)
        if planner:  # under the verify (here after the round's accepts too)
            proposal = (list(owners), policy.propose(slots, owners, [CAP] * bs, 1024))
        age += 1
        picks[NAMES[r]] = picks.get(NAMES[r], 0) + 1
        explored += bool(getattr(d, "explore", False))
        if k < warm:
            continue
        e_head, e_tail = easy[0], np.where(deep, easy[1], 0.0)
        per_rung = np.array(
            [
                (CHAIN_TAU - 1) * e_head.sum()
                if c
                else (head[b - 1] * e_head + tail[b - 1] * e_tail).sum()
                if b
                else 0.0
                for b, c in RUNGS
            ]
        )
        cost = COST.seconds(bs, 1024)
        tokens += bs + per_rung[r]
        seconds += cost[r]
        fixed_tokens += bs + per_rung
        fixed_seconds += cost
    return Result(tokens / seconds, fixed_tokens / fixed_seconds, picks, explored)


def decide(policy, slots, owners: list, proposal: tuple | None):
    """As `BudgetPlanner.plan`: the decision proposed after the last round committed when the
    requests are the same, carried (`BudgetPolicy.carry`) when the batch changed, `choose`
    where it declines or before any proposal."""
    caps = [CAP] * len(slots)
    if proposal is not None:
        prev, d = proposal
        if any(a is not b for a, b in zip(prev, owners)):
            d = policy.carry(d, prev, owners, caps)
        if d is not None:
            return policy.commit(d)
    return policy.choose(slots, owners, caps, 1024)


def _rung_index(d) -> int:
    if d.chain:
        return RUNGS.index((CHAIN, True))
    b = int(np.asarray(d.budgets).max(initial=0))
    return RUNGS.index((LADDER[int(np.searchsorted(LADDER, b))], False))
