"""Does mixing rungs cost acceptance? The offline engine with the budget policy replaced by a
random rung per round (no selection: each round's rung is drawn before its draft is seen), and
the fixed servers of the same rungs, on the same prompts: each rung's realised τ (tokens per
request-round, global) in the mix against its fixed server's. On the H200 auto's main rung
realised less than the fixed server of that rung (tree32 at concurrency 4: 8.48 vs 9.07,
BENCHMARKS 2026-12-02); equal τ here rules out the mix itself (fp32, the embedded pair) and
leaves selection or bf16.

    PYTHONPATH=. python3 studies/rung_mix_tau.py --conc 4 --prompts 24 --max-tokens 64
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # host_time's prompts and configs

from host_time import Forced, config_kwargs, keep_running, prompts  # noqa: E402

RUNGS = ("16", "32", "64", "chain")


class RandomRung(Forced):
    """A policy stub drawing one of RUNGS for every round (the same for the whole batch)."""

    def __init__(self, chain_depth: int, seed: int = 0):
        super().__init__("+".join(RUNGS), chain_depth)
        self.rng = random.Random(seed)

    def pick(self) -> tuple[bool, int]:
        return self.rng.choice(self.cycle)


def per_rung_tau(name: str, conc: int, n: int, max_tokens: int, mix: bool) -> dict[str, tuple]:
    """{rung: (request-rounds, τ)} of one offline run."""
    from ddtree import LLM, SamplingParams

    llm = LLM(None, device="cpu", max_running_requests=conc, **config_kwargs(name))
    eng = llm.engine
    if mix:
        eng.set_budget_policy(RandomRung(eng.spec.chain_rung))
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    per: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def on_step(advanced, index):
        rec = eng.last_round  # None after a prefill step
        if rec is not None:
            key = rec.rung or ("chain" if name == "DFLASH" else f"tree{rec.width - 1}")
            per[key][0] += len(rec.accepted)
            per[key][1] += sum(rec.accepted)

    keep_running(eng, prompts(eng.tokenizer, n), conc, sp, on_step)
    return {k: (v[0], v[1] / v[0] + 1) for k, v in per.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--conc", type=int, default=4)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    fixed = {}
    for name in ("16", "32", "64", "DFLASH"):
        fixed.update(per_rung_tau(name, a.conc, a.prompts, a.max_tokens, mix=False))
    mixed = per_rung_tau("auto", a.conc, a.prompts, a.max_tokens, mix=True)
    print(f"{'rung':>8} {'fixed τ':>9} {'rounds':>7} {'mixed τ':>9} {'rounds':>7} {'ratio':>6}")
    for k in sorted(mixed, key=lambda k: (k == "chain", k)):
        f, m = fixed.get(k, (0, float("nan"))), mixed[k]
        print(f"{k:>8} {f[1]:>9.3f} {f[0]:>7} {m[1]:>9.3f} {m[0]:>7} {m[1] / f[1]:>6.3f}")


if __name__ == "__main__":
    main()
