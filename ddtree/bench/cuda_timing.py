"""Timing on the GPU: median over replays of a CUDA graph (launch overhead excluded, inputs as captured)."""

from __future__ import annotations

import torch


def time_graph(fn, calls: int = 1, reps: int = 15) -> float:
    """Median seconds per call of `fn` (which makes `calls` calls), replayed from a CUDA graph after warm-up."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / calls)
    del graph
    return sorted(ts)[len(ts) // 2]


def count_kernels(fn) -> int:
    """CUDA kernels one call of `fn` launches (torch.profiler, after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")
