"""Seeded differential fuzzer of the engine (issue 39): request mixes (tests/fuzz_workload.py) through
`LLMEngine` (add_request / step / abort), the engine's integrity checked after every step, every
output checked against plain AR cut by an independent stop-rule oracle (tests/fuzz_oracle.py).

A seed is one case (`fuzz_workload.draw_case`: an engine config and a workload). After every step:
`ddtree.engine.integrity.problems` (pools, slots, ref counts, lengths, cached tokens, checkpoints;
deep), and no isolated fault (engine/faults.py turns an exception into a failed request: here
that is a finding); after each finish: the request holds nothing; after the drain: nothing held,
and every cached page / checkpoint equals a fresh prefill of its tokens (tests/fuzz_checks.py);
then each request against the oracle. A case with an injected `Fault` must fail its victim alone,
with everything else exact.

    PYTHONPATH=. python3 tests/fuzz_engine.py --seed 7              # one case, its report
    PYTHONPATH=. python3 tests/fuzz_engine.py --seeds 0:200         # a range
    PYTHONPATH=. python3 tests/fuzz_engine.py --long --hours 2 --seed 1000
A failing case prints its one-line reproduction.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import sys
import time
import traceback
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from fuzz_workload import KINDS, Case, draw_case  # noqa: E402

from ddtree import envs  # noqa: E402
from ddtree.engine.budget.planner import ScriptedPolicy  # noqa: E402
from ddtree.engine.budget.policy import Decision  # noqa: E402

__all__ = ["KINDS", "CaseResult", "run_case", "summarize", "toy_pairs"]


@dataclasses.dataclass
class CaseResult:
    seed: int
    config: str
    requests: int = 0
    steps: int = 0
    seconds: float = 0.0
    failures: list[str] = dataclasses.field(default_factory=list)
    stats: Counter = dataclasses.field(default_factory=Counter)
    accept: list[int] = dataclasses.field(default_factory=list)  # greedy speculative rounds

    @property
    def ok(self) -> bool:
        return not self.failures

    def repro(self) -> str:
        cache = envs.CACHE.get() or "<dir>"
        dev = f" --device {self.device}" if self.device != "cpu" else ""
        return (
            f"PYTHONPATH=. DDTREE_CACHE={cache} python3 tests/fuzz_engine.py --seed {self.seed}"
            f" --requests {self.requests_asked}{dev}"
        )

    requests_asked: int = 0
    device: str = "cpu"

    def line(self) -> str:
        head = f"seed {self.seed}: {'ok' if self.ok else 'FAIL'} [{self.config}]"
        body = f" {self.requests} requests, {self.steps} steps, {self.seconds:.1f} s"
        if self.ok:
            return head + body
        return head + body + "\n  " + "\n  ".join(self.failures[:12]) + f"\n  repro: {self.repro()}"


def run_case(
    seed: int, refs, n_requests: int = 24, max_steps: int = 5000, extras: bool = True
) -> CaseResult:
    """One seeded case through the engine; every problem found lands in `failures` (an exception
    ends the case there). `extras=False`: the case as drawn before grammars and DFlash2 drafters
    were (the regression seeds replay their finding)."""
    t0 = time.perf_counter()
    case = draw_case(seed, refs, n_requests, extras)
    desc = case.cfg.describe() + (f" fault={case.fault}" if case.fault else "")
    res = CaseResult(seed, desc, len(case.specs), requests_asked=n_requests, device=refs.device)
    try:
        _drive(case, refs, res, max_steps)
    except Exception as e:  # noqa: BLE001 - a crash is the finding
        tb = traceback.format_exc().strip().splitlines()
        res.failures.append(f"raised {type(e).__name__}: {e} | " + " | ".join(tb[-6:]))
    res.seconds = time.perf_counter() - t0
    return res


def _drive(case: Case, refs, res: CaseResult, max_steps: int) -> None:
    from engine_utils import make_llm

    cfg = case.cfg
    pair = refs.pair(cfg.target, cfg.drafter)
    llm = make_llm(pair, cfg.algorithm, **dict(cfg.kwargs), **refs.engine_kwargs)
    engine = llm.engine
    if cfg.packing:
        engine.set_budget_policy(RandomPacking(res.seed))
    runner = engine.runner
    if cfg.graphs:
        from fuzz_workload import GRAPH_MAX_BS

        from ddtree.engine.graphs.runner import attach_uncaptured

        attach_uncaptured(engine, max_bs=GRAPH_MAX_BS)
        begin = runner.begin

        def counted(reqs):  # the rounds on the graphs' path
            rnd = begin(reqs)
            res.stats["graphed_rounds"] += rnd.graphed
            return rnd

        runner.begin = counted
    if runner.state_pool is None:  # count the packed rounds and their shares
        real = runner.verify_packed

        def verify_packed(rnd, tree, keep, num_rows, logit_reqs=None):
            shares = keep.sum(1)
            res.stats["packed_rounds"] += 1
            if int(shares.min()) == 1 and int(shares.max()) > 4:
                res.stats["packed_root_beside_deep"] += 1
            for r in rnd.reqs:  # the rows that draw from their logits, packed
                if r.params.grammar is not None:
                    res.stats["packed_grammar_rows"] += 1
                elif not r.params.greedy:
                    res.stats["packed_sampled_rows"] += 1
            out = real(rnd, tree, keep, num_rows, logit_reqs)
            if rnd.graphed and rnd.packed.input_ids.shape[0] in runner.packed_rows(rnd.batch):
                res.stats["packed_graphed"] += 1  # the packed graphs' path
            return out

        runner.verify_packed = verify_packed
    # fault isolation turns an exception into a failed (aborted) request and goes on: every
    # isolated failure is a finding, with what the engine logged about it
    logged = _LogTap()
    logging.getLogger("ddtree").addHandler(logged)
    try:
        reqs = _steps(engine, case, res, max_steps, logged)
        if reqs is not None:
            _check_outputs(engine, case, reqs, refs, res)
    finally:
        logging.getLogger("ddtree").removeHandler(logged)


class _LogTap(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += " | " + " | ".join(traceback.format_exception(*record.exc_info)[-3:])
        self.lines.append(text.replace("\n", " "))


def _inject(engine, fault, reqs: list) -> None:
    """The case's fault: its victim raises wherever it is once it has `after` output tokens."""

    def hit(batch) -> bool:
        v = reqs[fault.victim]
        return any(r is v and r.num_output_tokens >= fault.after for r in batch)

    if fault.where == "round":
        real_round = engine.decoder.round

        def round_(batch, max_context):
            if hit(batch):
                raise RuntimeError("injected fault: a decoding round")
            return real_round(batch, max_context)

        engine.decoder.round = round_
    elif fault.where == "prefill":
        real_prefill = engine.runner.prefill

        def prefill(batch, q_lens):
            if hit(batch):
                raise RuntimeError("injected fault: a prefill")
            return real_prefill(batch, q_lens)

        engine.runner.prefill = prefill
    else:
        real_emit = engine.emitter.emit

        def emit(req, tokens):
            if hit([req]):
                raise RuntimeError("injected fault: its emission")
            return real_emit(req, tokens)

        engine.emitter.emit = emit


class RandomPacking(ScriptedPolicy):
    """Random batch-wide budgets (issue 57): each round R drafted rows for the whole batch (1 to
    past every drafted node) with random per-request caps (0: the request's root alone, beside
    deep trees), one round in six dense at the caps. Sampled, log-prob and grammar requests
    pack beside greedy ones."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed * 92821 + 7)

    def choose(self, slots, owners, caps, ctx, extra_s=0.0):
        rng, n = self.rng, len(slots)
        b = np.array([min(c, rng.choice((0, 1, 3, c, c))) for c in caps], dtype=np.int64)
        rows = None if rng.random() < 1 / 6 else rng.randint(1, int(b.sum()) + 4)
        return Decision(1 + int(b.max(initial=0)), b, np.zeros(n), 0.0, rows=rows)


def _steps(engine, case: Case, res, max_steps, logged) -> list | None:
    """Drive the case to its drain; the requests, or None after a failure that ends it."""
    from ddtree.engine import integrity

    specs = case.specs
    assert engine.max_context == case.ctx, (engine.max_context, case.ctx)
    if case.eos is not None:
        engine.emitter.eos_ids = case.eos
    reqs: list = [None] * len(specs)
    if case.fault is not None:
        _inject(engine, case.fault, reqs)
    arrivals = sorted(range(len(specs)), key=lambda i: specs[i].arrive)
    aborts = sorted((s.abort_at, i) for i, s in enumerate(specs) if s.abort_at is not None)
    step = nxt = ab = 0
    while nxt < len(arrivals) or engine.has_unfinished():
        if not engine.has_unfinished() and specs[arrivals[nxt]].arrive > step:
            step = specs[arrivals[nxt]].arrive  # idle: the next arrival now
        while nxt < len(arrivals) and specs[arrivals[nxt]].arrive <= step:
            i = arrivals[nxt]
            reqs[i] = engine.add_request(list(specs[i].prompt), specs[i].params)
            nxt += 1
        due = []
        while ab < len(aborts) and aborts[ab][0] <= step:
            due.append(reqs[aborts[ab][1]])
            ab += 1
        due += [
            r
            for r, s in zip(reqs, specs)
            if s.abort_after is not None and r is not None and r.num_output_tokens >= s.abort_after
        ]
        for r in due:
            if r is not None and not r.is_finished:
                res.stats["abort_" + ("running" if r.slot >= 0 else "waiting")] += 1
                engine.abort(r.rid)
                res.failures += integrity.finished_problems(r)
        advanced = engine.step().reqs
        res.steps, step = res.steps + 1, step + 1
        bad = integrity.problems(engine, deep=True)
        faults = engine.faults.stats
        if case.fault is None and (faults.isolated or faults.batch_failures):
            bad.append(f"engine faults {faults}: " + " || ".join(logged.lines[-3:]))
        victim = reqs[case.fault.victim] if case.fault is not None else None
        wrong = [r.rid for r in reqs if r is not None and r.error and r is not victim]
        if wrong or faults.isolated > 1:
            bad.append(
                f"failed besides the victim: {wrong} {faults}: " + " || ".join(logged.lines[-3:])
            )
        for r in advanced:
            if r.is_finished:
                bad += integrity.finished_problems(r)
        if bad:
            res.failures += [f"step {step}: {b}" for b in bad]
            return None
        if res.steps > max_steps:
            res.failures.append(f"no drain after {max_steps} steps")
            return None
    return reqs


def _check_outputs(engine, case: Case, reqs: list, refs, res: CaseResult) -> None:
    from fuzz_checks import (
        FP8,
        FP32,
        cached_state_problems,
        check_grammar_request,
        check_request,
        check_seeded_request,
    )
    from fuzz_oracle import TextOf

    from ddtree.engine import integrity
    from ddtree.engine.round.logprobs import MAX_TOP_LOGPROBS

    cfg, specs, fault = case.cfg, case.specs, case.fault
    res.failures += [f"drained: {b}" for b in integrity.drained_problems(engine, deep=True)]
    tol = FP8 if cfg.target.endswith(":fp8") else FP32
    ref_runner = refs.llm(cfg.target).engine.runner
    res.failures += [f"drained: {b}" for b in cached_state_problems(engine, ref_runner, tol)]
    conts = refs.get(cfg.target, [s.prompt for s in specs])
    text_of, eos = TextOf(engine.tokenizer), engine.emitter.eos_ids
    spec_run = cfg.algorithm != "NONE"
    constrained = [i for i, s in enumerate(specs) if s.params.grammar is not None]
    ar_runs = refs.runs(cfg.target, [(specs[i].prompt, specs[i].params) for i in constrained])
    grammar_refs = dict(zip(constrained, ar_runs))
    # seeded samples: AR's run of the same seed draws the same tokens (engine/round/sampler.py)
    seeded = [i for i, s in enumerate(specs) if not s.params.greedy and s.params.seed is not None]
    seeded_runs = refs.runs(
        cfg.target, [(specs[i].prompt, specs[i].params) for i in seeded], MAX_TOP_LOGPROBS
    )
    seeded_refs = dict(zip(seeded, seeded_runs))
    tied = set()  # seeded requests that left AR's tokens at a numerical near-tie
    for i, (s, r) in enumerate(zip(specs, reqs)):
        if i in grammar_refs:
            bad = check_grammar_request(r, grammar_refs[i], res.stats, tol)
        else:
            bad = check_request(r, conts[s.prompt], text_of, case.ctx, eos, res.stats, tol)
        if i in seeded_refs:
            ties = res.stats["near_tie"]
            bad += check_seeded_request(r, seeded_refs[i], res.stats, tol)
            if res.stats["near_tie"] > ties:
                tied.add(i)
        victim = fault is not None and i == fault.victim
        if r.error is not None and not victim:
            bad.append(f"failed: {r.error}")
        if victim:  # it fails alone once it reaches the fault (unless it finished first)
            if r.error is not None and "injected" not in r.error:
                bad.append(f"the fault's victim failed otherwise: {r.error}")
            asked = s.abort_at is not None or s.abort_after is not None
            if r.finish_reason == "abort" and r.error is None and not asked:
                bad.append("the fault's victim ended with 'abort' and no error")
            res.stats["fault_victims_failed"] += r.error is not None
        if s.twin_of is not None and not {i, s.twin_of} & tied:
            res.stats["seeded_twins"] += 1
            t = reqs[s.twin_of]
            if "abort" not in (r.finish_reason, t.finish_reason) and r.output_ids != t.output_ids:
                bad.append(
                    f"seeded twin of request {s.twin_of} differs: {r.output_ids} vs {t.output_ids}"
                )
        res.failures += [f"request {i} {s.prompt} {s.params}: {b}" for b in bad]
        _count(res, r, spec_run)
    if fault is not None:
        res.stats["fault_batch_failures"] += engine.faults.stats.batch_failures
    st = engine.scheduler
    res.stats["preemptions"] += st.num_preemptions
    if engine.runner.bm.cache is not None:
        cs = engine.runner.bm.cache.stats
        res.stats["evicted_pages"] += cs.evicted_pages
        res.stats["cache_hit_tokens"] += cs.hit_tokens


def _count(res: CaseResult, r, spec_run: bool) -> None:
    """Coverage: finishes by reason, and those that cut a round's accepted block."""
    res.stats["finish_" + r.finish_reason] += 1
    emitted = sum(r.stats.accept_lengths) + (1 if r.stats.rounds < r.num_output_tokens else 0)
    if spec_run and r.finish_reason != "abort" and emitted > r.num_output_tokens:
        res.stats[
            "cut_in_block_"
            + (("string" if r.stop_hit else "id") if r.finish_reason == "stop" else r.finish_reason)
        ] += 1
    if spec_run and r.params.greedy and r.finish_reason != "abort":
        res.accept += r.stats.accept_lengths


def toy_pairs() -> dict[str, tuple[str, str]]:
    """The toy pairs, from $DDTREE_CACHE when set (else trained into a temporary directory)."""
    import tempfile

    from ddtree.tools.train.toy import build_toy_hybrid_pair, build_toy_pair

    root = envs.CACHE.get() or tempfile.mkdtemp(prefix="ddtree_fuzz_")
    return {
        "dense": build_toy_pair(os.path.join(root, "toy_pair")),
        "hybrid": build_toy_hybrid_pair(os.path.join(root, "toy_hybrid_pair")),
    }


def toy_dflash2_drafters(pairs: dict[str, tuple[str, str]]) -> dict[str, str]:
    """A DFlash2 drafter per toy target (as tests/conftest.py's fixtures build them)."""
    import tempfile

    from ddtree.tools.train.toy import build_toy_dflash2_drafter

    root = envs.CACHE.get() or tempfile.mkdtemp(prefix="ddtree_fuzz_")
    return {
        "dense": build_toy_dflash2_drafter(
            os.path.join(root, "toy_dflash2_pair"), pairs["dense"][0]
        ),
        "hybrid": build_toy_dflash2_drafter(
            os.path.join(root, "toy_hybrid_dflash2_pair"), pairs["hybrid"][0], hybrid=True
        ),
    }


def summarize(results: list[CaseResult]) -> str:
    stats = sum((r.stats for r in results), Counter())
    acc = [n for r in results for n in r.accept]
    lines = [
        f"{len(results)} cases, {sum(r.requests for r in results)} requests, "
        f"{sum(r.steps for r in results)} steps, {sum(r.seconds for r in results):.1f} s; "
        f"{sum(not r.ok for r in results)} failed",
        "coverage: " + ", ".join(f"{k} {v}" for k, v in sorted(stats.items())),
    ]
    if acc:
        lines.append(f"greedy speculative mean accept length {sum(acc) / len(acc):.2f}")
    if stats["http_accept_count"]:  # the servers' own histogram, every request
        lines.append(
            f"mean accept length {stats['http_accept_sum'] / stats['http_accept_count']:.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--seed", type=int, default=0, help="one case (with --long: the first seed)")
    ap.add_argument("--seeds", help="a range a:b of seeds")
    ap.add_argument("--long", action="store_true", help="seeds from --seed on until --hours pass")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=24, help="requests per case (before n copies)")
    ap.add_argument("--quiet", action="store_true", help="print failing cases only")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from fuzz_oracle import References

    pairs = toy_pairs()
    refs = References(pairs, a.device, toy_dflash2_drafters(pairs))
    if a.seeds:
        lo, hi = (int(x) for x in a.seeds.split(":"))
        seeds = iter(range(lo, hi))
    elif a.long:
        seeds = iter(range(a.seed, 1 << 62))
    else:
        seeds = iter([a.seed])
    deadline = time.monotonic() + a.hours * 3600
    results = []
    for seed in seeds:
        if a.long and time.monotonic() > deadline:
            break
        r = run_case(seed, refs, a.requests)
        results.append(r)
        if not (a.quiet and r.ok):
            print(r.line(), flush=True)
    print(summarize(results))
    failed = [r for r in results if not r.ok]
    for r in failed:
        print("FAILED:", r.repro())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
