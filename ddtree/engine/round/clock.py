"""The device's side of a decode round: CUDA events at its phase boundaries, so a round's wall time
(host clock) splits into what the GPU spent on it and what it waited for the host.

`device_s`: first op of the round (its metadata copy) to the last op before the read-back, on the
GPU's clock. With CUDA graphs that is the draft and verify replays plus the commit; a host that
launches late (the GIL held by the server's event-loop thread, a slow policy) shows as a longer
span than the same round offline. `idle_s`: the GPU idle between the previous decode round's last
op and this round's first, i.e. the host work between rounds (read-back, emission, scheduling,
publishing, planning) that nothing hid; None after a prefill step (its work sits in between).
`phases`: the span cut where the draft is launched (`plan`: the round's metadata copy, the budget
planner's decision and the draft's inputs, the GPU waiting on the host), at the draft's last op and
at the verify's (device seconds each).

On the CPU (or with DDTREE_ROUND_CLOCK=0) every call is a no-op and the fields stay None. A round
records five events and reads their times after its one blocking read-back (no extra sync).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddtree import envs

PHASES = ("plan", "draft", "verify", "commit")
# the names /metrics' ddtree_round_seconds gives them (server/metrics.py, ddtree/bench/serving_metrics.py)
DEVICE_PARTS = ("device", "idle", *(f"device_{p}" for p in PHASES))


@dataclass
class RoundTiming:
    """Where one decode round's time went: one object, handed along the layers that measure it
    (the decoder's clock: device; the engine: round and host; the server: its loop), read by the
    budget planner (its host-time EMA, served-round costs), the metrics and the batch log."""

    round_s: float = 0.0  # wall time of SpecDecoder.round (launches + the wait for the device)
    host_s: float = 0.0  # the engine step's time outside the round (schedule, emit, stops)
    server_s: float = 0.0  # the server loop's time outside the step (publish, commands, metrics)
    # CUDA only (else None / {}): the GPU's span of the round, its idle time since the previous
    # round's last op, and the span per phase (PHASES)
    device_s: float | None = None
    idle_s: float | None = None
    device_phases: dict[str, float] = field(default_factory=dict)
    # host seconds the round's grammar rows took (trees + masks, engine/round/grammar.py); None
    # when no request in the round had a grammar
    grammar_s: float | None = None


class RoundClock:
    def __init__(self, device: torch.device):
        self.on = torch.device(device).type == "cuda" and envs.ROUND_CLOCK.on()
        self._marks: list[torch.cuda.Event] = []
        self._prev_end: torch.cuda.Event | None = None

    def start(self) -> None:
        """Before the round's first device op."""
        self._marks = []
        self.mark()

    def mark(self) -> None:
        """At a phase boundary (after the phase's last launch; `PHASES` order), and at the end."""
        if self.on:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._marks.append(e)

    def forget(self) -> None:
        """A step that was not a decode round ran: the next round's idle time is not known."""
        self._prev_end = None

    def read(self, timing: RoundTiming) -> None:
        """The device span, idle time and phases of the round just read back into `timing` (its
        events have completed: the read-back waited for everything before it)."""
        marks, prev = self._marks, self._prev_end
        if not self.on or len(marks) < 2:
            return
        self._prev_end = marks[-1]
        timing.device_s = marks[0].elapsed_time(marks[-1]) / 1e3
        timing.idle_s = None if prev is None else max(prev.elapsed_time(marks[0]) / 1e3, 0.0)
        if len(marks) == len(PHASES) + 1:
            timing.device_phases = {
                p: a.elapsed_time(b) / 1e3 for p, a, b in zip(PHASES, marks[:-1], marks[1:])
            }
