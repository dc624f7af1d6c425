"""The server's Python garbage collector: freeze the start-up heap, and watch the pauses.

A full (generation 2) collection walks every tracked object. After start-up that is mostly what
start-up made: modules, the tokenizer's vocabulary, the model's Python objects, the CUDA graphs'
wrappers (hundreds of thousands of objects: a full collection then takes longer than a decode round,
and nothing after `gc.freeze()`; `studies/gc_pause.py`, docs/design-numbers.md). Serving allocates request,
JSON and asyncio objects; now and then that triggers a full collection, which stops both threads,
the engine loop's and the HTTP loop's, for that long. `freeze_startup_heap` (after the warm-up, as
vLLM's warm-up ends in `freeze_gc_heap`; SGLang has `freeze_gc`) moves the start-up heap to the
permanent generation, so collections walk only what serving allocated since; `DDTREE_GC_FREEZE=0`
keeps the plain heap (the A/B). `GcWatch` times every collection (`gc.callbacks`) into `/metrics`
(`ddtree_gc_pause_seconds{generation}`) and logs a warning for one over GC_WARN_S.
"""

from __future__ import annotations

import gc
import logging
import time

from ddtree import envs
from ddtree.models.configs import ConfigError

logger = logging.getLogger("ddtree")

GC_WARN_S = 0.05  # a collection this long is logged: longer than a decode round at the 8B shape


def gc_freeze_on() -> bool:
    """DDTREE_GC_FREEZE, checked before the weights load (ConfigError names it)."""
    try:
        return envs.GC_FREEZE.binary()
    except ValueError as e:
        raise ConfigError([f"{e} (1: freeze the start-up heap after the warm-up, 0: not)"]) from e


def freeze_startup_heap() -> int:
    """Collect, then freeze everything alive: the objects frozen."""
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    logger.info(
        "Froze the start-up heap: %d objects (%.0f ms).", n, (time.perf_counter() - t) * 1e3
    )
    return n


class GcWatch:
    """Times every collection, whichever thread it stops. The callback only records (a list
    append): it takes no lock a collection could have interrupted (the metrics' are taken by the
    engine thread, which `drain`s the pauses after each step, as it writes every metric)."""

    def __init__(self, warn_s: float = GC_WARN_S):
        self.warn_s = warn_s
        self._t0 = 0.0
        self._pending: list[tuple[int, float]] = []

    def drain(self) -> list[tuple[int, float]]:
        """The (generation, seconds) of the collections since the last drain."""
        out, self._pending = self._pending, []
        return out

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        s, g = time.perf_counter() - self._t0, int(info.get("generation", 2))
        self._pending.append((g, s))
        if s >= self.warn_s:  # logging's handler locks are reentrant
            logger.warning(
                "GC pause: generation %d collection took %.0f ms (%d collected)",
                g,
                s * 1e3,
                info.get("collected", 0),
            )

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
