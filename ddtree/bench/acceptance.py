"""`ddtree bench acceptance`: mean accepted length τ (tokens per round, bonus included) of DFLASH and
DDTREE over budgets, shadow-linear on/off and temperatures, on held-out prompts; JSON rows + PNG plots."""

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
        help="DFlash drafter dir; default: the embedded pair's",
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
    base, algorithm: str, budget: int, shadow: bool, temperature: float, prompts, max_tokens, seed
):
    from ddtree.engine.engine import LLMEngine
    from ddtree.engine.request import SamplingParams
    from ddtree.server_args import resolve_server_args

    args = resolve_server_args(
        dataclasses.replace(
            base,
            speculative_algorithm=algorithm,
            speculative_ddtree_budget=budget if algorithm == "DDTREE" else None,
            speculative_ddtree_topk_cap=None,
            speculative_ddtree_shadow_linear=shadow,
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
    from ddtree.configs import ConfigError
    from ddtree.server_args import ServerArgs, resolve_server_args

    ns = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        base = resolve_server_args(
            ServerArgs(
                model_path=ns.model_path,
                speculative_algorithm="DFLASH",
                speculative_draft_model_path=ns.speculative_draft_model_path,
                dtype=ns.dtype,
                device=ns.device,
                speculative_dflash_block_size=ns.block_size,
                random_seed=ns.seed,
            )
        )
    except ConfigError as e:
        print(f"error: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    if ns.output:  # made before the run, so a long benchmark never ends unable to write its results
        os.makedirs(os.path.dirname(os.path.abspath(ns.output)), exist_ok=True)
    prompts = load_prompts(ns.prompts_file)
    budgets = [int(b) for b in ns.budgets.split(",") if b]
    shadows = [s.strip() == "on" for s in ns.shadow_linear.split(",") if s.strip()]
    temps = [float(t) for t in ns.temperature.split(",") if t]
    rows, hists = [], {}
    print(
        f"{'algorithm':>9} {'B':>4} {'shadow':>6} {'T':>4} {'tau':>6} {'rounds':>6} {'tokens':>6}"
    )
    for temp in temps:
        configs = [("DFLASH", 0, False)] + [("DDTREE", b, s) for b in budgets for s in shadows]
        for algo, budget, shadow in configs:
            row, lengths = measure(
                base, algo, budget, shadow, temp, prompts, ns.max_tokens, ns.seed
            )
            rows.append(row)
            label = (
                f"{algo} B={budget} {'shadow ' if shadow else ''}T={temp}"
                if algo == "DDTREE"
                else f"DFLASH T={temp}"
            )
            hists[label] = lengths
            print(
                f"{algo:>9} {budget or '-':>4} {str(shadow):>6} {temp:>4} {row['tau']:>6.2f} {row['rounds']:>6} "
                f"{row['tokens']:>6}",
                flush=True,
            )
    with open(ns.output, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    from ddtree.bench.plots import accept_histograms, tau_vs_budget

    stem = os.path.splitext(ns.output)[0]
    tau_vs_budget(rows, stem + "_tau.png")
    accept_histograms({k: v for k, v in hists.items() if v}, stem + "_hist.png")
    print(f"wrote {ns.output}, {stem}_tau.png, {stem}_hist.png")
    return 0
