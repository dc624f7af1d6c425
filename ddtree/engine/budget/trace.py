"""`DDTREE_POLICY_TRACE=<file>`: one JSON line per auto round with what the budget policy saw when
it chose (per rung: expected tokens, seconds, tokens / s, calibration factor) and what the round
before it realised (its rung, accepted drafts, wall and device seconds). A diagnostic for the
policy's decisions in a running server (`studies/policy_trace.py` summarises a file); off by
default, and it costs a second rating of every rung per round when on."""

from __future__ import annotations

import json

import numpy as np

from ddtree import envs


class PolicyTrace:
    def __init__(self, path: str | None = None):
        # stripped as `config.resolve._check_policy_trace` reads it (blank: no trace)
        path = envs.POLICY_TRACE.get().strip() if path is None else path
        # line-buffered: a server stopped by a signal keeps every round it wrote
        self._f = open(path, "a", encoding="utf-8", buffering=1) if path else None  # noqa: SIM115

    @property
    def on(self) -> bool:
        return self._f is not None

    def write(self, policy, decision, slots, caps, ctx: int, extra_s: float, last) -> None:
        """One line: the decision and every rung's rating now (`policy._rates`, the same numbers
        `choose` compares), and `last`, the round before (a `RoundRecord` or None)."""
        if self._f is None:
            return
        slots, caps = np.asarray(slots, dtype=np.int64), np.asarray(caps, dtype=np.int64)
        _, gain, rate = policy._rates(slots, caps, ctx, extra_s)
        names = list(policy.rung_names)
        cost = policy.cost
        row = {
            "bs": len(slots),
            "ctx": int(ctx),
            "rung": names[decision.rung] if decision.rung >= 0 else None,
            "explore": bool(decision.explore),
            "rungs": names,
            "tokens": np.round(len(slots) + gain.sum(0), 3).tolist(),
            "ms": np.round(cost.seconds(len(slots), ctx) * 1e3, 3).tolist(),
            "profile_ms": np.round(
                getattr(cost, "base", cost).seconds(len(slots), ctx) * 1e3, 3
            ).tolist(),
            "rate": np.round(np.where(np.isfinite(rate), rate, -1.0), 1).tolist(),
            "factors": np.round(policy.rung_factors(), 4).tolist(),
            "prior_chain": policy.prior_chain,
            "ease": float(np.round(policy._ratio(slots).mean(), 4)),
            "host_ms": round(extra_s * 1e3, 3),
        }
        if last is not None:
            row["last"] = {
                "rung": last.rung,
                "bs": len(last.accepted),
                "accepted": float(np.mean(last.accepted)) if last.accepted else 0.0,
                "predicted": float(np.mean(last.predicted)) if last.predicted else None,
                "round_ms": round(last.timing.round_s * 1e3, 3),
                "device_ms": None
                if last.timing.device_s is None
                else round(last.timing.device_s * 1e3, 3),
            }
        self._f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
