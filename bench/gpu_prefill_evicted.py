"""H200 timing only: does a request cost more when its KV pages come from evicted cached pages
than from a fresh free list (issue 22's no-sharing gap: cache on 729 vs off 776 output tok/s, the
prefill phase p50 82.5 vs 69.7 ms, on a workload whose prompts share nothing)?

One engine (default: the embedded pair inflated to the Qwen3-8B shape in memory, DDTREE B=16, CUDA
graphs, the warm-up run first). Per layout, --repeats distinct prompts of --prompt tokens
(default 2112, the bench's distinct prompt: a 2048-token chunk, eager, then a 64-token tail, a
graphed extend), max_tokens 1, each prefill step timed (host launch, device by CUDA events, wall),
then --batch requests decoding together for --decode-tokens tokens (the round's wall time):

    off       the prefix cache detached (`bm.cache = None`): the --disable-radix-cache engine
    fresh     the cache on, nothing cached: pages from the free list as at start
    evicted   the pool first filled with unreferenced cached pages (synthetic, no forward), so
              every allocation evicts; evicted pages handed out ascending (this branch)
    reversed  the same, evicted pages as main handed them out (a chain's pages leaf first)
    shuffled  the same, evicted pages in random order (the most scattered layout)

If the evicted layouts' steps cost what off / fresh cost, the gap is not the pages' layout on the
device (then `bench prefix-cache`'s per-step counters place it: graphed share, batches). ~1-2
minutes of device time with the warm-up.

    python3 bench/gpu_prefill_evicted.py [--repeats 6] [--output rows.json]
    python3 bench/gpu_prefill_evicted.py --device cpu --model-path embedded --prompt 300  # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = ("off", "fresh", "evicted", "reversed", "shuffled")


def main() -> int:
    import torch

    from ddtree import LLM, SamplingParams
    from ddtree.bench.multiturn import heldout_tokens
    from ddtree.engine.warmup import warm_up

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="inflate:qwen3-8b", help="'embedded': the small pair")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the logic (no device time)")
    p.add_argument("--budget", type=int, default=16, help="DDTREE budget")
    p.add_argument("--prompt", type=int, default=2112, help="tokens per prompt")
    p.add_argument("--repeats", type=int, default=6, help="prompts prefilled per layout")
    p.add_argument("--batch", type=int, default=8, help="requests decoding together per layout")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--output", default=None, help="JSON rows")
    ns = p.parse_args()
    cuda = ns.device == "cuda"
    kw = dict(device=ns.device, speculative_algorithm="DDTREE", speculative_ddtree_budget=ns.budget)
    engine = LLM(None if ns.model_path == "embedded" else ns.model_path, **kw).engine
    if not cuda:  # the dry run: the graph path's logic uncaptured (CudaGraphRunner capture=False)
        from ddtree.engine.config import EXTEND_WIDTHS
        from ddtree.engine.cuda_graph import attach_uncaptured

        attach_uncaptured(engine, extend_widths=EXTEND_WIDTHS)
    warm = warm_up(engine, progress=False)
    print(f"warm-up {warm['seconds']:.1f} s", flush=True)
    runner, bm = engine.runner, engine.runner.bm
    print(f"pool: {bm.num_pages} pages of {bm.page_size}; prompt {ns.prompt} tokens", flush=True)
    vocab = runner.target.config.vocab_size
    text = [t % vocab for t in heldout_tokens(None)]
    rng = random.Random(0)
    starts = iter(rng.sample(range(len(text) - ns.prompt), 16 * (ns.repeats + ns.batch)))
    real, rec = runner.prefill, []

    def timed(reqs, q_lens):
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
        before = runner.step_stats.graphed_steps
        t0 = time.perf_counter()
        if ev:
            ev[0].record()
        out = real(reqs, q_lens)
        if ev:
            ev[1].record()
        t1 = time.perf_counter()
        sync()
        wall = time.perf_counter() - t0
        device = ev[0].elapsed_time(ev[1]) / 1e3 if ev else wall
        graphed = runner.step_stats.graphed_steps - before
        rec.append(dict(q=sum(q_lens), host=t1 - t0, wall=wall, device=device, graphed=graphed))
        return out

    runner.prefill = timed
    cache = bm.cache
    rows = []
    for layout in ns.layouts.split(","):
        bm.cache = None if layout == "off" else cache
        if bm.cache is not None:
            set_eviction_order(bm, layout, rng)
            if layout in ("evicted", "reversed", "shuffled"):
                fill_with_cached_pages(bm, SamplingParams(max_tokens=1))
        rows.append(measure(engine, layout, ns, text, starts, rec))
        if bm.cache is not None:
            bm.clear_cache()
    bm.cache = cache
    bm.check_integrity()
    if ns.output:
        with open(ns.output, "w", encoding="utf-8") as f:
            json.dump({"meta": vars(ns), "rows": rows}, f, indent=2)
    return 0


def set_eviction_order(bm, layout: str, rng: random.Random) -> None:
    """The order evicted pages join the free list: ascending (this branch), as evicted (main's
    leaf-first), or shuffled."""

    def order(pages: list[int]) -> list[int]:
        if layout == "reversed":
            return pages
        if layout == "shuffled":
            return rng.sample(pages, len(pages))
        return sorted(pages)

    def reclaim(n: int) -> None:  # BlockManager._reclaim with the layout's order
        bm.free_pages.extend(order(bm.cache.evict(n, bm.drop_checkpoint)))

    bm._reclaim = reclaim


def fill_with_cached_pages(bm, params) -> None:
    """Every free page into the cache, unreferenced, under token ids no prompt has (no forward:
    the KV is whatever the pages held; no request ever reads it)."""
    from ddtree.engine.request import Req

    base = 10**9
    while bm.num_free_pages:
        n = min(bm.num_free_pages, bm.max_pages_per_req - 1) * bm.page_size
        ids = list(range(base, base + n))
        base += n
        r = Req(prompt_ids=ids, params=params)
        bm.allocate(r, n)
        bm.free(r, ids, n)


def measure(engine, layout, ns, text, starts, rec) -> dict:
    from ddtree import SamplingParams

    bm, one = engine.runner.bm, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    steps = []
    for _ in range(ns.repeats):
        o = next(starts)
        req = engine.add_request(text[o : o + ns.prompt], one)
        rec.clear()
        t0 = time.perf_counter()
        while not req.is_finished:
            engine.step()
        wall = time.perf_counter() - t0
        steps.append([dict(s) for s in rec] + [dict(request=wall)])
    # decode: --batch requests together, rounds timed by the engine
    dec = SamplingParams(temperature=0, max_tokens=ns.decode_tokens, ignore_eos=True)
    reqs = []
    for _ in range(ns.batch):
        o = next(starts)
        reqs.append(engine.add_request(text[o : o + ns.prompt], dec))
    rounds, scattered = [], []
    while any(not r.is_finished for r in reqs):
        if not scattered and all(r.slot >= 0 and r.output_ids for r in reqs):
            # page runs of the batch's block-table rows once all are prefilled
            scattered = [page_runs(bm.pages[r.slot]) for r in reqs]
        engine.step()
        last = engine.last_round
        if last is not None and len(last.budgets) == ns.batch:
            rounds.append(last.round_s)
    n_steps = max(len(s) - 1 for s in steps)
    med = {}
    for i in range(n_steps):
        got = [s[i] for s in steps if len(s) - 1 > i]
        for key in ("q", "host", "wall", "device", "graphed"):
            med[f"step{i}_{key}"] = statistics.median(g[key] for g in got)
    med["request_s"] = statistics.median(s[-1]["request"] for s in steps)
    med["decode_round_s"] = statistics.median(rounds) if rounds else None
    med["page_runs"] = statistics.mean(scattered) if scattered else None
    row = dict(layout=layout, evicted=bm.cache.stats.evicted_pages if bm.cache else 0, **med)
    parts = [
        f"step {i} ({med[f'step{i}_q']:.0f} tok): wall {1e3 * med[f'step{i}_wall']:.2f} "
        f"(host {1e3 * med[f'step{i}_host']:.2f}, device {1e3 * med[f'step{i}_device']:.2f})"
        for i in range(n_steps)
    ]
    rnd = f"{1e3 * med['decode_round_s']:.2f} ms" if rounds else "-"
    print(
        f"{layout:>9}: request {1e3 * med['request_s']:.2f} ms = "
        + "; ".join(parts)
        + f" | decode round at batch {ns.batch}: {rnd}, page runs per row {med['page_runs']}",
        flush=True,
    )
    return row


def page_runs(pages: list[int]) -> int:
    """Ascending runs of consecutive page ids in a block-table row (1: one contiguous run)."""
    return 1 + sum(1 for a, b in zip(pages, pages[1:]) if b != a + 1)


if __name__ == "__main__":
    raise SystemExit(main())
