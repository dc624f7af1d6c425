"""Host cost of the prefix cache under churn (issue 22's no-sharing workload, on the CPU).

A block manager with the 8B H200 run's pool (~40k pages of 16 tokens; its size is a guess from
the H200's memory: `--pages`) is filled with cached distinct prompts; then each new ~2.3k-token
prompt must evict ~144 pages on allocation and inserts ~144 pages at `cache_prefix`. Prints us per
page for both (evict = the whole `allocate`: free-list pops and the block-table write included);
`--profile` adds cProfile's top entries.

    PYTHONPATH=. python3 scripts/bench_evict.py [--pages 40000] [--rounds 64] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from ddtree.engine.block_manager import BlockManager
from ddtree.engine.request import Req, SamplingParams


def _req(rid: int, tokens: list[int]) -> Req:
    return Req(prompt_ids=tokens, params=SamplingParams(), rid=str(rid))


def run(pages: int, page_size: int, prompt_tokens: int, rounds: int) -> dict[str, float]:
    rng = random.Random(0)
    per_req = -(-prompt_tokens // page_size) + 2
    bm = BlockManager(pages, page_size, 8, per_req, "cpu", prefix_cache=True)
    rid = 0

    base = [rng.randrange(150_000) for _ in range(prompt_tokens)]

    def prompt() -> list[int]:  # distinct from page 0 on (hit rate 0); cheap to make
        nonlocal rid
        rid += 1
        return [rid] + base[1:]

    while bm.num_free_pages >= per_req:  # fill the pool with cached, unreferenced prefixes
        toks = prompt()
        r = _req(rid, toks)
        bm.allocate(r, prompt_tokens)
        bm.free(r, toks, prompt_tokens)
    evict_s = insert_s = 0.0
    evicted = inserted = 0
    for _ in range(rounds):
        toks = prompt()
        r = _req(rid, toks)
        before = bm.cache.stats.evicted_pages
        t0 = time.perf_counter()
        bm.allocate(r, prompt_tokens)  # the free list is short: evicts ~prompt_tokens / page_size
        t1 = time.perf_counter()
        bm.cache_prefix(r, toks, prompt_tokens)
        t2 = time.perf_counter()
        evict_s, insert_s = evict_s + t1 - t0, insert_s + t2 - t1
        evicted += bm.cache.stats.evicted_pages - before
        inserted += prompt_tokens // page_size
        bm.free(r, toks, prompt_tokens)
    bm.check_integrity()
    return {
        "evicted_pages": evicted,
        "evict_us_per_page": 1e6 * evict_s / max(evicted, 1),
        "insert_us_per_page": 1e6 * insert_s / max(inserted, 1),
        "ms_per_request": 1e3 * (evict_s + insert_s) / rounds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=40_000)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=2304)
    p.add_argument("--rounds", type=int, default=64)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    args = (a.pages, a.page_size, a.prompt_tokens, a.rounds)
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        out = run(*args)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    else:
        out = run(*args)
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
