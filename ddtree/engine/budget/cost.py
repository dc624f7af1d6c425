"""The budget policy's choices and their round costs (pure numpy): `rungs` (AR, the ladder's
trees, the DFLASH chain, by verify width) and `RoundCost`, the seconds a round costs at each rung
for a batch and context: `CostTable` (measured on the device at startup, engine/budget/profile.py)
or `AnalyticCost` (roofline). With CUDA graphs every row of a round is padded to the round's width
W and the batch to its bucket, so a round's cost is a function of (batch bucket, context, rung).
`ServedCost` corrects either by the rounds the server actually ran."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = [
    "AnalyticCost",
    "CostTable",
    "RoundCost",
    "ServedCost",
    "rung_name",
    "rung_widths",
    "rungs",
]

SERVED_EMA = 0.1  # weight of one served round in ServedCost's correction
SERVED_CLIP = (0.5, 2.0)  # one round's served / estimated seconds, clipped (a stalled round)


def rungs(ladder: tuple[int, ...], chain: int = 0) -> tuple[tuple[int, bool], ...]:
    """The policy's choices as (budget, is_chain), by verify width 1 + budget: the ladder's trees
    (budget 0: AR) and, with `chain` > 0, the DFLASH chain of `chain` drafts (before a tree of the
    same width). Every `RoundCost` returns its seconds in this order."""
    out = [(int(b), False) for b in ladder] + ([(int(chain), True)] if chain else [])
    return tuple(sorted(out, key=lambda r: (r[0], not r[1])))


def rung_name(budget: int, chain: bool) -> str:
    """The metrics' name of a rung: ar (budget 0), chain, or tree<budget>."""
    return "chain" if chain else (f"tree{budget}" if budget else "ar")


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


class ServedCost:
    """A `RoundCost` corrected by the rounds the server ran (the profile replays the graphs alone;
    a served round also pays the policy, the read-back, launches and whatever else the device
    waits on). Per batch bucket: per rung an EMA of served over estimated seconds, and over every
    rung an EMA of served minus estimated seconds, the common overhead. A served rung takes its
    own ratio; a rung not served at the bucket takes the profile plus the bucket's overhead (the
    nearest served bucket's where none was served here; never less than the profile). The
    overhead is about the same whatever the rung: an unserved rung at its bare profile would be
    rated too cheap by it, the cheapest rungs most, and each level of `bench at-scale` opens a new bucket
    (tests/test_budget_convergence.py, the short levels). The policy's exploration rounds still
    try the rung above its best and the chain."""

    def __init__(self, base: RoundCost):
        self.base = base
        # bucket -> (ratio [R], served [R], [overhead seconds])
        self._corr: dict[int, tuple[np.ndarray, np.ndarray, list[float]]] = {}

    @property
    def batches(self) -> tuple[int, ...] | None:
        return getattr(self.base, "batches", None)

    def _bucket(self, bs: int) -> int:
        b = self.batches
        if b:
            return min(int(np.searchsorted(b, bs)), len(b) - 1)
        return max(int(bs) - 1, 0).bit_length()  # powers of two

    def overhead(self, bs: int) -> float:
        """Seconds a served round pays over its profile at bs's bucket (the nearest served
        bucket's, the lower on a tie; 0 before any served round; never negative)."""
        if not self._corr:
            return 0.0
        k = self._bucket(bs)
        near = min(self._corr, key=lambda j: (abs(j - k), j))
        return max(self._corr[near][2][0], 0.0)

    def seconds(self, bs: int, ctx: int) -> np.ndarray:
        s = self.base.seconds(bs, ctx)
        if not self._corr:
            return s
        got = self._corr.get(self._bucket(bs))
        unserved = s + self.overhead(bs)
        if got is None:
            return unserved
        ratio, served, _ = got
        return np.where(served, s * ratio, unserved)

    def correction(self, bs: int) -> np.ndarray:
        """[R] served / estimated seconds at bs's bucket per rung (NaN: not served there)."""
        got = self._corr.get(self._bucket(bs))
        if got is None:
            return np.full(len(self.base.seconds(bs, 0)), np.nan)
        return np.where(got[1], got[0], np.nan)

    def served(self, bs: int, rung: int) -> bool:
        """Whether a round of rung index `rung` was served at bs's bucket (its cost measured)."""
        got = self._corr.get(self._bucket(bs))
        return got is not None and bool(got[1][rung])

    def observe(self, bs: int, ctx: int, rung: int, seconds: float) -> None:
        """A served round of batch bs, longest context ctx, at rung index `rung`: its seconds."""
        est = float(self.base.seconds(bs, ctx)[rung])
        if est <= 0 or seconds <= 0:
            return
        k = self._bucket(bs)
        x = float(np.clip(seconds / est, *SERVED_CLIP))
        if k not in self._corr:
            n = len(self.base.seconds(bs, ctx))
            self._corr[k] = (np.ones(n), np.zeros(n, dtype=bool), [(x - 1) * est])
        else:
            off = self._corr[k][2]
            off[0] = (1 - SERVED_EMA) * off[0] + SERVED_EMA * (x - 1) * est
        ratio, served, _ = self._corr[k]
        ratio[rung] = (1 - SERVED_EMA) * ratio[rung] + SERVED_EMA * x if served[rung] else x
        served[rung] = True
