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

Cost. With CUDA graphs every row of a round is padded to the round's width W (1 + the largest
budget) and the batch to its bucket, so a round costs `cost.seconds(bs, ctx)[w]` for each ladder
width (`RoundCost`: measured at startup on the device, or `AnalyticCost`). The width is the one
decision: at a given W every request takes min(W - 1, its own cap), since a smaller budget would
save nothing. W = 1 (budget 0) is plain AR: no draft runs.

Decision: argmax over the ladder of (bs + sum_i gain_i(W)) / seconds(W) (the ladder starts at
budget 0); after EXPLORE_AFTER AR rounds in a row one speculative round refreshes the curves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ddtree.engine.config import budget_ladder

__all__ = ["AnalyticCost", "BudgetPolicy", "CostTable", "Decision", "budget_ladder"]

EMA = 0.25  # weight of the newest round in the per-request calibration
# AR rounds draft nothing, so they neither refresh the curves nor the calibration that chose them:
# after this many AR rounds in a row the policy runs one round at its best speculative width
EXPLORE_AFTER = 32
PRIOR_EMA = 0.05  # weight of one request's curve in the server-wide prior for new requests


class RoundCost(Protocol):
    def seconds(self, bs: int, ctx: int) -> np.ndarray:
        """[len(ladder)] seconds per round at each ladder width for a batch of bs requests whose
        longest context is ctx tokens."""


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

    def seconds(self, bs: int, ctx: int) -> np.ndarray:
        w = 1 + np.asarray(self.ladder, dtype=np.float64)
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
    """Measured seconds per round on the device: [batch bucket, context bound, ladder width]. A
    batch or context between two measured points takes the next one up (what the graphs run).
    `kv_s_per_token` adds the context's KV read (bs x ctx tokens) to every width, for tables
    measured at one short context."""

    ladder: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    table: np.ndarray
    kv_s_per_token: float = 0.0

    def seconds(self, bs: int, ctx: int) -> np.ndarray:
        i = min(int(np.searchsorted(self.batches, bs)), len(self.batches) - 1)
        j = min(int(np.searchsorted(self.contexts, ctx)), len(self.contexts) - 1)
        return self.table[i, j] + bs * ctx * self.kv_s_per_token

    def to_json(self) -> dict:
        return {
            "ladder": list(self.ladder),
            "batches": list(self.batches),
            "contexts": list(self.contexts),
            "seconds": self.table.tolist(),
            "kv_s_per_token": self.kv_s_per_token,
        }

    @classmethod
    def from_json(cls, d: dict) -> CostTable:
        t = np.asarray(d["seconds"], dtype=np.float64)
        shape = (len(d["batches"]), len(d["contexts"]), len(d["ladder"]))
        if t.shape != shape:
            raise ValueError(f"cost table of shape {t.shape}, expected {shape}")
        ladder, batches, ctx = tuple(d["ladder"]), tuple(d["batches"]), tuple(d["contexts"])
        return cls(ladder, batches, ctx, t, float(d.get("kv_s_per_token", 0.0)))


@dataclass(frozen=True)
class Decision:
    width: int  # the round's verify width: 1 + max(budgets)
    budgets: np.ndarray  # [b] int per request
    predicted: np.ndarray  # [b] calibrated expected accepted drafts at those budgets
    tokens_per_s: float  # the policy's estimate for the round


class BudgetPolicy:
    """Per-request calibration and curves in rows indexed by the request's block-table slot (reset
    when a new request takes the slot), and the per-round choice."""

    def __init__(self, ladder: tuple[int, ...], cost: RoundCost, slots: int):
        self.ladder, self.cost = np.asarray(ladder, dtype=np.int64), cost
        self.max_budget = int(self.ladder[-1])
        B = max(self.max_budget, 1)
        self.owner: list[object] = [None] * slots
        self.curve = np.zeros((slots, B))  # expected accepted drafts for budget j + 1
        self.known = np.zeros(slots, dtype=bool)
        self.real = np.zeros(slots)  # EMA of realised accepted drafts
        self.pred = np.zeros(slots)  # EMA of the drafter's prediction for the same rounds
        self.prior: np.ndarray | None = None  # server-wide curve for requests not yet seen
        self.ar_streak = 0  # AR rounds chosen in a row
        self.g_real = self.g_pred = 0.0  # server-wide EMAs: the calibration of new requests

    def _claim(self, slots: np.ndarray, owners: list[object]) -> None:
        for s, o in zip(slots.tolist(), owners):
            if self.owner[s] is not o:
                self.owner[s] = o
                self.known[s] = False
                self.real[s] = self.pred[s] = 0.0

    def gains(self, slots: np.ndarray) -> np.ndarray:
        """[b, B + 1] calibrated expected accepted drafts for budgets 0..B."""
        b, B = len(slots), self.curve.shape[1]
        curve = self.curve[slots]
        if self.prior is not None:
            curve = np.where(self.known[slots, None], curve, self.prior[None, :])
        else:  # nothing seen yet: assume every node is accepted (explore the largest width)
            unseen = np.arange(1, B + 1, dtype=np.float64)[None, :]
            curve = np.where(self.known[slots, None], curve, unseen)
        g = self.g_real / self.g_pred if self.g_pred > 0 else 1.0
        ratio = np.where(
            self.pred[slots] > 0, self.real[slots] / np.maximum(self.pred[slots], 1e-9), g
        )
        return np.concatenate([np.zeros((b, 1)), curve * ratio[:, None]], 1)

    def choose(self, slots, owners: list[object], caps, ctx: int, extra_s: float = 0.0) -> Decision:
        """slots [b] block-table rows, owners [b] the request objects (identity marks a new
        request in a slot), caps [b] each request's largest allowed budget, ctx the longest
        context, extra_s the round's host time outside the device work (every width pays it, so
        it favours the widths that emit more). Vectorised over requests and ladder rungs."""
        slots, caps = np.asarray(slots, dtype=np.int64), np.asarray(caps, dtype=np.int64)
        self._claim(slots, owners)
        g = self.gains(slots)
        # [b, L]: request i's budget at rung l, and its gain there
        per = np.minimum(self.ladder[None, :], caps[:, None])
        gain = np.take_along_axis(g, per, 1)
        tokens = len(slots) + gain.sum(0)
        rate = tokens / (self.cost.seconds(len(slots), ctx) + extra_s)
        best = int(np.argmax(rate))
        self.ar_streak = self.ar_streak + 1 if best == 0 else 0
        if best == 0 and self.ar_streak > EXPLORE_AFTER and len(rate) > 1:
            best, self.ar_streak = 1 + int(np.argmax(rate[1:])), 0
        budgets = per[:, best]
        return Decision(1 + int(budgets.max(initial=0)), budgets, gain[:, best], float(rate[best]))

    def observe(self, slots, budgets, curves: np.ndarray, accepted) -> None:
        """After a round: curves [b, B] the round's trees' expected accepted drafts per budget (the
        drafter's own, uncalibrated), accepted [b] the drafts the target accepted."""
        slots = np.asarray(slots, dtype=np.int64)
        budgets = np.asarray(budgets, dtype=np.int64)
        ran = budgets > 0  # a budget-0 round drafted nothing: no curve, nothing to calibrate
        if not ran.any():
            return
        s, c = slots[ran], np.asarray(curves, dtype=np.float64)[ran]
        predicted = np.take_along_axis(c, (budgets[ran] - 1)[:, None], 1)[:, 0]
        real = np.asarray(accepted, dtype=np.float64)[ran]
        # a request's first round starts its EMAs from the server-wide ratio (one round with
        # nothing accepted must not switch its speculation off for good)
        first = ~self.known[s]
        g = self.g_real / self.g_pred if self.g_pred > 0 else 1.0
        real0 = np.where(first, g * predicted, self.real[s])
        pred0 = np.where(first, predicted, self.pred[s])
        self.real[s] = (1 - EMA) * real0 + EMA * real
        self.pred[s] = (1 - EMA) * pred0 + EMA * predicted
        w = PRIOR_EMA if self.g_pred > 0 else 1.0
        self.g_real = (1 - w) * self.g_real + w * float(real.mean())
        self.g_pred = (1 - w) * self.g_pred + w * float(predicted.mean())
        self.curve[s] = c
        self.known[s] = True
        mean = c.mean(0)
        self.prior = mean if self.prior is None else (1 - PRIOR_EMA) * self.prior + PRIOR_EMA * mean
