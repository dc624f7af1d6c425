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

import torch

from ddtree import envs

PHASES = ("plan", "draft", "verify", "commit")
# the names /metrics' ddtree_round_seconds gives them (server/metrics.py, ddtree/bench/serving_metrics.py)
DEVICE_PARTS = ("device", "idle", *(f"device_{p}" for p in PHASES))


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

    def read(self) -> tuple[float | None, float | None, dict[str, float]]:
        """(device_s, idle_s, {phase: device seconds}) of the round just read back (its events
        have completed: the read-back waited for everything before it)."""
        marks, prev = self._marks, self._prev_end
        if not self.on or len(marks) < 2:
            return None, None, {}
        self._prev_end = marks[-1]
        device = marks[0].elapsed_time(marks[-1]) / 1e3
        idle = None if prev is None else max(prev.elapsed_time(marks[0]) / 1e3, 0.0)
        phases = {}
        if len(marks) == len(PHASES) + 1:
            phases = {p: a.elapsed_time(b) / 1e3 for p, a, b in zip(PHASES, marks[:-1], marks[1:])}
        return device, idle, phases
