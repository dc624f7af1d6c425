"""CPU trace of issue 22's no-sharing workload, cache on vs off: the engine offline (the embedded
pair, DDTREE B=16, fp32), --concurrency requests at once in a closed loop (the next added when one
finishes), distinct held-out prompts of --system-tokens + 64 tokens; a --fill phase of other
distinct prompts first, so with the cache on the pool (--pages) is full of cached pages and every
allocation evicts. Prints the step plan (the engine's `StepStats`, as `bench prefix-cache`
reports it), host milliseconds per request in the scheduler's and the block manager's calls, the
garbage collector's pauses, and the page runs of each prefilled request's block-table row.

    PYTHONPATH=. python3 scripts/trace_nosharing.py --cache on  [--prompts 16 --fill 16]
    PYTHONPATH=. python3 scripts/trace_nosharing.py --cache off
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import random
import time


def main() -> None:
    import torch

    from ddtree import LLM, SamplingParams
    from ddtree.bench.multiturn import heldout_tokens
    from ddtree.engine.step_stats import summarize

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", choices=("on", "off"), required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--fill", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--pages", type=int, default=1600, help="KV pages of 16 tokens")
    ns = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM(
        None,
        speculative_algorithm="DDTREE",
        speculative_ddtree_budget=16,
        device="cpu",
        dtype="float32",
        disable_radix_cache=ns.cache == "off",
        max_total_tokens=ns.pages * 16,
        max_running_requests=ns.concurrency,
    )
    eng = llm.engine
    runner, bm = eng.runner, eng.runner.bm
    text = heldout_tokens(None)
    n = ns.system_tokens + 64

    def prompts(k: int, seed: int) -> list[list[int]]:
        return [text[o : o + n] for o in random.Random(seed).sample(range(len(text) - n), k)]

    host, calls, on = collections.Counter(), collections.Counter(), [False]

    def timed(obj, name: str) -> None:
        f = getattr(obj, name)

        @functools.wraps(f)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                if on[0]:
                    host[name] += time.perf_counter() - t0
                    calls[name] += 1

        setattr(obj, name, wrapper)

    for obj, names in (
        (runner, ("match_prefix", "admit", "_cache_prefilled")),
        (bm, ("can_admit", "_evict_for", "_grow", "free")),
        (eng.scheduler, ("schedule",)),
    ):
        for name in names:
            timed(obj, name)
    pauses = []
    gc.callbacks.append(
        lambda phase, info: pauses.append((phase, time.perf_counter())) if on[0] else None
    )
    runs, prefill = [], runner.prefill

    def traced(reqs, q_lens):
        out = prefill(reqs, q_lens)
        for r in reqs:
            pages = bm.pages[r.slot]
            runs.append(1 + sum(1 for a, b in zip(pages, pages[1:]) if b != a + 1))
        return out

    runner.prefill = traced
    params = SamplingParams(temperature=0, max_tokens=ns.max_tokens, ignore_eos=True)

    def closed_loop(ps: list[list[int]]) -> None:
        queue, live = collections.deque(ps), set()
        while queue or live:
            while queue and len(live) < ns.concurrency:
                live.add(eng.add_request(queue.popleft(), params).rid)
            for r in eng.step():
                if r.is_finished:
                    live.discard(r.rid)

    closed_loop(prompts(ns.fill, 1))
    before, runs[:] = runner.step_stats.as_dict(), []
    on[0] = True
    closed_loop(prompts(ns.prompts, 2))
    after = runner.step_stats.as_dict()
    gc_s = sum(b[1] - a[1] for a, b in zip(pauses[::2], pauses[1::2]))
    steps = summarize({k: after[k] - before[k] for k in after})
    print(f"cache {ns.cache}: {bm.num_pages} pages, evicted", end=" ")
    print(bm.cache.stats.evicted_pages if bm.cache else 0, f"; gc {1e3 * gc_s:.2f} ms")
    print("step plan:", json.dumps({k: v if v is None else round(v, 3) for k, v in steps.items()}))
    for name in sorted(host):
        per = 1e3 * host[name] / ns.prompts
        print(f"  {name:<18} {per:8.3f} ms per request ({calls[name]} calls)")
    print(f"  page runs per prefilled row: mean {sum(runs) / len(runs):.1f}, max {max(runs)}")


if __name__ == "__main__":
    main()
