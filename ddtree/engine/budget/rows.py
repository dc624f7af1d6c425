"""The round's cost as a function of the batch and its total verify rows, for a batch-wide budget.

With one verify budget for the batch (speculative/batch_budget.py) a round is: the drafter over
the batch (its cost follows the batch, not the tree), one target forward over the packed rows
(the batch's roots plus the R drafted nodes it kept; graphs pad the rows to a bucket), the KV
read of every request's context, and the round's mixed prefill tokens. `RowCost` holds those
curves as measured on the device (engine/budget/profile.py `measure_rows`: graph replays, or timed
eager forwards) and predicts a round's seconds; `best_rows` picks the total row count of highest
expected tokens per second from the batch's gain curve (the expected accepted drafts of the top R
nodes, which the draft's node probabilities give).

Pure numpy, host side: one call per round on a handful of floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RowCost"]


def _curve(xs: tuple[int, ...], ys: tuple[float, ...], x):
    """Piecewise-linear through the measured points; past the last, the last segment's slope
    (never below the last point); before the first, the first point. x: a number or an array."""
    x = np.asarray(x, dtype=np.float64)
    y = np.interp(x, xs, ys)
    if len(xs) > 1:
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        y = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), y)
    return y


@dataclass(frozen=True)
class RowCost:
    """Seconds of a round's parts, measured at increasing points:

    draft_s[i]: the drafter forward and the tree build at batch `batches[i]`;
    verify_s[i]: a target forward over `rows[i]` flat rows with its accept and commit;
    prefill_s[i]: an extend forward over `prefill[i]` tokens (0 at 0 tokens);
    kv_s_per_token: the KV read of one cached token of one request (the context's share).
    """

    batches: tuple[int, ...]
    draft_s: tuple[float, ...]
    rows: tuple[int, ...]
    verify_s: tuple[float, ...]
    prefill: tuple[int, ...] = (0,)
    prefill_s: tuple[float, ...] = (0.0,)
    kv_s_per_token: float = 0.0

    def __post_init__(self):
        for name, xs, ys in (
            ("batches", self.batches, self.draft_s),
            ("rows", self.rows, self.verify_s),
            ("prefill", self.prefill, self.prefill_s),
        ):
            if not xs or len(xs) != len(ys) or any(b <= a for a, b in zip(xs, xs[1:])):
                raise ValueError(f"RowCost.{name}: increasing points, one time each")

    def draft(self, batch: int) -> float:
        return float(_curve(self.batches, self.draft_s, batch))

    def verify(self, rows: int) -> float:
        return float(_curve(self.rows, self.verify_s, rows))

    def prefill_cost(self, tokens: int) -> float:
        return float(_curve(self.prefill, self.prefill_s, tokens)) if tokens > 0 else 0.0

    def predict(
        self, batch: int, rows: int, ctx: int, prefill_tokens: int = 0, draft: bool = True
    ) -> float:
        """Seconds of a round of `batch` requests verifying `rows` flat rows in all (roots
        included: rows >= batch; pass the padded bucket where graphs pad), whose longest context
        is `ctx` tokens, with `prefill_tokens` prefill tokens in the round. draft=False: a round
        that drafts nothing (every row an AR row)."""
        if batch <= 0:
            return self.prefill_cost(prefill_tokens)
        s = self.verify(max(rows, batch)) + batch * ctx * self.kv_s_per_token
        return s + (self.draft(batch) if draft else 0.0) + self.prefill_cost(prefill_tokens)

    def best_rows(
        self,
        batch: int,
        ctx: int,
        gain: np.ndarray,
        prefill_tokens: int = 0,
        buckets: tuple[int, ...] | None = None,
    ) -> int:
        """The drafted-row budget R (0 .. len(gain) - 1) of most expected tokens per second.
        gain[R]: expected accepted drafts of the batch's R best nodes (gain[0] = 0), so a round
        emits batch + gain[R] tokens. R = 0 is also priced without the drafter (AR). buckets:
        the total row counts graphs run (R rounds up to the next, the rows padded to it)."""
        gain = np.asarray(gain, dtype=np.float64)
        ar = batch / self.predict(batch, batch, ctx, prefill_tokens, draft=False)
        r = np.arange(1, len(gain))
        rows = batch + r
        if buckets:  # within a bucket the rows cost the same: only its largest R can win
            top = np.asarray(buckets)
            at = np.searchsorted(top, rows)
            r, rows = r[at < len(top)], top[at[at < len(top)]]
        if not len(r):
            return 0
        fixed = batch * ctx * self.kv_s_per_token + self.draft(batch)
        secs = _curve(self.rows, self.verify_s, rows) + fixed + self.prefill_cost(prefill_tokens)
        rate = (batch + gain[r]) / secs
        best = int(np.argmax(rate))  # the first of equal rates: the fewest rows
        return int(r[best]) if rate[best] > ar else 0

    def to_json(self) -> dict:
        return {
            "batches": list(self.batches),
            "draft_s": list(self.draft_s),
            "rows": list(self.rows),
            "verify_s": list(self.verify_s),
            "prefill": list(self.prefill),
            "prefill_s": list(self.prefill_s),
            "kv_s_per_token": self.kv_s_per_token,
        }

    @classmethod
    def from_json(cls, d: dict) -> RowCost:
        def ints(k):
            return tuple(int(x) for x in d[k])

        def floats(k):
            return tuple(float(x) for x in d[k])

        return cls(
            ints("batches"),
            floats("draft_s"),
            ints("rows"),
            floats("verify_s"),
            ints("prefill"),
            floats("prefill_s"),
            float(d.get("kv_s_per_token", 0.0)),
        )

    @classmethod
    def from_points(
        cls,
        draft: dict[int, float],
        verify: dict[int, list[float]],
        prefill: dict[int, float],
        kv_s_per_token: float,
    ) -> RowCost:
        """From measured points (verify: row count -> the times of the shapes, batch x width,
        that ran it): each row count costs the least time of any count at or above it (fewer
        rows can always run padded to more, so a faster larger shape bounds them)."""
        rows = sorted(verify)
        least = [min(verify[r]) for r in rows]
        mono = list(np.minimum.accumulate(least[::-1])[::-1])
        pre = {0: 0.0, **prefill}
        return cls(
            tuple(sorted(draft)),
            tuple(draft[b] for b in sorted(draft)),
            tuple(rows),
            tuple(float(x) for x in mono),
            tuple(sorted(pre)),
            tuple(pre[p] for p in sorted(pre)),
            kv_s_per_token,
        )
