"""Seeded differential fuzzer of the engine (issue 39): request mixes through `LLMEngine`
(add_request / step / abort), the engine's integrity checked after every step, every output checked
against plain AR cut by an independent stop-rule oracle (tests/fuzz_oracle.py).

A seed is one case: an engine config (dense or hybrid toy target; AR / DFLASH / DDTREE at a fixed
budget or `auto`; both mamba strategies; page size, prefix cache, KV pool from roomy to one that
only just fits the largest request alone, chunked prefill, context length, running slots) and a
workload: prompt families with shared prefixes (the same prompt, a prefix, a fork, a prompt that
runs into a reference continuation, so cached pages written by decoding are hit), stop ids and stop
strings drawn from the model's own continuations (so they fall inside accepted blocks), EOS
declared on a token the model emits, `n` copies, log-probs, max_tokens at and around block
boundaries, per-request budget caps, greedy and sampled (with seeded twins that must agree),
arrivals at random steps and aborts at random steps. The config kind cycles with the seed
(`KINDS`), the rest is drawn from it.

After every step: `ddtree.engine.integrity.problems` (pools, slots, ref counts, lengths, cached
tokens, checkpoints; deep); after each finish: the request holds nothing; after the drain: nothing
held, and every cached page / checkpoint equals a fresh prefill of its tokens.

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

# (target, algorithm, budget kind, mamba strategy); the seed picks KINDS[seed % len(KINDS)]
KINDS = (
    ("dense", "NONE", None, None),
    ("dense", "DFLASH", None, None),
    ("dense", "DDTREE", "fixed", None),
    ("dense", "DDTREE", "auto", None),
    ("hybrid", "DDTREE", "fixed", "extra_buffer"),
    ("hybrid", "DDTREE", "fixed", "no_buffer"),
    ("hybrid", "DFLASH", None, "no_buffer"),
    ("hybrid", "DDTREE", "auto", "extra_buffer"),
    ("hybrid", "NONE", None, "no_buffer"),
)
BOS = 0
MAX_TOKENS = 48


@dataclasses.dataclass(frozen=True)
class Config:
    target: str
    algorithm: str
    kwargs: tuple  # LLM keyword arguments, sorted (key, value) pairs

    def describe(self) -> str:
        kw = " ".join(f"{k}={v}" for k, v in self.kwargs)
        return f"{self.target} {self.algorithm} {kw}"


@dataclasses.dataclass
class Spec:
    prompt: tuple[int, ...]
    params: object  # SamplingParams
    arrive: int  # the step it is added before
    abort_at: int | None = None  # the step it is aborted before
    twin_of: int | None = None  # index of the request it must agree with (seeded sample)


def draw_config(seed: int, rng: random.Random) -> tuple[Config, dict]:
    """The kind cycles with the seed; the knobs are drawn. Returns the config and the knobs the
    workload needs (block size, fixed budget)."""
    target, algorithm, budget, strategy = KINDS[seed % len(KINDS)]
    kw = {
        "page_size": rng.choice([1, 2, 4, 4, 8, 16]),
        "max_running_requests": rng.choice([1, 2, 3, 4, 8, 48]),
        "chunked_prefill_size": rng.choice([3, 8, 16, 64, 2048]),
        "disable_radix_cache": rng.random() < 0.2,
        "random_seed": seed,
    }
    if strategy is not None:
        kw["mamba_scheduler_strategy"] = strategy
    if budget == "fixed":
        kw["speculative_ddtree_budget"] = rng.choice([2, 4, 8, 16, 32])
    elif budget == "auto":
        kw["speculative_ddtree_budget"] = "auto"
        kw["speculative_ddtree_max_budget"] = rng.choice([8, 16, 32])
    return Config(target, algorithm, tuple(sorted(kw.items()))), {
        "budget": kw.get("speculative_ddtree_max_budget", kw.get("speculative_ddtree_budget")),
        "fixed": budget != "auto",
    }


def family_base(rng: random.Random) -> tuple[int, ...]:
    from engine_utils import toy_pattern

    n = rng.randint(3, 36)
    if rng.random() < 0.15:  # noise: drafts are rarely accepted
        return (BOS,) + tuple(rng.randint(4, 63) for _ in range(n))
    kind = rng.choice(["prog", "walk"])
    return (BOS,) + tuple(toy_pattern(kind, rng.randrange(60), n, rng.choice([1, 2, 3, -1, -2])))


def draw_prompts(rng: random.Random, n: int, refs, target: str) -> list[tuple[int, ...]]:
    """n prompts over a few families: the base, a prefix of it, a fork off it, or the base run
    into its own reference continuation (hits pages a decode wrote)."""
    from engine_utils import toy_pattern

    bases = [family_base(rng) for _ in range(rng.randint(1, 5))]
    conts = refs.get(target, bases)
    out = []
    for _ in range(n):
        base = rng.choice(bases)
        v = rng.random()
        if v < 0.3:
            out.append(base)
        elif v < 0.5:
            out.append(base[: rng.randint(2, len(base))])
        elif v < 0.7:
            cut = rng.randint(2, len(base))
            tail = toy_pattern("prog", rng.randrange(60), rng.randint(1, 12), rng.choice([1, 3]))
            out.append(base[:cut] + tuple(tail))
        else:
            out.append(base + tuple(conts[base].tokens[: rng.randint(1, 24)]))
    return out


def draw_params(rng: random.Random, prompt, ref, text_of, knobs: dict, algorithm: str):
    from ddtree import SamplingParams

    b = knobs["block"]
    kw: dict = {
        "max_tokens": rng.choice(
            [
                1,
                2,
                3,
                b - 1,
                b,
                b + 1,
                2 * b - 1,
                2 * b,
                2 * b + 1,
                3 * b,
                rng.randint(1, MAX_TOKENS),
            ]
        )
    }
    kw["max_tokens"] = max(1, min(kw["max_tokens"], MAX_TOKENS))
    if rng.random() < 0.3:
        kw.update(
            temperature=rng.choice([0.6, 1.0, 1.3]),
            top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
            top_k=rng.choice([-1, -1, 4, 10]),
            seed=rng.randrange(1 << 30) if rng.random() < 0.6 else None,
        )
    else:
        kw["temperature"] = 0.0
    horizon = min(len(ref.tokens), kw["max_tokens"] + 3)
    if rng.random() < 0.35:
        ids = [ref.tokens[rng.randrange(horizon)] for _ in range(rng.randint(1, 2))]
        kw["stop_token_ids"] = ids + ([rng.randint(4, 63)] if rng.random() < 0.2 else [])
    if rng.random() < 0.4:
        text = text_of.after(prompt, ref.tokens[:horizon])
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.15 or not text:
                stops.append(rng.choice(["zz", "\n", "99"]))  # never decoded
                continue
            i = rng.randrange(len(text))
            s = text[i : i + rng.randint(1, 6)]
            stops.append(s)
            if rng.random() < 0.2 and len(s) > 1:  # a stop and its own prefix
                stops.append(s[: rng.randint(1, len(s) - 1)])
        kw["stop"] = stops
    kw["ignore_eos"] = rng.random() < 0.5
    if rng.random() < 0.25:
        kw.update(logprobs=True, top_logprobs=rng.choice([0, 1, 2, 5]))
    if algorithm == "DDTREE" and rng.random() < 0.15:
        kw["ddtree_budget"] = rng.randint(1, knobs["budget"])
    return SamplingParams(**kw)


def draw_case(seed: int, refs, n_requests: int):
    """(config, knobs, specs, eos ids) of one seed."""
    from ddtree.engine.config import spec_config
    from ddtree.server_args import ServerArgs, resolve_server_args

    rng = random.Random(seed)
    cfg, knobs = draw_config(seed, rng)
    pair = refs.pairs[cfg.target]
    kw = dict(cfg.kwargs)
    args = ServerArgs(
        model_path=pair[0],
        speculative_algorithm=cfg.algorithm,
        dtype="float32",
        device="cpu",
        **({"speculative_draft_model_path": pair[1]} if cfg.algorithm != "NONE" else {}),
        **kw,
    )
    spec = spec_config(resolve_server_args(args))
    knobs["block"], width = spec.block_size, spec.verify_width
    prompts = draw_prompts(rng, n_requests, refs, cfg.target)
    conts = refs.get(cfg.target, prompts)
    ctx = refs.max_context(cfg.target)
    if rng.random() < 0.25:  # a short context: requests end at it
        ctx = max(len(p) for p in prompts) + rng.randint(2, 24)
        kw["context_length"] = ctx
    tokenizer = refs.tokenizer(cfg.target)
    from fuzz_oracle import TextOf

    text_of = TextOf(tokenizer)
    specs: list[Spec] = []
    for prompt in prompts:
        params = draw_params(rng, prompt, conts[prompt], text_of, knobs, cfg.algorithm)
        arrive = 0 if rng.random() < 0.6 else rng.randint(1, 40)
        copies = rng.randint(2, 4) if rng.random() < 0.15 else 1
        for i in range(copies):
            p = params
            if p.seed is not None and i:
                p = dataclasses.replace(p, seed=p.seed + i)
            abort = arrive + rng.randint(0, 15) if rng.random() < 0.12 else None
            specs.append(Spec(prompt, p, arrive, abort))
        if params.seed is not None and knobs["fixed"] and rng.random() < 0.4:
            specs.append(
                Spec(prompt, params, arrive + rng.randint(1, 20), twin_of=len(specs) - copies)
            )
    # a pool from roomy to one the largest request only just fits alone (admission needs its
    # tokens + one verify width): eviction and preemption
    if rng.random() < 0.5:
        p = kw["page_size"]
        need = max(min(len(s.prompt) + s.params.max_tokens, ctx) - 1 + width for s in specs)
        kw["max_total_tokens"] = (-(-need // p) + rng.randint(0, 2)) * p
    eos = None
    if rng.random() < 0.3:  # the toy corpus has no EOS: declare one the model emits
        eos = (rng.choice([t for c in conts.values() for t in c.tokens]),)
    cfg = dataclasses.replace(cfg, kwargs=tuple(sorted(kw.items())))
    return cfg, knobs, specs, eos, ctx


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
        cache = os.environ.get("DDTREE_CACHE", "<dir>")
        return (
            f"PYTHONPATH=. DDTREE_CACHE={cache} python3 tests/fuzz_engine.py --seed {self.seed}"
            f" --requests {self.requests_asked}"
        )

    requests_asked: int = 0

    def line(self) -> str:
        head = f"seed {self.seed}: {'ok' if self.ok else 'FAIL'} [{self.config}]"
        body = f" {self.requests} requests, {self.steps} steps, {self.seconds:.1f} s"
        if self.ok:
            return head + body
        return head + body + "\n  " + "\n  ".join(self.failures[:12]) + f"\n  repro: {self.repro()}"


def run_case(seed: int, refs, n_requests: int = 24, max_steps: int = 5000) -> CaseResult:
    """One seeded case through the engine; every problem found lands in `failures` (an exception
    ends the case there)."""
    t0 = time.perf_counter()
    cfg, knobs, specs, eos, ctx = draw_case(seed, refs, n_requests)
    res = CaseResult(seed, cfg.describe(), len(specs), requests_asked=n_requests)
    try:
        _drive(cfg, knobs, specs, eos, ctx, refs, res, max_steps)
    except Exception as e:  # noqa: BLE001 - a crash is the finding
        tb = traceback.format_exc().strip().splitlines()
        res.failures.append(f"raised {type(e).__name__}: {e} | " + " | ".join(tb[-6:]))
    res.seconds = time.perf_counter() - t0
    return res


def _drive(cfg, knobs, specs, eos, ctx, refs, res: CaseResult, max_steps: int) -> None:
    from engine_utils import make_llm

    llm = make_llm(refs.pairs[cfg.target], cfg.algorithm, **dict(cfg.kwargs))
    engine = llm.engine
    # fault isolation turns an exception into a failed (aborted) request and goes on: every
    # isolated failure is a finding, with what the engine logged about it
    logged = _LogTap()
    logging.getLogger("ddtree").addHandler(logged)
    try:
        _steps(engine, cfg, knobs, specs, eos, ctx, refs, res, max_steps, logged)
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


def _steps(engine, cfg, knobs, specs, eos, ctx, refs, res, max_steps, logged) -> None:
    from fuzz_checks import cached_state_problems, check_request
    from fuzz_oracle import TextOf

    from ddtree.engine import integrity

    assert engine.max_context == ctx, (engine.max_context, ctx)
    if eos is not None:
        engine.emitter.eos_ids = eos
    eos = engine.emitter.eos_ids
    text_of = TextOf(engine.tokenizer)
    reqs: list = [None] * len(specs)
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
        while ab < len(aborts) and aborts[ab][0] <= step:
            r = reqs[aborts[ab][1]]
            if r is not None and not r.is_finished:
                res.stats["abort_" + ("running" if r.slot >= 0 else "waiting")] += 1
                engine.abort(r.rid)
                res.failures += integrity.finished_problems(r)
            ab += 1
        advanced = engine.step()
        res.steps, step = res.steps + 1, step + 1
        bad = integrity.problems(engine, deep=True)
        faults = engine.faults.stats
        if faults.isolated or faults.batch_failures:
            bad.append(f"engine faults {faults}: " + " || ".join(logged.lines[-3:]))
        for r in advanced:
            if r.is_finished:
                bad += integrity.finished_problems(r)
        if bad:
            res.failures += [f"step {step}: {b}" for b in bad]
            return
        if res.steps > max_steps:
            res.failures.append(f"no drain after {max_steps} steps")
            return
    res.failures += [f"drained: {b}" for b in integrity.drained_problems(engine, deep=True)]
    ref_runner = refs.llm(cfg.target).engine.runner
    res.failures += [f"drained: {b}" for b in cached_state_problems(engine, ref_runner)]
    conts = refs.get(cfg.target, [s.prompt for s in specs])
    spec_run = cfg.algorithm != "NONE"
    for i, (s, r) in enumerate(zip(specs, reqs)):
        bad = check_request(r, conts[s.prompt], text_of, ctx, eos, res.stats)
        if r.error is not None:
            bad.append(f"failed: {r.error}")
        if s.twin_of is not None:
            t = reqs[s.twin_of]
            if "abort" not in (r.finish_reason, t.finish_reason) and r.output_ids != t.output_ids:
                bad.append(
                    f"seeded twin of request {s.twin_of} differs: {r.output_ids} vs {t.output_ids}"
                )
        res.failures += [f"request {i} {s.prompt} {s.params}: {b}" for b in bad]
        _count(res, r, spec_run)
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

    from ddtree.train.toy import build_toy_hybrid_pair, build_toy_pair

    root = os.environ.get("DDTREE_CACHE") or tempfile.mkdtemp(prefix="ddtree_fuzz_")
    return {
        "dense": build_toy_pair(os.path.join(root, "toy_pair")),
        "hybrid": build_toy_hybrid_pair(os.path.join(root, "toy_hybrid_pair")),
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
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from fuzz_oracle import References

    refs = References(toy_pairs())
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
