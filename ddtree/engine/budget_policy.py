"""Load-aware DDTree budgets (`--speculative-ddtree-budget auto`): each round, the verify width that
maximises the batch's expected emitted tokens per second. Pure host math on small numpy arrays
(no torch, no per-node loops), so it is unit-testable and costs microseconds per round.

Gain. A DDTree tree holds the drafter's most probable prefixes, so the sum of its nodes' path
probabilities is the drafter's own expected accepted length (DDTree Prop. 1), and the best-first
order gives it for every smaller budget at once: `curve[b - 1]` = the prefix sum over the first b
nodes (`DraftTree.path_probs`). The host reads each request's curve back with the round's tokens,
so round k + 1 decides on round k's curve. The drafter is optimistic or pessimistic per request:
its realised accepted drafts over its predicted ones (EMAs of both, started from the server-wide
ratio) scale the curve; a request not seen yet takes the server-wide curve and ratio.

Rungs. The choices (`rungs`), by verify width W: plain AR (budget 0, W = 1: no draft runs), the
ladder's trees (W = 1 + budget, each drafted by its own tree spec: the round builds at its rung,
not at the cap) and, with `chain` > 0, the DFLASH chain of `chain` drafts (W = 1 + chain). A tree
round reads back the chain's gain too (`DraftTree.chain_probs`: the top-1 chain is the tree's
spine), so the chain's gain is known without running it; a chain round reads back only the chain's.
A tree built below the cap tells nothing of the wider budgets: their part of the curve keeps its
old increments on top of the new value (`_extend`).

Cost. With CUDA graphs every row of a round is padded to the round's width W and the batch to its
bucket, so a round costs `cost.seconds(bs, ctx)[r]` for each rung r (`RoundCost`: measured at
startup on the device, or `AnalyticCost`). The rung is the one decision: at a tree rung every
request takes min(rung, its own cap), since a smaller budget would save nothing; the chain rung
is open only when every request's cap allows `chain` drafts.

Decision: argmax over the rungs of (bs + sum_i gain_i(rung)) / (seconds(rung) + host seconds);
after EXPLORE_AFTER AR rounds in a row one speculative round refreshes the curves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ddtree.engine.config import budget_ladder

__all__ = [
    "AnalyticCost",
    "BudgetPolicy",
    "CostTable",
    "Decision",
    "budget_ladder",
    "rung_widths",
    "rungs",
]

EMA = 0.25  # weight of the newest round in the per-request calibration
# AR rounds draft nothing, so they neither refresh the curves nor the calibration that chose them:
# after this many AR rounds in a row the policy runs one round at its best speculative width
EXPLORE_AFTER = 32
PRIOR_EMA = 0.05  # weight of one request's curve in the server-wide prior for new requests


def rungs(ladder: tuple[int, ...], chain: int = 0) -> tuple[tuple[int, bool], ...]:
    """The policy's choices as (budget, is_chain), by verify width 1 + budget: the ladder's trees
    (budget 0: AR) and, with `chain` > 0, the DFLASH chain of `chain` drafts (before a tree of the
    same width). Every `RoundCost` returns its seconds in this order."""
    out = [(int(b), False) for b in ladder] + ([(int(chain), True)] if chain else [])
    return tuple(sorted(out, key=lambda r: (r[0], not r[1])))


def rung_widths(ladder: tuple[int, ...], chain: int = 0) -> np.ndarray:
    return np.asarray([1 + b for b, _ in rungs(ladder, chain)], dtype=np.float64)


class RoundCost(Protocol):
    def seconds(self, bs: int, ctx: int) -> np.ndarray:
        """[len(rungs)] seconds per round at each rung for a batch of bs requests whose longest
        context is ctx tokens."""


@dataclass(frozen=True)
class AnalyticCost:
    """Roofline estimate: draft (skipped at W = 1) + verify, each max(weight read, GEMM flops) plus
    the KV read and a per-forward overhead. Without captured graphs its per-row time and overhead
    are fitted to timed eager forwards (`budget_profile.fitted_cost`)."""

    ladder: tuple[int, ...]
    target_bytes: float  # weight bytes read per forward
    target_flops_per_row: float  # ~2 x parameters
    drafter_bytes: float
    drafter_flops_per_row: float
    draft_rows: int  # block size S (the drafter's rows per request)
    kv_bytes_per_token: float
    bandwidth: float = 4.0e12  # bytes / s (H200 HBM3e, achieved)
    flops: float = 5.0e14  # dense bf16 GEMM throughput achieved at these shapes
    overhead: float = 1.5e-3  # per-forward launch / small-kernel time
    draft_overhead: float | None = None  # the drafter forward's (None: `overhead`)
    chain: int = 0  # the DFLASH chain rung's drafts (0: no chain rung)

    def seconds(self, bs: int, ctx: int) -> np.ndarray:
        w = rung_widths(self.ladder, self.chain)
        kv = bs * ctx * self.kv_bytes_per_token / self.bandwidth
        verify = np.maximum(
            self.target_bytes / self.bandwidth, bs * w * self.target_flops_per_row / self.flops
        )
        draft = max(
            self.drafter_bytes / self.bandwidth,
            bs * self.draft_rows * self.drafter_flops_per_row / self.flops,
        )
        d_over = self.overhead if self.draft_overhead is None else self.draft_overhead
        return verify + kv + self.overhead + np.where(w > 1, draft + d_over, 0.0)


@dataclass(frozen=True)
class CostTable:
    """Measured seconds per round on the device: [batch bucket, context bound, rung]. A
    batch or context between two measured points takes the next one up (what the graphs run).
    `kv_s_per_token` adds the context's KV read (bs x ctx tokens) to every width, for tables
    measured at one short context."""

    ladder: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    table: np.ndarray
    kv_s_per_token: float = 0.0
    chain: int = 0  # the DFLASH chain rung's drafts (0: no chain rung)

    def seconds(self, bs: int, ctx: int) -> np.ndarray:
        i = min(int(np.searchsorted(self.batches, bs)), len(self.batches) - 1)
        j = min(int(np.searchsorted(self.contexts, ctx)), len(self.contexts) - 1)
        return self.table[i, j] + bs * ctx * self.kv_s_per_token

    def to_json(self) -> dict:
        return {
            "ladder": list(self.ladder),
            "chain": self.chain,
            "batches": list(self.batches),
            "contexts": list(self.contexts),
            "seconds": self.table.tolist(),
            "kv_s_per_token": self.kv_s_per_token,
        }

    @classmethod
    def from_json(cls, d: dict) -> CostTable:
        t = np.asarray(d["seconds"], dtype=np.float64)
        chain = int(d.get("chain", 0))
        shape = (len(d["batches"]), len(d["contexts"]), len(rungs(tuple(d["ladder"]), chain)))
        if t.shape != shape:
            raise ValueError(f"cost table of shape {t.shape}, expected {shape}")
        ladder, batches, ctx = tuple(d["ladder"]), tuple(d["batches"]), tuple(d["contexts"])
        return cls(ladder, batches, ctx, t, float(d.get("kv_s_per_token", 0.0)), chain)


@dataclass(frozen=True)
class Decision:
    width: int  # the round's verify width: 1 + max(budgets)
    budgets: np.ndarray  # [b] int per request (the chain: its drafts)
    predicted: np.ndarray  # [b] calibrated expected accepted drafts at those budgets
    tokens_per_s: float  # the policy's estimate for the round
    chain: bool = False  # the round drafts the DFLASH chain, not a tree


class BudgetPolicy:
    """Per-request calibration and curves in rows indexed by the request's block-table slot (reset
    when a new request takes the slot), and the per-round choice."""

    def __init__(self, ladder: tuple[int, ...], cost: RoundCost, slots: int, chain: int = 0):
        self.ladder, self.cost = np.asarray(ladder, dtype=np.int64), cost
        self.max_budget = int(self.ladder[-1])
        r = rungs(tuple(ladder), chain)
        self.rung_budget = np.asarray([b for b, _ in r], dtype=np.int64)
        self.rung_chain = np.asarray([c for _, c in r], dtype=bool)
        self.chain_depth = chain
        B = max(self.max_budget, 1)
        self.owner: list[object] = [None] * slots
        self.curve = np.zeros((slots, B))  # expected accepted drafts for budget j + 1
        self.known = np.zeros(slots, dtype=bool)  # the slot's curve was read back
        self.chain = np.zeros(slots)  # the drafter's expected accepted drafts of its chain
        self.chain_known = np.zeros(slots, dtype=bool)
        self.seen = np.zeros(slots, dtype=bool)  # the calibration EMAs hold a round
        self.real = np.zeros(slots)  # EMA of realised accepted drafts
        self.pred = np.zeros(slots)  # EMA of the drafter's prediction for the same rounds
        self.prior: np.ndarray | None = None  # server-wide curve for requests not yet seen
        self.prior_chain: float | None = None  # server-wide chain gain
        self.ar_streak = 0  # AR rounds chosen in a row
        self.g_real = self.g_pred = 0.0  # server-wide EMAs: the calibration of new requests

    def _claim(self, slots: np.ndarray, owners: list[object]) -> None:
        for s, o in zip(slots.tolist(), owners):
            if self.owner[s] is not o:
                self.owner[s] = o
                self.known[s] = self.chain_known[s] = self.seen[s] = False
                self.real[s] = self.pred[s] = 0.0

    def _ratio(self, slots: np.ndarray) -> np.ndarray:
        """[b] realised / predicted accepted drafts (the server-wide ratio for new requests)."""
        g = self.g_real / self.g_pred if self.g_pred > 0 else 1.0
        pred = self.pred[slots]
        return np.where(pred > 0, self.real[slots] / np.maximum(pred, 1e-9), g)

    def _raw_curves(self, slots: np.ndarray) -> np.ndarray:
        """[b, B] the drafter's own curves (the prior, or every node accepted, where unknown)."""
        curve = self.curve[slots]
        if self.prior is not None:
            return np.where(self.known[slots, None], curve, self.prior[None, :])
        unseen = np.arange(1, curve.shape[1] + 1, dtype=np.float64)[None, :]
        return np.where(self.known[slots, None], curve, unseen)

    def gains(self, slots: np.ndarray) -> np.ndarray:
        """[b, B + 1] calibrated expected accepted drafts for budgets 0..B."""
        curve = self._raw_curves(slots) * self._ratio(slots)[:, None]
        return np.concatenate([np.zeros((len(slots), 1)), curve], 1)

    def chain_gains(self, slots: np.ndarray) -> np.ndarray:
        """[b] calibrated expected accepted drafts of the DFLASH chain."""
        unseen = float(self.chain_depth) if self.prior_chain is None else self.prior_chain
        raw = np.where(self.chain_known[slots], self.chain[slots], unseen)
        return raw * self._ratio(slots)

    def choose(self, slots, owners: list[object], caps, ctx: int, extra_s: float = 0.0) -> Decision:
        """slots [b] block-table rows, owners [b] the request objects (identity marks a new
        request in a slot), caps [b] each request's largest allowed budget, ctx the longest
        context, extra_s the round's host time outside the device work (every rung pays it, so
        it favours the rungs that emit more). Vectorised over requests and rungs."""
        slots, caps = np.asarray(slots, dtype=np.int64), np.asarray(caps, dtype=np.int64)
        self._claim(slots, owners)
        per, gain, rate = self._rates(slots, caps, ctx, extra_s)
        best = int(np.argmax(rate))
        self.ar_streak = self.ar_streak + 1 if best == 0 else 0
        if best == 0 and self.ar_streak > EXPLORE_AFTER and len(rate) > 1:
            best, self.ar_streak = 1 + int(np.argmax(rate[1:])), 0
        chain = bool(self.rung_chain[best])
        budgets = per[:, best]
        width = 1 + int(budgets.max(initial=0))
        return Decision(width, budgets, gain[:, best], float(rate[best]), chain)

    def _rates(self, slots: np.ndarray, caps: np.ndarray, ctx: int, extra_s: float):
        """([b, R] budgets, [b, R] calibrated gains, [R] expected tokens / s) per rung."""
        g = self.gains(slots)
        # [b, R]: request i's budget at rung r, and its gain there
        per = np.minimum(self.rung_budget[None, :], caps[:, None])
        gain = np.take_along_axis(g, per, 1)
        if self.chain_depth:
            gain[:, self.rung_chain] = self.chain_gains(slots)[:, None]
        tokens = len(slots) + gain.sum(0)
        rate = tokens / (self.cost.seconds(len(slots), ctx) + extra_s)
        if self.chain_depth and len(caps) and caps.min() < self.chain_depth:
            rate[self.rung_chain] = -np.inf  # a request's cap is below the chain's drafts
        return per, gain, rate

    def rates(self, slots, caps, ctx: int, extra_s: float = 0.0) -> np.ndarray:
        """[R] the expected tokens / s of every rung (`rungs` order) for known requests."""
        slots, caps = np.asarray(slots, dtype=np.int64), np.asarray(caps, dtype=np.int64)
        return self._rates(slots, caps, ctx, extra_s)[2]

    def _built(self, budgets: np.ndarray) -> int:
        """The tree rung a round of these budgets built (the smallest ladder budget >= all)."""
        i = int(np.searchsorted(self.ladder, budgets.max(initial=0)))
        return int(self.ladder[min(i, len(self.ladder) - 1)])

    def _extend(self, s: np.ndarray, c: np.ndarray, built: int) -> np.ndarray:
        """Curves built at `built` < B: past it, the old curve's increments (the prior's where
        unknown) on top of the new curve's last value."""
        if built >= c.shape[1] or built <= 0:
            return c
        old = self._raw_curves(s)
        rise = np.maximum(old[:, built:] - old[:, built - 1 : built], 0.0)
        return np.concatenate([c[:, :built], c[:, built - 1 : built] + rise], 1)

    def observe(self, slots, budgets, curves, accepted, chain=None) -> None:
        """After a round: curves [b, B] the round's trees' expected accepted drafts per budget (the
        drafter's own, uncalibrated; columns past the round's built rung are not read), or None
        for a chain round; chain [b] the chain's expected accepted drafts (None: not read back);
        accepted [b] the drafts the target accepted."""
        slots = np.asarray(slots, dtype=np.int64)
        budgets = np.asarray(budgets, dtype=np.int64)
        ran = budgets > 0  # a budget-0 round drafted nothing: no curve, nothing to calibrate
        if not ran.any():
            return
        s, real = slots[ran], np.asarray(accepted, dtype=np.float64)[ran]
        if chain is not None:
            ch = np.asarray(chain, dtype=np.float64)[ran]
        if curves is None:  # a chain round: the chain's own prediction
            predicted = ch
        else:
            c = np.asarray(curves, dtype=np.float64)[ran]
            predicted = np.take_along_axis(c, (budgets[ran] - 1)[:, None], 1)[:, 0]
        # a request's first round starts its EMAs from the server-wide ratio (one round with
        # nothing accepted must not switch its speculation off for good)
        first = ~self.seen[s]
        g = self.g_real / self.g_pred if self.g_pred > 0 else 1.0
        real0 = np.where(first, g * predicted, self.real[s])
        pred0 = np.where(first, predicted, self.pred[s])
        self.real[s] = (1 - EMA) * real0 + EMA * real
        self.pred[s] = (1 - EMA) * pred0 + EMA * predicted
        self.seen[s] = True
        w = PRIOR_EMA if self.g_pred > 0 else 1.0
        self.g_real = (1 - w) * self.g_real + w * float(real.mean())
        self.g_pred = (1 - w) * self.g_pred + w * float(predicted.mean())
        if curves is not None:
            c = self._extend(s, c, self._built(budgets))
            self.curve[s] = c
            self.known[s] = True
            mean = c.mean(0)
            self.prior = (
                mean if self.prior is None else (1 - PRIOR_EMA) * self.prior + PRIOR_EMA * mean
            )
        if chain is not None:
            self.chain[s] = ch
            self.chain_known[s] = True
            m = float(ch.mean())
            pc = self.prior_chain
            self.prior_chain = m if pc is None else (1 - PRIOR_EMA) * pc + PRIOR_EMA * m
