"""The budget policy's server-wide curve shape (pure numpy): what a tree's gain curve does past
the rung a round built, and what a request without a tree curve of its own gets.

A tree built at rung R reads its curve back up to R only. Above R the curve is the request's value
at R times the server-wide growth over each ladder segment (`growth[j]` = curve[j] / curve[the
segment's start], a ratio of sums over the rows that read that segment back at full depth): a
ratio, so a request's own scale carries up; and it is never fed back from an extrapolation. (The
earlier per-slot extension carried its old increments forward as if they were data: once the
policy settled below the cap, the tail was never measured again, issue 20's stale curve.) Growth
of a segment not read back yet is optimistic (proportional to the budget), which draws one round
up. A request without a tree curve gets its chain's gain times `head` (the tree curve below the
first rung over the chain's gain): the chain is read back every speculative round, so the
request's tree curve is current even when the server ran no tree round for a while.
"""

from __future__ import annotations

import numpy as np

PRIOR_EMA = 0.05  # server-wide EMAs' weight per request-round: `head` (and the calibration)
GROWTH_EMA = 0.2  # ... the growth past each ladder rung


def ema_weight(w: float, n: int) -> float:
    """An EMA's weight for a round of n request-rounds, each weighing w."""
    return 1.0 - (1.0 - w) ** int(n)


class CurveShape:
    def __init__(self, ladder: np.ndarray, B: int):
        self.rungs = ladder[ladder > 0]
        self.first = int(self.rungs[0]) if len(self.rungs) else B  # every tree reads these
        # anchor[j]: the column of the ladder rung that starts budget j + 1's segment (-1: none)
        self.anchor = np.asarray(
            [
                int(self.rungs[self.rungs <= j].max()) - 1 if j >= self.first else -1
                for j in range(B)
            ]
        )
        self.reset()

    def reset(self) -> None:
        B = len(self.anchor)
        self.head: np.ndarray | None = None  # [first] tree curve over the chain's gain
        j = np.arange(B, dtype=np.float64)
        self.growth = np.where(self.anchor >= 0, (j + 1) / np.maximum(self.anchor + 1.0, 1), 1.0)
        self.growth_read = np.zeros(B, dtype=bool)
        self.cum = self._cumulative()  # [B] growth over the first rung's value (cached)

    def _cumulative(self) -> np.ndarray:
        out = np.ones_like(self.growth)
        for lo, hi in zip(self.rungs[:-1], self.rungs[1:]):
            out[lo:hi] = self.growth[lo:hi] * out[lo - 1]
        return out

    def grow(self, curve: np.ndarray, n: np.ndarray) -> np.ndarray:
        """[b, B]: curve [b, B] read back up to column n [b, 1] (>= 1), grown past it."""
        top = np.maximum(n - 1, 0)
        last = curve[np.arange(len(curve))[:, None], top]  # [b, 1] the last column read
        grown = last * (self.cum[None, :] / self.cum[top])
        return np.where(np.arange(curve.shape[1])[None, :] < n, curve, grown)

    def base(self, chain: np.ndarray) -> np.ndarray | None:
        """[b, B] the tree curves of requests whose chains' gains are chain [b] (None before any
        tree round)."""
        if self.head is None:
            return None
        f = self.first - 1
        shape = np.concatenate([self.head[:f], self.head[f] * self.cum[f:]])
        return chain[:, None] * shape[None, :]

    def learn(self, c: np.ndarray, built: int, chain: np.ndarray | None) -> None:
        """From full-depth rows' curves c [n, B] read back up to `built` and their chains' gains
        [n] (None: not read back): `head` and the growth of every segment read back, each a
        ratio of sums over the rows (a row with a tiny value cannot swing it)."""
        f = self.first
        if chain is not None and chain.sum() > 1e-6:
            head = c[:, :f].sum(0) / chain.sum()
            w = ema_weight(PRIOR_EMA, len(c))
            self.head = head if self.head is None else (1 - w) * self.head + w * head
        if built <= f:
            return
        num, den = c[:, f:built].sum(0), c[:, self.anchor[f:built]].sum(0)
        ok = den > 1e-6
        j, ratio = np.arange(f, built)[ok], num[ok] / den[ok]
        w = np.where(self.growth_read[j], ema_weight(GROWTH_EMA, len(c)), 1.0)
        self.growth[j] = (1 - w) * self.growth[j] + w * ratio
        self.growth_read[j] = True
        self.cum = self._cumulative()
