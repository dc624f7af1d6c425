"""Grammar inside speculation, offline: tau (tokens per round), output tokens/s, round ms and the
host ms the grammar rows add per round, per algorithm x output format x concurrency, in one run.

Formats: `text` (no grammar), `json` (bench serving's default schema, forced stretches drafted at
log-prob 0: what the engine does) and `json-raw` (the same schema with the trees built unforced,
`build_grammar_tree(forced=False)`: the drafter's raw log-probs, no forced token it missed).
The same prompts for every row; T=0; `== AR`: the outputs equal to AR's (the first algorithm, AR
by default) in the same format and batching (all of them in fp32; bf16 may differ at near-ties).

  PYTHONPATH=. python3 studies/grammar_rounds.py --device cpu            # the embedded pair
  PYTHONPATH=. python3 studies/grammar_rounds.py --device cuda --model-path inflate:qwen3-8b
"""

from __future__ import annotations

import argparse
import functools
import json
import time

ALGORITHMS = {
    "AR": ("NONE", {}),
    "DFLASH": ("DFLASH", {}),
    "DDTREE16": ("DDTREE", {"speculative_ddtree_budget": 16}),
    "DDTREE64": ("DDTREE", {"speculative_ddtree_budget": 64}),
    "auto": ("DDTREE", {"speculative_ddtree_budget": "auto"}),
}
FORMATS = ("text", "json", "json-raw")
TOPICS = ("the weather", "a football match", "a new telescope", "a book", "a city", "a recipe")


def prompts(tok, n: int) -> list:
    out = []
    for i in range(n):
        ask = f"Describe {TOPICS[i % len(TOPICS)]} (item {i}) as a JSON object."
        if tok is not None and getattr(tok, "chat_template", None):
            out.append(
                tok.apply_chat_template(
                    [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
                )
            )
        else:
            out.append(ask + "\n")
    return out


def run(llm, ps, fmt: str, max_tokens: int, concurrency: int) -> dict:
    from ddtree import SamplingParams
    from ddtree.bench.serving import BENCH_SCHEMA
    from ddtree.engine.round import grammar as grammar_round
    from ddtree.grammar import GrammarSpec
    from ddtree.grammar.tree import build_grammar_tree

    # the engine always forces; json-raw's rounds build their trees unforced (the mask threads
    # look the builder up per tree: set for this run's rounds)
    grammar_round.build_grammar_tree = functools.partial(
        build_grammar_tree, forced=fmt != "json-raw"
    )
    grammar = None if fmt == "text" else GrammarSpec.json_schema(BENCH_SCHEMA)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, grammar=grammar)
    eng = llm.engine
    llm.generate(ps[:1], sp)  # compile the grammar, warm the shapes
    rounds, round_s, grammar_s, tokens, accepts, outs = 0, 0.0, 0.0, 0, [], []
    t0 = time.perf_counter()
    for i in range(0, len(ps), concurrency):  # closed batches of `concurrency`
        reqs = [eng.add_request(p, sp) for p in ps[i : i + concurrency]]
        while any(not r.is_finished for r in reqs):
            eng.step()
            rec = eng.last_round
            if rec is not None:
                rounds += 1
                round_s += rec.timing.round_s
                grammar_s += rec.timing.grammar_s or 0.0
        tokens += sum(r.num_output_tokens for r in reqs)
        outs += [list(r.output_ids) for r in reqs]
        accepts += [a for r in reqs for a in r.stats.accept_lengths]
    wall = time.perf_counter() - t0
    return {
        "tau": sum(accepts) / max(len(accepts), 1),
        "tok_s": tokens / wall,
        "round_ms": 1e3 * round_s / max(rounds, 1),
        "grammar_ms": 1e3 * grammar_s / max(rounds, 1),
        "tokens": tokens,
        "outputs": outs,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--model-path", default=None, help="target (or inflate:SHAPE); default: embedded"
    )
    p.add_argument("--draft-model-path", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--algorithms", nargs="+", default=["AR", "DFLASH", "DDTREE16", "auto"])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--output", default=None, help="JSON rows")
    ns = p.parse_args(argv)
    from ddtree import LLM
    from ddtree.assets import default_model_paths

    target, drafter = ns.model_path, ns.draft_model_path
    if target is None:
        target, drafter = default_model_paths()
    dtype = ns.dtype or ("float32" if ns.device == "cpu" else "bfloat16")
    rows = []
    print(
        f"{'algorithm':>9} {'format':>8} {'conc':>4} {'tau':>6} {'tok/s':>8} {'round ms':>9} "
        f"{'grammar ms':>10} {'== AR':>7}"
    )
    ar: dict = {}  # (format, concurrency) -> the first algorithm's outputs
    for name in ns.algorithms:
        algorithm, kw = ALGORITHMS[name]
        if algorithm != "NONE" and drafter is not None:
            kw = dict(kw, speculative_draft_model_path=drafter)
        llm = LLM(
            target,
            speculative_algorithm=algorithm,
            device=ns.device,
            dtype=dtype,
            max_running_requests=max(ns.concurrency),
            **kw,
        )
        ps = prompts(llm.engine.tokenizer, ns.num_prompts)
        for fmt in ns.formats:
            if name == "AR" and fmt == "json-raw":
                continue  # forcing only shapes drafts
            for c in ns.concurrency:
                r = run(llm, ps, fmt, ns.max_tokens, c)
                ref = ar.setdefault((fmt.removesuffix("-raw"), c), r["outputs"])
                same = sum(a == b for a, b in zip(ref, r["outputs"]))
                r["same_as_ar"] = f"{same}/{len(ref)}"
                rows.append({"algorithm": name, "format": fmt, "concurrency": c, **r})
                print(
                    f"{name:>9} {fmt:>8} {c:>4} {r['tau']:>6.2f} {r['tok_s']:>8.1f} "
                    f"{r['round_ms']:>9.2f} {r['grammar_ms']:>10.2f} {r['same_as_ar']:>7}",
                    flush=True,
                )
        del llm
    if ns.output:
        with open(ns.output, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
