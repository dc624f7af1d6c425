"""Load-aware DDTree budgets (`--speculative-ddtree-budget auto`): each round, the verify width that
maximises the batch's expected emitted tokens per second. Pure host math on small numpy arrays
(no torch, no per-node loops), so it is unit-testable and costs microseconds per round.

Gain. A DDTree tree holds the drafter's most probable prefixes, so the sum of its nodes' path
probabilities is the drafter's own expected accepted length (DDTree Prop. 1), and the best-first
order gives it for every smaller budget at once: `curve[b - 1]` = the prefix sum over the first b
nodes (`DraftTree.path_probs`). The host reads each round's curves back with its tokens. They
teach the server-wide curve (`CurveShape` times the mean chain gain), and that curve, not a
request's own last one, is what a decision rates: last round's draft forecasts this round's
accepts poorly (correlation 0.48-0.55 on the embedded pair, `studies/counterfactual_rungs.py`), a
rung chosen on it is chosen where the forecast ran high, and per round the best rung moves
little (the per-round oracle beats the best fixed rung by 0.4-3.4% there, while rungs chosen on
the forecast lost 0-1.0%). Calibration has two factors. Per rung, server-wide
(`rung_factors`): realised over the drafter's predicted accepted drafts (the served round's own
draft) in the rounds served at the rung lately (per-round means, discounted every round, shrunk
by RUNG_PRIOR drafts to its family's: a rung not served for a while returns to it). The families,
the trees and the chain, keep the same sums discounted only when they serve, shrunk to the
server-wide ratio (an EMA over every rung): after a load where only the chain served, the
server-wide ratio is the chain's, and trees rated by it stayed below the exploration margin when
the load fell (tests/test_budget_convergence.py). The drafter is not equally sure of every rung
(its chain can be believed well above its trees), hence a factor per rung. Per request:
its ease, realised over rung-calibrated predicted accepted drafts (EMAs of both; 1 for a request
not seen yet). Neither factor is learned from the other's output (a split that could drift): the
rung's from the drafter's raw prediction.

Rungs (`budget_cost.rungs`), by verify width W: plain AR (budget 0, W = 1: no draft runs), the
ladder's trees (W = 1 + budget, each drafted by its own tree spec: the round builds at its rung,
not at the cap) and, with `chain` > 0, the DFLASH chain of `chain` drafts (W = 1 + chain). A tree
round reads back the chain's gain too (`DraftTree.chain_probs`: the top-1 chain is the tree's
spine), so the chain's gain is known without running it; a chain round reads back only the chain's.

Past the built rung, and for a request without a tree curve: the server-wide `CurveShape`
(engine/budget/shape.py: growth per ladder segment, learned only from what was read back).

Exploration. Growth past the chosen rung goes stale when the traffic changes, and a rung's cost
is corrected by served rounds only where it is served (`ServedCost`), so every EXPLORE_EVERY-th
round runs the tree rung one above the best tree rung (the chain first, while its cost at this
batch is unserved), when the policy rates it within EXPLORE_MARGIN of the best: by the policy's
own estimate exploration costs at most EXPLORE_MARGIN / EXPLORE_EVERY of the throughput (< 1%),
and a rung that pays is found within a few exploration rounds (tests/test_budget_convergence.py).

Cost: `RoundCost.seconds(bs, ctx)[r]` per rung r (engine/budget/cost.py). The rung is the one
decision: at a tree rung every request takes min(rung, its own cap), since a smaller budget would
save nothing; the chain rung is open only when every request's cap allows `chain` drafts.

Decision: argmax over the rungs of (bs + sum_i gain_i(rung)) / (seconds(rung) + host seconds);
after EXPLORE_AFTER AR rounds in a row one speculative round refreshes the curves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.engine.budget.cost import (
    AnalyticCost,
    CostTable,
    RoundCost,
    ServedCost,
    rung_name,
    rung_widths,
    rungs,
)
from ddtree.engine.budget.shape import PRIOR_EMA, CurveShape, ema_weight
from ddtree.engine.config import budget_ladder

__all__ = [
    "AnalyticCost",
    "BudgetPolicy",
    "CostTable",
    "Decision",
    "RoundCost",
    "ServedCost",
    "budget_ladder",
    "rung_name",
    "rung_widths",
    "rungs",
]

EMA = 0.25  # weight of the newest round in the per-request calibration
# AR rounds draft nothing, so they neither refresh the curves nor the calibration that chose them:
# after this many AR rounds in a row the policy runs one round at its best speculative width
EXPLORE_AFTER = 32
EXPLORE_EVERY = 16  # every this many speculative rounds, one round a rung above the best
EXPLORE_MARGIN = 0.15  # ... when the policy rates that rung within this fraction of the best
RUNG_DECAY = 0.95  # per speculative round, the discount of every rung's calibration sums
RUNG_PRIOR = 16.0  # predicted drafts of pseudo-count pulling a factor to the one above it


@dataclass(frozen=True)
class Decision:
    width: int  # the round's verify width: 1 + max(budgets)
    budgets: np.ndarray  # [b] int per request (the chain: its drafts)
    predicted: np.ndarray  # [b] calibrated expected accepted drafts at those budgets
    tokens_per_s: float  # the policy's estimate for the round
    chain: bool = False  # the round drafts the DFLASH chain, not a tree
    explore: bool = False  # a rung above the best, run to measure the curve past the best
    rung: int = -1  # the rung's index in `rungs` order (-1: a stub's decision)
    clocks: tuple[int, int] | None = None  # (AR streak, speculative rounds) once it runs
    # a scripted batch-wide budget (a bench's or test's policy): the round verifies these many
    # drafted rows across the batch, packed, `budgets` capping each request's share (the
    # planner rates packing itself for this policy: `BudgetPlanner._packed`)
    rows: int | None = None


class BudgetPolicy:
    """Per-request calibration and curves in rows indexed by the request's block-table slot (reset
    when a new request takes the slot), the server-wide curve and growth, and the per-round
    choice."""

    def __init__(self, ladder: tuple[int, ...], cost: RoundCost, slots: int, chain: int = 0):
        self.ladder, self.cost = np.asarray(ladder, dtype=np.int64), cost
        self.max_budget = int(self.ladder[-1])
        r = rungs(tuple(ladder), chain)
        self.rung_budget = np.asarray([b for b, _ in r], dtype=np.int64)
        self.rung_chain = np.asarray([c for _, c in r], dtype=bool)
        self.rung_tree = ~self.rung_chain & (self.rung_budget > 0)  # the ladder's trees
        self.rung_names = tuple(rung_name(b, c) for b, c in r)  # the metrics' names, rung order
        self.chain_depth = chain
        B = max(self.max_budget, 1)
        self.shape = CurveShape(self.ladder, B)  # server-wide, past the built rung
        self.owner: list[object] = [None] * slots
        self.curve = np.zeros((slots, B))  # expected accepted drafts for budget j + 1
        self.n_read = np.zeros(slots, dtype=np.int64)  # columns of the slot's curve read back
        self.chain = np.zeros(slots)  # the drafter's expected accepted drafts of its chain
        self.chain_known = np.zeros(slots, dtype=bool)
        self.seen = np.zeros(slots, dtype=bool)  # the calibration EMAs hold a round
        self.real = np.zeros(slots)  # EMA of realised accepted drafts
        self.pred = np.zeros(slots)  # EMA of the rung-calibrated prediction for the same rounds
        self.reset()

    def reset(self) -> None:
        """Forget the server-wide learning (after the warm-up's synthetic prompts): the next
        round drafts at the cap, as a fresh server's."""
        self.shape.reset()
        self.prior_chain: float | None = None  # server-wide chain gain
        self.ar_streak = 0  # AR rounds chosen in a row
        self.spec_rounds = 0  # speculative rounds chosen (the exploration clock)
        self.g_real = self.g_pred = 0.0  # server-wide EMAs: a rung's factor before it serves
        n = len(self.rung_budget)  # per rung: discounted sums of realised and predicted drafts
        self.rung_real, self.rung_pred = np.zeros(n), np.zeros(n)
        # per family (trees, the chain): the same, discounted only when the family serves
        self.fam_real, self.fam_pred = np.zeros(2), np.zeros(2)
        self.owner = [None] * len(self.owner)
        # (slots, `_decision_curves(slots)`) computed by `observe_curves` while the verify runs, for
        # the next `choose` when it has the same requests (dropped by `_claim`, used once)
        self._raw: tuple[bytes, np.ndarray] | None = None
        self._gains: tuple[bytes, np.ndarray] | None = None  # the last `gains`, by slots

    def _claim(self, slots: np.ndarray, owners: list[object]) -> None:
        for s, o in zip(slots.tolist(), owners):
            if self.owner[s] is not o:
                self.owner[s], self._raw, self._gains = o, None, None
                self.chain_known[s] = self.seen[s] = False
                self.n_read[s] = 0
                self.real[s] = self.pred[s] = 0.0

    def _g(self) -> float:
        return self.g_real / self.g_pred if self.g_pred > 0 else 1.0

    def _ratio(self, slots: np.ndarray) -> np.ndarray:
        """[b] each request's ease: realised / rung-calibrated predicted accepted drafts (1 for
        a request not seen yet)."""
        pred = self.pred[slots]
        return np.where(pred > 0, self.real[slots] / np.maximum(pred, 1e-9), 1.0)

    def rung_factors(self) -> np.ndarray:
        """[R] per rung: realised over the drafter's predicted accepted drafts in the rounds
        served there lately, shrunk towards its family's (trees, chain), which is shrunk towards
        the server-wide ratio."""
        g = self._g()
        fam = (self.fam_real + RUNG_PRIOR * g) / (self.fam_pred + RUNG_PRIOR)
        prior = fam[self.rung_chain.astype(np.int64)]
        return (self.rung_real + RUNG_PRIOR * prior) / (self.rung_pred + RUNG_PRIOR)

    def _raw_curves(self, slots: np.ndarray) -> np.ndarray:
        """[b, B] the drafter's own curves: read back up to the slot's built rung, grown past it
        by the server-wide growth; the server-wide curve (or every node accepted, before any
        tree round) for a slot not read back yet."""
        n = self.n_read[slots][:, None]
        out = self.shape.grow(self.curve[slots], n)
        if (n > 0).all():
            return out
        base = self.shape.base(self._chain_raw(slots))
        if base is None:
            base = np.arange(1, out.shape[1] + 1, dtype=np.float64)[None, :]
        return np.where(n > 0, out, base)

    def _decision_curves(self, slots: np.ndarray) -> np.ndarray:
        """[b, B] the curves a decision rates: the server-wide curve for every request once a
        tree round taught it (the per-request curves before that). A request's own curve is
        last round's draft, a weak forecast of this round's (correlation 0.48-0.55 with the
        accepts, against 0.83-0.86 for the round's own draft; `studies/counterfactual_rungs.py`):
        choosing the rung on it picks a rung where its forecast ran high, which cost 0-1.0% of
        the best fixed rung there even with unbiased factors, and it biased the rung factors
        (a rung's realised over predicted, learned where it was chosen)."""
        if self.prior_chain is None:
            return self._raw_curves(slots)
        base = self.shape.base(np.full(len(slots), self.prior_chain))
        return self._raw_curves(slots) if base is None else base

    def gains(self, slots: np.ndarray) -> np.ndarray:
        """[b, B + 1] the drafter's expected accepted drafts for budgets 0..B (the server-wide
        curve, `_decision_curves`) times each request's ease (the rung factor is `_rates`')."""
        raw, self._raw = self._raw, None
        if raw is None or raw[0] != slots.tobytes():
            raw = (b"", self._decision_curves(slots))
        curve = raw[1] * self._ratio(slots)[:, None]
        out = np.concatenate([np.zeros((len(slots), 1)), curve], 1)
        self._gains = (slots.tobytes(), out)  # for `batch_gain` right after a decision
        return out

    def _chain_raw(self, slots: np.ndarray) -> np.ndarray:
        """[b] the drafter's own expected accepted drafts of the chain (the server's, unseen)."""
        unseen = float(self.chain_depth) if self.prior_chain is None else self.prior_chain
        return np.where(self.chain_known[slots], self.chain[slots], unseen)

    def chain_gains(self, slots: np.ndarray) -> np.ndarray:
        """[b] the drafter's expected accepted drafts of the DFLASH chain (server-wide once
        known, as `_decision_curves`) times the ease."""
        if self.prior_chain is None:
            return self._chain_raw(slots) * self._ratio(slots)
        return self.prior_chain * self._ratio(slots)

    def choose(self, slots, owners: list[object], caps, ctx: int, extra_s: float = 0.0) -> Decision:
        """slots [b] block-table rows, owners [b] the request objects (identity marks a new
        request in a slot), caps [b] each request's largest allowed budget, ctx the longest
        context, extra_s the round's host time outside the device work (every rung pays it, so
        it favours the rungs that emit more). Vectorised over requests and rungs."""
        return self.commit(self.propose(slots, owners, caps, ctx, extra_s))

    def propose(
        self, slots, owners: list[object], caps, ctx: int, extra_s: float = 0.0
    ) -> Decision:
        """`choose`'s decision without advancing its clocks (the AR streak, the exploration
        clock): the planner proposes the next round's decision while this round's verify runs
        and `commit`s it if the next round has the same requests (`carry` it otherwise)."""
        slots, caps = np.asarray(slots, dtype=np.int64), np.asarray(caps, dtype=np.int64)
        self._claim(slots, owners)
        per, gain, rate = self._rates(slots, caps, ctx, extra_s)
        best = int(np.argmax(rate))
        streak, spec = (self.ar_streak + 1 if best == 0 else 0), self.spec_rounds
        if best == 0 and streak > EXPLORE_AFTER and len(rate) > 1:
            best, streak = 1 + int(np.argmax(rate[1:])), 0
        explore = False
        if best > 0:
            spec += 1
            if spec % EXPLORE_EVERY == 0:
                up = self._explore_rung(rate, per, best, len(slots))
                explore = up is not None and rate[up] >= (1 - EXPLORE_MARGIN) * rate[best]
                best = up if explore else best
        chain = bool(self.rung_chain[best])
        budgets = per[:, best]
        width = 1 + int(budgets.max(initial=0))
        rate_best = float(rate[best])
        return Decision(
            width, budgets, gain[:, best], rate_best, chain, explore, best, (streak, spec)
        )

    def carry(self, d: Decision, prev_owners: list[object], owners: list[object], caps):
        """`d`, proposed for the last round's requests (`prev_owners`), for a batch that changed
        (requests left or joined): the same rung, each request's budget capped by its own cap,
        the kept requests' predictions and the proposal's mean for a new one. Nothing is rated
        again and no slot is claimed here (the next proposal, under the verify, claims them
        after taking in the last round's accepts): the rung rated for a batch one or two
        requests away, one round late, in place of a decision on the critical path (`choose`,
        the last round's calibration taken in first; at concurrency 8-32 a request finishes or
        joins almost every round, and deciding on the critical path put auto's plan phase
        visibly over DFLASH's: docs/design-numbers.md). None where it cannot serve (the chain under a smaller
        cap, no rung, or before the decisions rate the server-wide curve, where a slot's own
        curve, which the claim resets, is what a decision rates): the planner decides."""
        if d.rung < 0 or self.prior_chain is None:
            return None
        caps = np.asarray(caps, dtype=np.int64)
        chain = bool(self.rung_chain[d.rung])
        if chain and len(caps) and caps.min() < self.chain_depth:
            return None
        budgets = np.minimum(self.rung_budget[d.rung], caps)
        at = {id(o): i for i, o in enumerate(prev_owners)}
        fill = float(d.predicted.mean()) if len(d.predicted) else 0.0
        predicted = np.asarray([d.predicted[at[id(o)]] if id(o) in at else fill for o in owners])
        width = 1 + int(budgets.max(initial=0))
        return Decision(
            width, budgets, predicted, d.tokens_per_s, chain, d.explore, d.rung, d.clocks
        )

    def commit(self, d: Decision) -> Decision:
        """The proposed decision runs: its clocks become the policy's."""
        if d.clocks is not None:
            self.ar_streak, self.spec_rounds = d.clocks
        return d

    def _explore_rung(self, rate: np.ndarray, per: np.ndarray, best: int, bs: int) -> int | None:
        """The chain while its round cost at this batch has not been served (a profile that
        overrates it is corrected only by serving it; its gain is read back from every tree's
        spine), else the tree rung one above the best tree rung (whose curve past it is
        extrapolated; from the tree family's best, not the overall best: the chain is cheaper
        than the tree of its width, so from the chain the next tree rung may lose while the one
        above it wins); None where there is none (caps)."""
        served = getattr(self.cost, "served", None)
        if self.chain_depth and not self.rung_chain[best] and served is not None:
            c = int(np.flatnonzero(self.rung_chain)[0])
            if not served(bs, c):
                return c
        tree = self.rung_tree
        if not tree.any():
            return None
        t = int(np.flatnonzero(tree)[np.argmax(rate[tree])])
        top = per[:, t].max(initial=0)
        up = [int(u) for u in np.flatnonzero(tree) if u > t and per[:, u].max() > top]
        return up[0] if up else None

    def _rates(self, slots: np.ndarray, caps: np.ndarray, ctx: int, extra_s: float):
        """([b, R] budgets, [b, R] calibrated gains, [R] expected tokens / s) per rung."""
        g = self.gains(slots)
        # [b, R]: request i's budget at rung r, and its gain there
        per = np.minimum(self.rung_budget[None, :], caps[:, None])
        gain = g[np.arange(len(per))[:, None], per]  # take_along_axis: 3x the host time
        if self.chain_depth:
            gain[:, self.rung_chain] = self.chain_gains(slots)[:, None]
        gain *= self.rung_factors()[None, :]
        tokens = len(slots) + gain.sum(0)
        rate = tokens / (self.cost.seconds(len(slots), ctx) + extra_s)
        if self.chain_depth and len(caps) and caps.min() < self.chain_depth:
            rate[self.rung_chain] = -np.inf  # a request's cap is below the chain's drafts
        return per, gain, rate

    def rates(self, slots, caps, ctx: int, extra_s: float = 0.0) -> np.ndarray:
        """[R] the expected tokens / s of every rung (`rungs` order) for known requests."""
        slots, caps = np.asarray(slots, dtype=np.int64), np.asarray(caps, dtype=np.int64)
        return self._rates(slots, caps, ctx, extra_s)[2]

    def batch_gain(self, slots, owners: list[object], caps) -> np.ndarray:
        """[1 + sum(caps)] the batch's expected accepted drafts of its R best drafted nodes, for
        R = 0.. (a batch-wide budget's gain curve): every request's calibrated marginal gains
        (its curve's steps, up to its cap, times its ease and the tree family's factor) sorted
        best first and summed. A best-first curve's steps never grow, so the top R steps of all
        requests are each request's first few: the nodes a value threshold keeps."""
        slots, caps = np.asarray(slots, dtype=np.int64), np.asarray(caps, dtype=np.int64)
        self._claim(slots, owners)
        cached, self._gains = self._gains, None  # the decision's own, just rated: used once
        g = cached[1] if cached is not None and cached[0] == slots.tobytes() else self.gains(slots)
        steps = np.diff(g, axis=1)
        tree = self.rung_tree
        factor = float(self.rung_factors()[tree][-1]) if tree.any() else 1.0
        k = np.arange(steps.shape[1])
        picked = np.sort(steps[k[None, :] < caps[:, None]])[::-1] * factor
        return np.concatenate([[0.0], np.cumsum(np.maximum(picked, 0.0))])

    def tree_costs(self, bs: int, ctx: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, seconds) of the tree rungs' rounds at this batch (rows bs x (1 + B), ascending;
        seconds non-decreasing): the points a batch-wide budget's round is priced between."""
        tree = self.rung_tree
        rows = bs * (1 + self.rung_budget[tree]).astype(np.float64)
        secs = np.maximum.accumulate(np.asarray(self.cost.seconds(bs, ctx))[tree])
        return rows, secs

    def ar_seconds(self, bs: int, ctx: int) -> float:
        """Seconds of an AR round (the width-1 rung) at this batch."""
        ar = (self.rung_budget == 0) & ~self.rung_chain
        return float(np.asarray(self.cost.seconds(bs, ctx))[ar][0]) if ar.any() else 0.0

    def _built(self, budgets: np.ndarray) -> int:
        """The tree rung a round of these budgets built (the smallest ladder budget >= all)."""
        i = int(np.searchsorted(self.ladder, budgets.max(initial=0)))
        return int(self.ladder[min(i, len(self.ladder) - 1)])

    def observe(self, slots, budgets, curves, accepted, chain=None, full=None) -> None:
        """After a round: curves [b, B] the round's trees' expected accepted drafts per budget (the
        drafter's own, uncalibrated; columns past the round's built rung are not read), or None
        for a chain round; chain [b] the chain's expected accepted drafts (None: not read back);
        accepted [b] the drafts the target accepted; full [b] the rows drafted at full depth
        (None: all): only those teach the server-wide curve, a depth-limited tree's flat tail
        says nothing of the next request's. `observe_curves` then `observe_accepted`: the two
        halves touch disjoint state, so the decoder runs the first while the verify runs."""
        self.observe_accepted(self.observe_curves(slots, budgets, curves, chain, full), accepted)

    def observe_curves(self, slots, budgets, curves, chain=None, full=None) -> tuple | None:
        """The half of `observe` that needs only the draft (the curves, the chain's gain): the
        slots' curves and the server-wide shape and chain prior. Returns what
        `observe_accepted` needs (None: nothing drafted)."""
        slots = np.asarray(slots, dtype=np.int64)
        budgets = np.asarray(budgets, dtype=np.int64)
        ran = budgets > 0  # a budget-0 round drafted nothing: no curve, nothing to calibrate
        if not ran.any():
            return None
        s = slots[ran]
        deep = None if full is None else np.asarray(full, bool)[ran]
        if chain is not None:
            ch = np.asarray(chain, dtype=np.float64)[ran]
        if curves is None:  # a chain round: the chain's own prediction
            predicted, rung = ch, int(np.flatnonzero(self.rung_chain)[0])
        else:
            c = np.asarray(curves, dtype=np.float64)[ran]
            predicted = c[np.arange(len(c)), budgets[ran] - 1]
            built = self._built(budgets)
            rung = int(np.flatnonzero((self.rung_budget == built) & ~self.rung_chain)[0])
            self.curve[s] = c
            self.n_read[s] = built
            if deep is None:
                self.shape.learn(c, built, None if chain is None else ch)
            elif deep.any():
                self.shape.learn(c[deep], built, None if chain is None else ch[deep])
        if chain is not None:
            self.chain[s] = ch
            self.chain_known[s] = True
            d = ch if deep is None else ch[deep]
            if len(d):
                m, pc, w = float(d.mean()), self.prior_chain, ema_weight(PRIOR_EMA, len(d))
                self.prior_chain = m if pc is None else (1 - w) * pc + w * m
        # the next round's curves, if it has the same requests (nothing else changes them)
        self._raw = (slots.tobytes(), self._decision_curves(slots))
        return s, ran, predicted, rung

    def observe_accepted(self, pending: tuple | None, accepted) -> None:
        """The other half (after the read-back): the calibration, realised accepted drafts
        against the drafter's prediction, per rung and per request. pending: `observe_curves`'
        return."""
        if pending is None:
            return
        s, ran, predicted, rung = pending
        real = np.asarray(accepted, dtype=np.float64)[ran]
        # the request's ease against what the rung's factor expected before this round
        cal = self.rung_factors()[rung] * predicted
        # one sample per round whatever its batch (a batch of 64 must not outweigh the rounds
        # that follow it for 30 rounds)
        r_mean, p_mean = float(real.mean()), float(predicted.mean())
        w = ema_weight(PRIOR_EMA, len(s)) if self.g_pred > 0 else 1.0
        self.g_real = (1 - w) * self.g_real + w * r_mean
        self.g_pred = (1 - w) * self.g_pred + w * p_mean
        self.rung_real *= RUNG_DECAY
        self.rung_pred *= RUNG_DECAY
        self.rung_real[rung] += r_mean
        self.rung_pred[rung] += p_mean
        f = int(self.rung_chain[rung])  # the family's sums decay only when it serves
        self.fam_real[f] = RUNG_DECAY * self.fam_real[f] + r_mean
        self.fam_pred[f] = RUNG_DECAY * self.fam_pred[f] + p_mean
        # a request's first round starts its EMAs at ease 1 (one round with nothing accepted
        # must not switch its speculation off for good)
        first = ~self.seen[s]
        real0 = np.where(first, cal, self.real[s])
        pred0 = np.where(first, cal, self.pred[s])
        self.real[s] = (1 - EMA) * real0 + EMA * real
        self.pred[s] = (1 - EMA) * pred0 + EMA * cal
        self.seen[s] = True
