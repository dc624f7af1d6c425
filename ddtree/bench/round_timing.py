"""Clocks for the round benchmark: CUDA events on the GPU (the host clock on the CPU), a phase timer that plugs
into `BenchDecoder(times=...)`, and the device-to-device copy bandwidth the memory floor is divided by."""

from __future__ import annotations

import statistics
import time

import torch


class Clock:
    """`mark()` drops a timestamp into the device stream (a CUDA event) or reads the host clock on the CPU;
    `ms(a, b)` is valid once the work up to `b` has finished."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class PhaseMarks:
    """SpecDecoder phase timer (`start()` / `add(name, t0)`) that records marks and resolves them per round;
    on the GPU a phase is the device time between its neighbours' events, launch gaps included."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.marks: list[tuple[str, object, object]] = []

    def start(self):
        return self.clock.mark()

    def add(self, name: str, t0):
        t1 = self.clock.mark()
        self.marks.append((name, t0, t1))
        return t1

    def take(self) -> dict[str, float]:
        """ms per phase of the marks so far (call after the round's device->host copy), then forget them."""
        out: dict[str, float] = {}
        for name, t0, t1 in self.marks:
            out[name] = out.get(name, 0.0) + self.clock.ms(t0, t1)
        self.marks.clear()
        return out


def percentile(xs: list[float], q: float) -> float:
    """The sorted sample at rank floor(q * n) (clamped): the p10 / p90 of a round benchmark."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def copy_bandwidth(device, nbytes: int = 2 << 30, reps: int = 10) -> dict:
    """Median device-to-device copy bandwidth, counted as read + write: 2 * nbytes / t (the convention of the
    field notes' H200 figure, 4.12-4.15 TB/s, and of its 3.95 ms floor)."""
    clock = Clock(device)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    clock.sync()
    ts = []
    for _ in range(reps):
        a = clock.mark()
        dst.copy_(src)
        b = clock.mark()
        clock.sync()
        ts.append(clock.ms(a, b) / 1e3)
    t = statistics.median(ts)
    del src, dst
    return {
        "copy_bytes": nbytes,
        "reps": reps,
        "copy_ms": t * 1e3,
        "bandwidth_Bps": 2 * nbytes / t,
        "convention": "bandwidth = 2 * copied bytes / median copy time (read + write)",
    }
