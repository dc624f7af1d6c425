"""A discrete-event model of `bench prefix-cache`'s no-sharing workload on the H200: the real
`Scheduler` and `BlockManager` (cache on: the pool first filled with unreferenced cached pages, so
every allocation evicts), step costs fitted to the 8B shape (eager prefill 8 ms + 21 us per token,
a graphed extend pass 5 ms, a decode round 11 ms + 0.25 ms per request), --concurrency closed-loop
clients whose next request arrives 6 ms + U(0, --jitter) ms after a finish (the seed's draws),
accept lengths drawn around --tau per request (the same in every run, as at T=0). Per seed,
cache on and off see the same arrivals: where the scheduler treats them alike the two rows are
equal; across seeds the spread is what arrival jitter alone moves one 64-request level.

    PYTHONPATH=. python3 scripts/sim_nosharing.py [--seeds 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import types

from ddtree.engine.block_manager import NO_HIT, BlockManager
from ddtree.engine.extend_graph import plan_passes
from ddtree.engine.request import Req, SamplingParams
from ddtree.engine.scheduler import Scheduler

PAGE, WIDTHS, VERIFY = 16, [64, 128, 256], 17


def fill(bm: BlockManager) -> None:
    """Every free page cached, unreferenced, under ids no prompt has."""
    base = 10**8
    while bm.num_free_pages:
        n = min(bm.num_free_pages, bm.max_pages_per_req - 1) * PAGE
        r = Req(prompt_ids=list(range(base, base + n)), params=SamplingParams())
        base += n
        bm.allocate(r, n)
        bm.free(r, r.prompt_ids, n)


def run(ns, cache: bool, seed: int) -> tuple[float, float, float]:
    """(output tok/s, prefill phase p50 ms, graphed share of prefill steps)."""
    rng = random.Random(seed)
    bm = BlockManager(ns.pages, PAGE, ns.concurrency, 300, "cpu", prefix_cache=cache)
    if cache:
        fill(bm)

    def match(r):
        return bm.match(r.token_slice(0, r.prefill_len), r.prefill_len - 1) if cache else NO_HIT

    def admit(r, hit):
        bm.attach(r, hit, lambda *a: None)
        r.kv_len = hit.length

    def release(r):
        bm.free(r, r.token_slice(0, r.kv_len) if cache else None, r.kv_len)
        r.kv_len = 0

    runner = types.SimpleNamespace(
        bm=bm, match_prefix=match, admit=admit, release=release, checkpoint_align=0
    )
    s = Scheduler(runner, ns.concurrency, 2048, VERIFY, 16384)
    n, out = ns.requests, ns.max_tokens
    prompts = [[rng.randrange(100, 150000) for _ in range(ns.prompt)] for _ in range(n)]
    accept = {id(p): random.Random(i) for i, p in enumerate(prompts)}
    params = SamplingParams(max_tokens=out, ignore_eos=True)
    arrivals, nxt = [(0.5 * i, i) for i in range(ns.concurrency)], ns.concurrency
    now, done, tokens, graphed, steps = 0.0, 0, 0, 0, 0
    scheduled, phase = {}, []
    while done < n:
        arrivals.sort()
        while arrivals and arrivals[0][0] <= now:
            s.add(Req(prompt_ids=prompts[arrivals.pop(0)[1]], params=params))
        b = s.schedule()
        if b is None:
            now = arrivals[0][0]
            continue
        if b.is_prefill:
            steps += 1
            passes = plan_passes(b.q_lens, WIDTHS, 4)
            graphed += passes is not None
            cost = 8 + 0.021 * sum(b.q_lens) if passes is None else 5 * len(passes)
            for r, q in zip(b.reqs, b.q_lens):
                scheduled.setdefault(r.rid, now)
                bm.allocate(r, r.kv_len + q)
                r.kv_len += q
                bm.cache_prefix(r, r.token_slice(0, r.kv_len), r.kv_len)
            now += cost
            for r in b.reqs:
                if not r.needs_prefill and not r.output_ids:
                    r.output_ids.append(1)
                    phase.append(now - scheduled[r.rid])
            continue
        for r in b.reqs:
            bm.allocate(r, r.kv_len + VERIFY)
        now += 11 + 0.25 * len(b.reqs)
        for r in b.reqs:
            k = 1  # T=0: a request's accept lengths are its own (seeded by its prompt, not the run)
            while k < 16 and accept[id(r.prompt_ids)].random() < 1 - 1 / ns.tau:
                k += 1
            k = min(k, out - len(r.output_ids))
            r.kv_len += k
            bm.trim(r, r.kv_len)
            r.output_ids += [1] * k
            tokens += k
            if len(r.output_ids) >= out:
                s.finish(r)
                done += 1
                if nxt < n:
                    arrivals.append((now + 6 + rng.uniform(0, ns.jitter), nxt))
                    nxt += 1
    return tokens / (now / 1e3), statistics.median(phase), graphed / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt", type=int, default=2112)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--pages", type=int, default=9000)
    p.add_argument("--jitter", type=float, default=4.0, help="client turnaround spread, ms")
    p.add_argument("--tau", type=float, default=1.87, help="mean tokens per round")
    ns = p.parse_args()
    rows = []
    for seed in range(ns.seeds):
        on, off = run(ns, True, seed), run(ns, False, seed)
        rows.append((on, off))
        print(
            f"seed {seed}: cache on {on[0]:.1f} tok/s, prefill p50 {on[1]:.1f} ms, graphed "
            f"{on[2]:.2f} | off {off[0]:.1f}, {off[1]:.1f}, {off[2]:.2f}",
            flush=True,
        )
    tput = [on[0] for on, _ in rows]
    print(
        f"on == off in {sum(on == off for on, off in rows)}/{len(rows)} seeds; throughput across "
        f"seeds {min(tput):.1f}-{max(tput):.1f} (min / max {min(tput) / max(tput):.3f})"
    )


if __name__ == "__main__":
    main()
