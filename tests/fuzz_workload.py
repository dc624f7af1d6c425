"""The differential fuzzer's generator (tests/fuzz_engine.py runs it): one seed -> one `Case`, an
engine config and a request workload.

Config: the kind cycles with the seed (`KINDS`: dense / hybrid toy target; AR, DFLASH, DDTREE at a
fixed budget or `auto`; both mamba strategies; half the dense `auto` cases under random batch-wide
budgets: unequal shares in one round, requests capped at 0 beside deep trees, dense rounds between),
the knobs are drawn: page size 1-16, prefix cache on / off, running slots, chunked prefill, a short
context, and a KV pool from roomy to one the largest request only just fits alone (eviction and preemption).

Workload: prompt families with shared prefixes (the same prompt, a prefix, a fork, the prompt run
into its own AR continuation, so pages a decode wrote are hit), stop ids and stop strings drawn from
the model's continuations (so they fall inside accepted blocks), EOS declared on a token the model
emits (the toy corpus has none), `n` copies, log-probs, max_tokens at and around block boundaries,
per-request budget caps, greedy and sampled (seeded ones must draw AR's tokens for their seed, and
seeded twins agree, under `auto` too), arrivals at random
steps, aborts at random steps or at a random output position, and in some cases one request whose
batched step, prefill or emission raises (`Fault`: fault isolation must fail it alone). A third of the
speculative cases draft with a DFlash2 drafter (the selector chain, the path-conditioned tree) where one
is given for the target, and a fifth of the cases serve the target (and drafter) quantized to block
FP8 at load, against the FP8 target's own AR (with FP8's tolerances: tests/fuzz_checks.py). Some greedy
requests carry a grammar (a regex or a choice over the toy words "4" .. "63", drawn from a stream of
their own so every other draw of a seed stays what it was): checked against AR's own run of the same
parameters, since the stop-rule oracle does not model grammars.
"""

from __future__ import annotations

import dataclasses
import random

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
GRAMMAR_SHARE = 0.2  # of the greedy requests of a case that may carry grammars
DFLASH2_SHARE = 0.3  # of the speculative cases, when a DFlash2 drafter is given for the target
FP8_SHARE = 0.2  # of the cases: the target (and drafter) quantized to block FP8 at load
# of the cases: the CUDA graphs' padded static path attached uncaptured (what a GPU replays:
# every phase on the graphs' buffers, batches past GRAPH_MAX_BS eager)
GRAPH_SHARE = 0.3
GRAPH_MAX_BS = 4
FP8_KWARGS = {"quantization": "fp8", "speculative_draft_quantization": "fp8"}
# over the toy vocabulary (the words "4" .. "63"; a grammar reads the words' own bytes): ones
# that end early, late or never, and one whose first word the model rarely picks
REGEXES = ("[0-9]{2,12}", "(1|2|3)[0-9]*", "[4-9]+", "(4|5|6|7|8|9)(1|2|3|4)+", "[0-9]*")
CHOICES = (("456", "1011", "2030405"), ("63", "6162"))


@dataclasses.dataclass(frozen=True)
class Config:
    target: str
    algorithm: str
    kwargs: tuple  # LLM keyword arguments, sorted (key, value) pairs
    drafter: str = "dflash"  # the drafter format: "dflash" or "dflash2"
    # dense `auto`: a random batch-wide budget every round (fuzz_engine.RandomPacking), in place
    # of the policy's own choice
    packing: bool = False
    graphs: bool = False  # the graphs' static path, uncaptured (GRAPH_MAX_BS)

    def describe(self) -> str:
        kw = " ".join(f"{k}={v}" for k, v in self.kwargs)
        drafter = " drafter=dflash2" if self.drafter == "dflash2" else ""
        packing = " packing=random" if self.packing else ""
        graphs = " graphs=static" if self.graphs else ""
        return f"{self.target} {self.algorithm}{drafter}{packing}{graphs} {kw}"


@dataclasses.dataclass
class Spec:
    prompt: tuple[int, ...]
    params: object  # SamplingParams
    arrive: int  # the step it is added before
    abort_at: int | None = None  # the step it is aborted before
    abort_after: int | None = None  # or: aborted once it has this many output tokens
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
    if rng.random() < 0.15:  # vLLM's: the stop string / stop token's text stays in the output
        kw["include_stop_str_in_output"] = True
    if rng.random() < 0.1:
        kw["skip_special_tokens"] = False
        kw["spaces_between_special_tokens"] = rng.random() < 0.5
    if rng.random() < 0.25:
        kw.update(logprobs=True, top_logprobs=rng.choice([0, 1, 2, 5]))
    if algorithm == "DDTREE" and rng.random() < 0.15:
        kw["ddtree_budget"] = rng.randint(1, knobs["budget"])
    return SamplingParams(**kw)


@dataclasses.dataclass(frozen=True)
class Fault:
    """Request `victim` raises once it has `after` output tokens, wherever it is: in a decoding
    round's batch ("round"), a prefill batch ("prefill") or its own emission ("emit")."""

    where: str
    victim: int
    after: int


@dataclasses.dataclass
class Case:
    cfg: Config
    knobs: dict
    specs: list[Spec]
    eos: tuple[int, ...] | None  # declared EOS ids (None: the model's)
    ctx: int  # the context length
    fault: Fault | None = None


def draw_case(seed: int, refs, n_requests: int, extras: bool = True) -> Case:
    """The seed's config and workload. `extras`: the dimensions added after the regression seeds
    were found (grammars, DFlash2 drafters, FP8), drawn from streams of their own; without them a seed
    draws what it always drew."""
    from ddtree.config import ServerArgs, resolve_server_args
    from ddtree.engine.config import spec_config

    rng = random.Random(seed)
    cfg, knobs = draw_config(seed, rng)
    if extras and cfg.algorithm != "NONE" and cfg.target in refs.dflash2:
        if random.Random(seed * 104729 + 3).random() < DFLASH2_SHARE:
            cfg = dataclasses.replace(cfg, drafter="dflash2")
    if extras and random.Random(seed * 15485863 + 5).random() < FP8_SHARE:
        # the FP8 model is the served one: its own AR is the reference (`References`, ":fp8")
        fp8 = dict(FP8_KWARGS) if cfg.algorithm != "NONE" else {"quantization": "fp8"}
        kwargs = tuple(sorted({**dict(cfg.kwargs), **fp8}.items()))
        cfg = dataclasses.replace(cfg, target=cfg.target + ":fp8", kwargs=kwargs)
    auto = dict(cfg.kwargs).get("speculative_ddtree_budget") == "auto"
    if extras and auto and cfg.target.startswith("dense") and (seed // len(KINDS)) % 2 == 0:
        cfg = dataclasses.replace(cfg, packing=True)  # half the dense auto cases, the other half
        # under the policy's own choice (which packs where its cost model says so)
    if extras and random.Random(seed * 32452843 + 11).random() < GRAPH_SHARE:
        cfg = dataclasses.replace(cfg, graphs=True)
    pair = refs.pair(cfg.target, cfg.drafter)
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
            abort = arrive + rng.randint(0, 15) if rng.random() < 0.08 else None
            specs.append(Spec(prompt, p, arrive, abort))
            if rng.random() < 0.08:  # at a position of its output: inside a block, mid-decode
                specs[-1].abort_after = rng.randint(1, max(1, p.max_tokens - 1))
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
    if extras and eos is None and "context_length" not in kw:
        # AR's run of the same parameters is their reference: the same EOS and context
        _draw_grammars(random.Random(seed * 7919 + 17), specs)
    cfg = dataclasses.replace(cfg, kwargs=tuple(sorted(kw.items())))
    fault = None
    if rng.random() < 0.3:
        where = rng.choice(["round", "prefill", "emit"])
        victim = rng.randrange(len(specs))
        last = specs[victim].params.max_tokens - 1  # a position it reaches while running
        after = 0 if where == "prefill" else rng.randint(min(1, last), max(last, 0))
        fault = Fault(where, victim, after)
    if extras and not knobs["fixed"]:  # appended last: the draws above stay what they were
        _draw_auto_twins(random.Random(seed * 6700417 + 11), specs)
    return Case(cfg, knobs, specs, eos, ctx, fault)


def _draw_auto_twins(rng: random.Random, specs: list[Spec]) -> None:
    """Seeded twins under `auto` (issue 54): the policy's budgets change with the load between the
    twins' rounds, their tokens must not (sampling is keyed by seed and position)."""
    for i, s in enumerate(list(specs)):
        sampled = s.params.seed is not None and not s.params.greedy and s.twin_of is None
        if sampled and rng.random() < 0.6:
            specs.append(Spec(s.prompt, s.params, s.arrive + rng.randint(1, 20), twin_of=i))


def _draw_grammars(rng: random.Random, specs: list[Spec]) -> None:
    from ddtree.grammar import GrammarSpec

    for s in specs:
        if s.params.greedy and s.twin_of is None and rng.random() < GRAMMAR_SHARE:
            if rng.random() < 0.75:
                g = GrammarSpec.regex(rng.choice(REGEXES))
            else:
                g = GrammarSpec.choice(list(rng.choice(CHOICES)))
            s.params = dataclasses.replace(s.params, grammar=g)
