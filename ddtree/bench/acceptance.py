"""`ddtree bench acceptance`: mean accepted length τ (tokens per round, bonus included) of DFLASH and
DDTREE over budgets, shadow-linear on/off and temperatures, on held-out prompts; JSON rows + PNG plots.
Several drafters (a comma list) make one table; a DFlash2 drafter's DDTREE rows come per tree
(`--dflash2-trees`: the path-conditioned tree and/or DDTree over its unary marginals), and the
summary gives each drafter's best DDTREE τ over its own DFLASH chain's."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

DEFAULT_PROMPTS = (  # held-out code prompts: modules the embedded pair's corpus leaves out
    "import json\n\n\ndef load_config(path):\n",
    'class LRUCache:\n    """A least-recently-used cache."""\n\n    def __init__(self, capacity):\n',
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "    def __repr__(self):\n        return",
    "import os\nimport sys\n\n\ndef main():\n",
    "def _check_type(value, expected):\n    if not isinstance(value, expected):\n        raise TypeError(",
    "for key, value in sorted(mapping.items()):\n",
    "    @property\n    def name(self):\n",
)


def make_parser() -> argparse.ArgumentParser:
    from ddtree.bench.cli import DefaultsFormatter

    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="ddtree bench acceptance", formatter_class=DefaultsFormatter
    )
    p.add_argument("--model-path", default=None, help="target dir; default: the embedded pair")
    p.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="DFlash / DFlash2 drafter dir, or a comma list of them (one table); default: the "
        "embedded pair's",
    )
    p.add_argument(
        "--dflash2-trees",
        default="path,marginal",
        help="DDTREE over a DFlash2 drafter, comma list: path (path-conditioned: children scored "
        "under their parent's token) and/or marginal (DDTree over the unary marginals)",
    )
    p.add_argument(
        "--prompts-file", help='JSONL, one {"prompt": ...} per line; default: a built-in set'
    )
    p.add_argument("--budgets", default="8,16,32,64,128,256", help="comma list of DDTREE budgets")
    p.add_argument("--shadow-linear", default="off,on", help="comma list of off/on")
    p.add_argument("--temperature", default="0,1", help="comma list")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (EOS off)")
    p.add_argument(
        "--block-size", type=int, default=None, help="drafter block size; default: the drafter's"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i: seed + i")
    p.add_argument("--dtype", default="auto", help="as ddtree serve --dtype")
    p.add_argument("--device", default="auto", help="as ddtree serve --device")
    p.add_argument(
        "--output", default="acceptance.json", help="JSON rows; PNGs are written beside it"
    )
    return p


def load_prompts(path: str | None) -> list:
    if not path:
        return list(DEFAULT_PROMPTS)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def measure(
    base,
    algorithm: str,
    budget: int,
    shadow: bool,
    temperature: float,
    prompts,
    max_tokens,
    seed,
    tree: str | None = None,
):
    from ddtree.config import resolve_server_args
    from ddtree.engine.engine import LLMEngine
    from ddtree.engine.scheduling.request import SamplingParams

    args = resolve_server_args(
        dataclasses.replace(
            base,
            speculative_algorithm=algorithm,
            speculative_ddtree_budget=budget if algorithm == "DDTREE" else None,
            speculative_ddtree_topk_cap=None,
            speculative_ddtree_shadow_linear=shadow,
            speculative_ddtree_dflash2_tree=tree if algorithm == "DDTREE" else None,
        )
    )
    engine = LLMEngine(args)
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed + i, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params)
    lengths = [n for r in reqs for n in r.stats.accept_lengths]
    row = {
        "algorithm": algorithm,
        "budget": budget if algorithm == "DDTREE" else None,
        "shadow_linear": shadow,
        "temperature": temperature,
        "tau": sum(lengths) / max(len(lengths), 1),
        "rounds": len(lengths),
        "tokens": sum(r.num_output_tokens for r in reqs),
        "seconds": time.perf_counter() - t0,
    }
    return row, lengths


def main(argv: list[str]) -> int:
    from ddtree.config import ServerArgs, resolve_server_args
    from ddtree.models.configs import ConfigError

    ns = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    paths = (ns.speculative_draft_model_path or "").split(",")
    bases = []
    try:
        for path in paths:
            bases.append(
                resolve_server_args(
                    ServerArgs(
                        model_path=ns.model_path,
                        speculative_algorithm="DFLASH",
                        speculative_draft_model_path=path or None,
                        dtype=ns.dtype,
                        device=ns.device,
                        speculative_dflash_block_size=ns.block_size,
                        random_seed=ns.seed,
                    )
                )
            )
    except ConfigError as e:
        print(f"error: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    trees = [t.strip() for t in ns.dflash2_trees.split(",") if t.strip()]
    if not trees or set(trees) - {"path", "marginal"}:
        print(
            f"error: --dflash2-trees {ns.dflash2_trees!r}: use path and/or marginal",
            file=sys.stderr,
        )
        return 2
    if ns.output:  # made before the run, so a long benchmark never ends unable to write its results
        os.makedirs(os.path.dirname(os.path.abspath(ns.output)), exist_ok=True)
    prompts = load_prompts(ns.prompts_file)
    budgets = [int(b) for b in ns.budgets.split(",") if b]
    shadows = [s.strip() == "on" for s in ns.shadow_linear.split(",") if s.strip()]
    temps = [float(t) for t in ns.temperature.split(",") if t]
    rows, hists = [], {}
    many = len(bases) > 1
    print(
        f"{'drafter':>14} {'algorithm':>9} {'tree':>8} {'B':>4} {'shadow':>6} {'T':>4} {'tau':>6} "
        f"{'rounds':>6} {'tokens':>6}"
    )
    for base in bases:
        d = base.drafter_config
        name = ("DFlash2" if d.is_dflash2 else "DFlash") + (
            f" ({os.path.basename(os.path.normpath(base.speculative_draft_model_path))})"
            if many
            else ""
        )
        for temp in temps:
            configs = [("DFLASH", 0, False, None)] + [
                ("DDTREE", b, s, t)
                for t in (trees if d.is_dflash2 else [None])
                for b in budgets
                for s in shadows
            ]
            for algo, budget, shadow, tree in configs:
                row, lengths = measure(
                    base, algo, budget, shadow, temp, prompts, ns.max_tokens, ns.seed, tree
                )
                row.update(drafter=name, tree=tree)
                rows.append(row)
                label = (
                    f"{algo} B={budget} {'shadow ' if shadow else ''}T={temp}"
                    if algo == "DDTREE"
                    else f"DFLASH T={temp}"
                )
                hists[f"{name} {tree or ''} {label}" if many or tree else label] = lengths
                print(
                    f"{name:>14} {algo:>9} {tree or '-':>8} {budget or '-':>4} {str(shadow):>6} "
                    f"{temp:>4} {row['tau']:>6.2f} {row['rounds']:>6} {row['tokens']:>6}",
                    flush=True,
                )
    for line in summary(rows):
        print(line)
    with open(ns.output, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    from ddtree.bench.plots import accept_histograms, tau_vs_budget

    stem = os.path.splitext(ns.output)[0]
    tau_vs_budget(rows, stem + "_tau.png")
    accept_histograms({k: v for k, v in hists.items() if v}, stem + "_hist.png")
    print(f"wrote {ns.output}, {stem}_tau.png, {stem}_hist.png")
    return 0


def summary(rows: list[dict]) -> list[str]:
    """Per drafter, tree and temperature: the best DDTREE τ and its ratio to the drafter's own DFLASH
    chain."""
    out = []
    chains = {
        (r["drafter"], r["temperature"]): r["tau"] for r in rows if r["algorithm"] == "DFLASH"
    }
    best: dict[tuple, dict] = {}
    for r in rows:
        if r["algorithm"] != "DDTREE":
            continue
        key = (r["drafter"], r["tree"], r["temperature"])
        if key not in best or r["tau"] > best[key]["tau"]:
            best[key] = r
    for (drafter, tree, temp), r in best.items():
        chain = chains.get((drafter, temp))
        if chain:
            shadow = " shadow" if r["shadow_linear"] else ""
            out.append(
                f"{drafter} {tree or ''} T={temp}: best DDTREE B={r['budget']}{shadow} "
                f"tau {r['tau']:.2f} = {r['tau'] / chain:.2f}x its DFLASH chain ({chain:.2f})"
            )
    return out
