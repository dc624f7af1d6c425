"""Fault isolation: a failure while serving one request fails that request alone.

Two kinds of failure reach the engine:
- **A request's own host work** (emitting, detokenising, stop checks, log-probs, its release)
  raises: that request is failed and freed; the batch's other requests go on.
- **A batched step** (a prefill or a decoding round: kernels, sampling, commit) raises: the
  culprit is unknown and the batch may hold half-written KV or recurrent state. Every request of
  the batch is rolled back to its tokens (preempted: its state is recomputed from the tokens it has
  emitted, which is always consistent) and marked a *suspect*. The scheduler runs a suspect alone,
  one at a time; a step that fails with one request in it names the culprit, which is failed, and a
  suspect that completes a step alone is cleared. Innocent requests pay one recompute.

What cannot be isolated makes the engine *dead* (`EngineDead`; the server's /health turns 503 and
every in-flight request ends with a 503): a device error that poisons the context (CUDA errors),
pools whose integrity check fails after a failure, failures that keep coming with no request to
blame, and any failure under tensor parallelism (the ranks would have to agree on the recovery).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("ddtree")

# failed steps in a row, with no step succeeding in between, before the engine gives up: isolation
# converges in at most one failure per suspect, so a longer run means the fault is not a request's
MAX_FAILURES_IN_A_ROW = 16


class EngineDead(RuntimeError):
    """The engine cannot go on serving; the message says why and which request was running."""


class PoolCorrupted(AssertionError):
    """A pool invariant is broken (e.g. a KV write about to reach a shared cached page): the
    engine's bookkeeping is wrong, which no rollback of requests repairs."""


@dataclass
class FaultStats:
    isolated: int = 0  # requests failed alone (their own failure, or named by isolation)
    batch_failures: int = 0  # batched steps that raised (each rolled back and isolated)
    rolled_back: int = 0  # requests preempted by a batch failure
    integrity_checks: int = 0
    integrity_failures: int = 0
    last_integrity_ok: bool = True


def is_device_fatal(exc: BaseException) -> bool:
    """A device error after which no kernel can be trusted (a CUDA error is sticky: every later
    call on the context fails too)."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(exc, accel):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "CUDA error" in text or "device-side assert" in text or "illegal memory access" in text
    )


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class FaultIsolation:
    """The engine's bookkeeping of failures: stats, the failure streak, the dead reason."""

    def __init__(self, tensor_parallel: bool = False):
        self.tensor_parallel = tensor_parallel
        # re-raise every failure instead of isolating it: for checks that instrument a step
        # (tests comparing graphs with eager builds) and for debugging
        self.raise_errors = False
        self.stats = FaultStats()
        self.streak = 0
        self.dead: str | None = None

    def succeeded(self) -> None:
        self.streak = 0

    def failed(self, exc: BaseException, rids: list[str]) -> None:
        """A step failed with the requests `rids` in it; raises EngineDead if it cannot be
        isolated."""
        self.streak += 1
        if self.raise_errors:
            raise exc
        who = ", ".join(rids[:4]) + (" ..." if len(rids) > 4 else "") if rids else "no request"
        if self.tensor_parallel:
            self.die(f"a tensor-parallel step failed ({who}): {describe(exc)}")
        if is_device_fatal(exc):
            self.die(f"a device error ({who}): {describe(exc)}")
        if isinstance(exc, PoolCorrupted):
            self.die(f"a pool invariant broke ({who}): {describe(exc)}")
        if self.streak > MAX_FAILURES_IN_A_ROW:
            self.die(f"{self.streak} steps in a row failed, the last with {who}: {describe(exc)}")

    def checked(self, ok: bool, problem: str = "") -> None:
        self.stats.integrity_checks += 1
        self.stats.last_integrity_ok = ok
        if not ok:
            self.stats.integrity_failures += 1
            self.die(f"pool integrity failed after a failure: {problem}")

    def die(self, reason: str) -> None:
        if self.dead is None:  # logged once, with the request that caused it
            self.dead = reason
            logger.error("the engine cannot go on: %s", reason)
        raise EngineDead(self.dead)
