"""Round and host time per decode round of the offline engine (CPU or GPU), per config and
concurrency: the decoder round's wall time and the engine step outside it (schedule, emit, stops,
finish), with an optional cProfile of the whole loop. Each level keeps `conc` requests running (a
finished one is replaced until 2 x conc have run), like `bench serving`.

Configs: NONE, DFLASH, a fixed budget (16), auto, and auto with its policy forced to one rung
(auto@16: every request budget 16 every round; auto@chain: the DFLASH chain; auto@chain+16: the
two in turn), so an auto round is timed beside the fixed round of the budget it picks (issue 20:
same draft, verify, commit), and a mix beside its rungs alone.

    PYTHONPATH=. python3 studies/host_time.py --configs auto,16 --conc 1,8,32,64 --max-tokens 48
    PYTHONPATH=. python3 studies/host_time.py --device cuda --model-path inflate:qwen3-8b \
        --configs 64,auto@64,16,auto@16,DFLASH,auto@chain --conc 1,8 --max-tokens 128 \
        --context-length 4096
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import time

from ddtree.engine.budget.planner import ScriptedPolicy


class Forced(ScriptedPolicy):
    """A budget-policy stub: every request the same budget (or the chain) every round; rungs
    joined by '+' (auto@chain+16) take turns, one round each (what switching rungs costs)."""

    def __init__(self, rung: str, chain_depth: int):
        self.cycle = [
            (r == "chain", chain_depth if r == "chain" else int(r)) for r in rung.split("+")
        ]
        self.turn = 0

    def choose(self, slots, owners, caps, ctx, extra_s=0.0):
        import numpy as np

        from ddtree.engine.budget.policy import Decision

        chain, budget = self.pick()
        b = np.full(len(slots), budget, dtype=np.int64)
        return Decision(1 + budget, b, np.zeros(len(slots)), 0.0, chain)

    def pick(self) -> tuple[bool, int]:
        """This round's (chain, budget): the next in turn."""
        got = self.cycle[self.turn % len(self.cycle)]
        self.turn += 1  # one call a round: `propose` under the verify, or `choose` in `plan`
        return got

    # the planner proposes the next round's decision under the verify, as with the real policy
    propose = choose

    def carry(self, d, prev_owners, owners, caps):
        """The proposed rung for a batch that changed, as the policy's `carry`."""
        import numpy as np

        from ddtree.engine.budget.policy import Decision

        b = np.full(len(owners), int(d.budgets.max(initial=0)), dtype=np.int64)
        return Decision(d.width, b, np.zeros(len(owners)), 0.0, d.chain)

    def commit(self, d):
        return d

    def observe(self, *a, **kw):
        pass

    def observe_curves(self, *a, **kw):  # the planner's two halves of `observe` (budget.py)
        return None

    def observe_accepted(self, *a, **kw):
        pass


# the H200 8B-shape per-round ms of BENCHMARKS (round + host; NONE: its TPOT), verify width ->
# ms per concurrency H200_CONC
H200_CONC = (1, 2, 4, 8, 16, 32, 64)
H200_MS = {
    1: (5.72, 5.81, 5.85, 6.16, 6.14, 6.67, 8.34),
    16: (7.47, 7.64, 8.13, 9.54, 11.65, 17.18, 28.14),
    17: (8.27, 8.57, 9.34, 10.65, 13.71, 19.54, 37.31),
    65: (8.35, 8.93, 11.17, 15.83, 25.74, 45.75, 74.44),
}


def h200_costs(spec):
    """The H200 8B-shape per-round ms of BENCHMARKS (round + host; NONE: its TPOT), as a cost
    table over auto's rungs (other tree rungs interpolated in width), so that on the CPU the
    policy chooses as on the H200 and its host-side paths are the H200's."""
    import numpy as np

    from ddtree.engine.budget.policy import CostTable, rung_widths

    conc, ms = H200_CONC, H200_MS
    ladder = tuple(sorted({0, 8, 16, 32, spec.budget}))
    w = rung_widths(ladder, spec.chain_rung)
    known = sorted(ms)
    table = np.array(
        [[np.interp(w, known, [ms[k][i] for k in known]) / 1e3] for i in range(len(conc))]
    )
    return CostTable(ladder, conc, (4096,), table, chain=spec.chain_rung)


def config_kwargs(name: str) -> dict:
    if name == "auto" or name.startswith("auto@"):
        return dict(speculative_algorithm="DDTREE", speculative_ddtree_budget="auto")
    if name in ("DFLASH", "NONE"):
        return dict(speculative_algorithm=name)
    return dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=int(name))


def prompts(tokenizer, n: int) -> list[list[int]]:
    import inspect
    import textwrap

    src = inspect.getsource(textwrap)
    return [
        tokenizer.encode(src[(200 * i) % 4000 :], add_special_tokens=False)[: 24 + 7 * (i % 9)]
        for i in range(n)
    ]


def time_planner(planner) -> list[float]:
    """Per round, the budget planner's host seconds on the critical path between rounds (`plan`
    before the draft, `observe` after the blocking read-back; `observe_curves` runs while the
    verify runs and is not counted): auto's host cost the fixed server does not pay."""
    spent = [0.0]
    for name in ("plan", "observe"):
        fn = getattr(planner, name)

        def timed(*a, fn=fn, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t

        setattr(planner, name, timed)
    return spent


def keep_running(eng, prompt_ids: list, conc: int, sp, on_step=None) -> dict:
    """Serve `prompt_ids` in order through the offline engine with `conc` requests in flight (a
    finished one is replaced by the next prompt after the step), as `bench serving`'s closed loop
    does. on_step(advanced, index) after every step: the requests it advanced and {rid: prompt
    index}. Returns {prompt index: Req}."""
    todo = list(enumerate(prompt_ids))[::-1]
    reqs, index, live = {}, {}, []

    def top_up():
        while todo and len(live) < conc:
            i, ids = todo.pop()
            r = eng.add_request(ids, sp)
            reqs[i], index[r.rid] = r, i
            live.append(r)

    top_up()
    while eng.has_unfinished():
        advanced = eng.step().reqs
        if on_step is not None:
            on_step(advanced, index)
        live[:] = [r for r in live if not r.is_finished]
        top_up()
    return reqs


def level(llm, conc: int, max_tokens: int, profile, spent: list[float]) -> dict:
    from ddtree import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    host, rounds, policy, steps, device, idle, phases = [], [], [], [0], [], [], {}
    launch0 = dict(eng.decoder.times.seconds)  # the decoder's host clock per phase (PhaseTimes)

    def on_step(advanced, index):
        steps[0] += 1
        rec = eng.last_round
        if rec is not None:
            host.append(rec.timing.host_s)
            rounds.append(rec.timing.round_s)
            policy.append(spent[0])
            if rec.timing.device_s is not None:  # the GPU's clock (engine/round/clock.py)
                device.append(rec.timing.device_s)
            if rec.timing.idle_s is not None:
                idle.append(rec.timing.idle_s)
            for k, v in rec.timing.device_phases.items():
                phases.setdefault(k, []).append(v)
        spent[0] = 0.0

    t0 = time.perf_counter()
    if profile is not None:
        profile.enable()
    # the last prompt first, as before
    keep_running(eng, prompts(eng.tokenizer, 2 * conc)[::-1], conc, sp, on_step)
    if profile is not None:
        profile.disable()
    wall = time.perf_counter() - t0
    launch = {
        k: 1e3 * (v - launch0.get(k, 0.0)) / max(len(rounds), 1)
        for k, v in eng.decoder.times.seconds.items()
    }
    return {
        "conc": conc,
        "rounds": len(rounds),
        "steps": steps[0],
        "host_ms_mean": 1e3 * statistics.fmean(host),
        "host_ms_p50": 1e3 * statistics.median(host),
        "host_ms_max": 1e3 * max(host),
        "round_ms_mean": 1e3 * statistics.fmean(rounds),
        "round_ms_p50": 1e3 * statistics.median(rounds),
        "policy_ms_p50": 1e3 * statistics.median(policy),
        "policy_ms_mean": 1e3 * statistics.fmean(policy),
        "device_ms_p50": 1e3 * statistics.median(device) if device else None,
        "idle_ms_p50": 1e3 * statistics.median(idle) if idle else None,
        # per round: the device span's phases (p50), and the decoder's host time per phase (mean:
        # with CUDA graphs the launches; `commit` holds the wait for the device)
        "device_phase_ms_p50": {k: 1e3 * statistics.median(v) for k, v in phases.items()},
        "host_phase_ms_mean": launch,
        "wall_s": wall,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="target (default: the embedded pair)")
    p.add_argument("--configs", default="auto,16", help="auto, a fixed budget, DFLASH, NONE")
    p.add_argument("--conc", default="1,8,32,64")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--device", default="cpu")
    p.add_argument("--context-length", type=int, default=None, help="fewer CUDA-graph buckets")
    p.add_argument(
        "--costs",
        default="device",
        choices=("device", "h200"),
        help="auto's round costs: the device's own, or the H200 8B table (CPU runs choose as there)",
    )
    p.add_argument("--profile", type=int, default=0, help="print the top N cProfile rows")
    p.add_argument("--profile-sort", default="tottime", help="pstats sort key (e.g. cumulative)")
    p.add_argument(
        "--profile-filter", default=None, help="only rows matching this regex (e.g. budget)"
    )
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    import torch

    from ddtree import LLM

    torch.set_num_threads(1)
    rows = []
    conc = [int(c) for c in a.conc.split(",")]
    for name in a.configs.split(","):
        kw = dict(device=a.device, max_running_requests=max(conc), **config_kwargs(name))
        if a.context_length:
            kw["context_length"] = a.context_length
        if a.device == "cuda":
            kw.update(dtype="bfloat16", attention_backend="triton")
        llm = LLM(a.model_path, **kw)
        if name == "auto" and a.costs == "h200":
            # pinned, not through set_cost: the served-round correction (ServedCost) would
            # learn this machine's round times and choose as this machine, not the H200
            llm.engine.set_budget_policy(None, cost=h200_costs(llm.engine.spec))
        if name.startswith("auto@"):
            spec = llm.engine.spec
            llm.engine.set_budget_policy(Forced(name[5:], spec.chain_rung))
        spent = time_planner(llm.engine.decoder.budgets)
        prof = cProfile.Profile() if a.profile else None
        for c in conc:
            row = {"config": name, **level(llm, c, a.max_tokens, prof, spent)}
            rows.append(row)
            print(
                f"{name:>6} conc {c:>3}: host {row['host_ms_mean']:.2f} ms/round (p50 "
                f"{row['host_ms_p50']:.2f}, max {row['host_ms_max']:.1f}), round "
                f"{row['round_ms_mean']:.2f} ms, policy {row['policy_ms_p50']:.3f} ms (p50; "
                f"mean {row['policy_ms_mean']:.3f}), "
                f"{row['rounds']} rounds"
                + (
                    f", device {row['device_ms_p50']:.2f} ms, idle {row['idle_ms_p50']:.2f} ms (p50)"
                    if row["device_ms_p50"] is not None and row["idle_ms_p50"] is not None
                    else ""
                ),
                flush=True,
            )
            dev, hst = row["device_phase_ms_p50"], row["host_phase_ms_mean"]
            if dev:
                print(
                    "        device phases ms: " + ", ".join(f"{k} {v:.2f}" for k, v in dev.items())
                )
            print("        host phases ms: " + ", ".join(f"{k} {v:.2f}" for k, v in hst.items()))
        if prof is not None:
            stats = pstats.Stats(prof).sort_stats(a.profile_sort)
            # a filter (a regex on the file:function line) first, then the top N of those
            stats.print_stats(*([a.profile_filter] if a.profile_filter else []), a.profile)
        del llm
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
    names = list(dict.fromkeys(r["config"] for r in rows))
    print("\nround ms (p50) per decode round, side by side:")
    print(f"{'conc':>5} " + " ".join(f"{n:>12}" for n in names))
    for c in conc:
        got = {r["config"]: r for r in rows if r["conc"] == c}
        cells = [f"{got[n]['round_ms_p50']:>12.2f}" if n in got else " " * 12 for n in names]
        print(f"{c:>5} " + " ".join(cells))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
