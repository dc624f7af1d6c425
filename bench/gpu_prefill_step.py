"""H200 timing only: where a cached multi-turn request's prefill step goes (issue 22's TTFT),
eager vs the graphed short extend (engine/extend_graph.py) in one run.

One engine (default: the embedded pair inflated to the Qwen3-8B shape in memory, DDTREE B=16, CUDA
graphs, the start-up warm-up run first), a --prefix-token system prompt of held-out text cached,
then per --new count of new tokens and per mode (eager: the extend graphs off, `ExtendGraphs.eager`;
graph: the replays, in as many passes as `plan_passes` cuts) --repeats requests of prefix + that
many other tokens (max_tokens 1: each ends at its first token, in the prefill step; every request's
new tokens are its own, so none hits the cache past the prefix). Per request: the step's wall time,
the runner's prefill with the host's launch time (its return, before a sync) and the device time
(CUDA events around it), and the rest of the step (sampling, the read-back, emission). A prefill
whose host time is close to its wall time is launch-bound, not compute-bound.

    python3 bench/gpu_prefill_step.py [--model-path inflate:qwen3-8b] [--new 16,64,190,512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import torch

    from ddtree import LLM, SamplingParams
    from ddtree.bench.multiturn import heldout_tokens
    from ddtree.engine.warmup import warm_up

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="inflate:qwen3-8b", help="'embedded': the small pair")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the logic (no device time)")
    p.add_argument("--algorithm", default="DDTREE", choices=("NONE", "DFLASH", "DDTREE"))
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--prefix", type=int, default=2048, help="cached system-prompt tokens")
    p.add_argument("--new", default="16,64,190,512", help="new tokens per request, comma list")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default=None, help="JSON rows")
    ns = p.parse_args()
    kw = {"device": ns.device, "speculative_algorithm": ns.algorithm}
    if ns.algorithm == "DDTREE":
        kw["speculative_ddtree_budget"] = ns.budget
    cuda = ns.device == "cuda"
    engine = LLM(None if ns.model_path == "embedded" else ns.model_path, **kw).engine
    if not cuda:  # the dry run: the graph path's logic uncaptured (CudaGraphRunner capture=False)
        from ddtree.engine.config import EXTEND_WIDTHS
        from ddtree.engine.cuda_graph import attach_uncaptured

        attach_uncaptured(engine, extend_widths=EXTEND_WIDTHS)
    warm = warm_up(engine, progress=False)
    print(f"warm-up {warm['seconds']:.1f} s (graphed extends at batch {warm['extend_batches']})")
    vocab = engine.runner.target.config.vocab_size
    text = [t % vocab for t in heldout_tokens(None)]
    system = text[: ns.prefix]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def drain(req) -> None:
        while not req.is_finished:
            engine.step()

    drain(engine.add_request(system, one))  # the prefix is cached from here on
    runner, real, rec = engine.runner, engine.runner.prefill, {}

    def timed(reqs, q_lens):
        if not cuda:
            t0 = time.perf_counter()
            out = real(reqs, q_lens)
            wall = time.perf_counter() - t0
            rec.update(host=wall, wall=wall, device=wall)
            return out
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        out = real(reqs, q_lens)
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        rec.update(
            host=t1 - t0, wall=time.perf_counter() - t0, device=start.elapsed_time(end) / 1e3
        )
        return out

    runner.prefill = timed
    ext = runner.graphs.extend if runner.graphs is not None else None
    if ext is not None:
        print(
            f"extend graphs: widths {ext.widths}, batch sizes {ext.buckets}, "
            f"{sum(len(gs.graphs) for gs in ext.sets.values())} graphs, "
            f"captured in {ext.build_seconds:.1f} s",
            flush=True,
        )
    modes = ["eager"] + (["graph"] if ext is not None else [])
    rows = []
    for n in (int(x) for x in ns.new.split(",") if x.strip()):
        for m, mode in enumerate(modes):
            rows.append(measure(engine, ext, mode, n, m, ns, system, text, one, rec, drain))
    if ns.output:
        with open(ns.output, "w", encoding="utf-8") as f:
            json.dump({"meta": vars(ns), "rows": rows}, f, indent=2)
    return 0


def measure(engine, ext, mode, n, m, ns, system, text, one, rec, drain) -> dict:
    """--repeats requests of n new tokens in `mode`; prints and returns the medians' row."""
    import contextlib

    passes = ext.plan([n]) if ext is not None and mode == "graph" else None
    steps = []
    with ext.eager() if ext is not None and mode == "eager" else contextlib.nullcontext():
        for k in range(ns.repeats):
            off = ns.prefix + 997 * (k + 1) + 331 * m + n
            req = engine.add_request(system + text[off : off + n], one)
            # a hybrid target with the cache may prefill in two steps (a chunk ending on the last page
            # boundary, for a state checkpoint, then the tail): time every step up to the first token
            t0, tot, n_steps = time.perf_counter(), [0.0, 0.0, 0.0], 0
            while not req.output_ids and n_steps < 8:
                rec.clear()
                engine.step()
                n_steps += 1
                tot = [a + rec.get(k, 0.0) for a, k in zip(tot, ("host", "wall", "device"))]
            step_s = time.perf_counter() - t0
            assert req.output_ids, "the first token within 8 prefill steps"
            steps.append((step_s, *tot, req.cached_tokens, n_steps))
            drain(req)
    med = [statistics.median(s[i] for s in steps) * 1e3 for i in range(4)]
    row = dict(
        mode=mode,
        passes=[w for w, _ in passes] if passes else None,
        new_tokens=n,
        cached_tokens=steps[-1][4],
        steps=max(s[5] for s in steps),
        step_ms=med[0],
        prefill_host_ms=med[1],
        prefill_wall_ms=med[2],
        prefill_device_ms=med[3],
        rest_of_step_ms=med[0] - med[2],
    )
    how = f"graph {row['passes']}" if passes else ("eager" if mode == "eager" else "eager*")
    print(
        f"new {n:>5} (cached {row['cached_tokens']}) {how:>14}: {row['steps']} step(s) "
        f"{med[0]:.2f} ms = prefill "
        f"{med[2]:.2f} (host launch {med[1]:.2f}, device {med[3]:.2f}) + rest "
        f"{med[0] - med[2]:.2f}",
        flush=True,
    )
    return row


if __name__ == "__main__":
    raise SystemExit(main())
