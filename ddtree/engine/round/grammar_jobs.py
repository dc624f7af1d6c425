"""Grammar mask work off the engine thread, bounded per request (issue 54).

xgrammar's mask fill cannot be interrupted and its cost is not known ahead: a 15-character regex
(`(.{1,50}){1,50}`) compiles in milliseconds, fills its first mask in a fraction of a second and
each later one slower (seconds per fill, at every tree node), and a grammar whose start state is
cheap (`a(.{1,50}){1,50}`) jumps from 0.1 ms to 0.4 s in one token, so no probe or running
estimate can keep such work safely on the engine thread. Every grammar request's mask work of a
step (its tree walk, or its root mask) therefore runs as one job on a worker thread (xgrammar
releases the GIL while it fills), all of a step's jobs at once, and the engine thread waits for
them at most `MaskBudget.round_s`. A request whose job is not done by then, or whose fills have
taken `total_s` in all, fails alone (finish reason abort, a 400 `grammar_too_complex` naming its
field); the job's matcher is cancelled, so its worker stops at its next fill and the thread
returns to the pool. Before that, a slow request degrades: its tree gets as many nodes as its
slowest fill of the previous step allows within `tree_s` (down to the root alone: an AR row),
so a slow grammar costs the batch one fill per step rather than a tree of them.

The pool holds a thread for every request that can run (`max_jobs`) plus `STRAGGLERS` for fills
still running past their deadline; a job that found no thread by the deadline fails its request
with a 503 saying the server is busy (never a false "too complex"). Threads start on demand.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from ddtree.grammar.backend import Matcher

logger = logging.getLogger("ddtree")

# a request's mask work in one step the engine thread waits for; past it the request fails
MASK_ROUND_S = 0.5
# a request's mask work over its whole life; past it the request fails (a grammar this slow holds
# every step of the batch it is in)
MASK_TOTAL_S = 20.0
# the mask work a request's tree is sized to: nodes = tree_s / its slowest fill of the last step
TREE_MASK_S = 0.05
STRAGGLERS = 8  # threads beyond max_jobs, for fills still running after their request gave up


@dataclass
class MaskBudget:
    round_s: float | None = MASK_ROUND_S  # None: wait for every job
    total_s: float = MASK_TOTAL_S
    tree_s: float = TREE_MASK_S

    @classmethod
    def lockstep(cls) -> MaskBudget:
        """No clock in it: under tensor parallelism every rank builds the trees itself
        (engine/tp/rank.py), and a deadline or tree size read off each rank's own clock would
        split them. Their grammars are bounded at compile only (server/structured.py's probe)."""
        return cls(round_s=None, total_s=math.inf, tree_s=math.inf)

    def nodes(self, matcher: Matcher, budget: int) -> int:
        """Drafted nodes a request's tree may have: its slowest fill of the last step times the
        tree's fills (the root's and each node's) within tree_s; budget when none was slow."""
        per = matcher.slowest_fill_s
        if per * (budget + 1) <= self.tree_s:
            return budget
        return max(0, min(budget, int(self.tree_s / per) - 1))


@dataclass(frozen=True)
class MaskFailure:
    """Why a request's mask job gave no result: the request fails with this."""

    message: str
    status: int = 400
    code: str = "grammar_too_complex"


class MaskWorkers:
    """The engine's mask threads (one pool per engine)."""

    def __init__(self, max_jobs: int, budget: MaskBudget | None = None):
        self.budget = budget if budget is not None else MaskBudget()
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_jobs + STRAGGLERS, thread_name_prefix="grammar-mask"
        )
        self.timed_out = 0  # requests failed for a slow grammar (their job ran past round_s)

    def run(self, jobs: dict[int, tuple[Matcher, str, Callable[[], object]]]) -> dict[int, object]:
        """jobs: key -> (the request's matcher, its grammar's field, the work). Runs them at once
        on the pool; returns key -> the work's result, or a MaskFailure. A job that raised
        re-raises here (after every job is settled) as the step's failure."""
        b = self.budget
        out: dict[int, object] = {}
        futs: dict[concurrent.futures.Future, int] = {}
        for key, (m, param, work) in jobs.items():
            if m.fill_s > b.total_s:
                out[key] = MaskFailure(
                    f"{param}: the grammar's next-token masks took {m.fill_s:.1f} s in all, more "
                    f"than the {b.total_s:g} s a request may spend; simplify the grammar"
                )
                continue
            m.slowest_fill_s = 0.0
            futs[self.pool.submit(work)] = key
        done, late = concurrent.futures.wait(futs, timeout=b.round_s)
        for f in late:
            key = futs[f]
            m, param, _ = jobs[key]
            m.cancelled = True
            if f.cancel():  # never started: every thread is held by other requests' fills
                out[key] = MaskFailure(
                    "the server is busy with other requests' grammar work; retry",
                    503,
                    "server_busy",
                )
                continue
            self.timed_out += 1
            logger.warning(
                "request with a slow grammar (%s) failed its %g s step", param, b.round_s
            )
            out[key] = MaskFailure(
                f"{param}: the grammar's next-token mask took over {b.round_s:g} s in one "
                "decoding step (grammar work is bounded per request); simplify the grammar"
            )
        error = None
        for f in done:
            try:
                out[futs[f]] = f.result()
            except Exception as e:  # noqa: BLE001 - raised below, after the others are settled
                error = error or e
        if error is not None:
            raise error
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
