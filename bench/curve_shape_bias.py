"""Is the server-wide curve that auto's decisions rate (`CurveShape.base` times the mean chain
gain, `BudgetPolicy._decision_curves`) the mean of the curves the drafter really drafts? The
offline engine, auto, batch 1, the embedded pair (CPU, fp32): per prompt, the server-wide curve
against an EMA (the policy's own weight, PRIOR_EMA per row) of the full-depth rows' curves, and
auto's calibrated predicted accept length against the realised one.

    PYTHONPATH=. python3 bench/curve_shape_bias.py --prompts 12 --max-tokens 96
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from host_time import keep_running, prompts  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=96)
    a = p.parse_args(argv)
    import torch

    from ddtree import LLM, SamplingParams
    from ddtree.engine.budget_shape import PRIOR_EMA

    torch.set_num_threads(2)
    eng = LLM(
        None,
        device="cpu",
        max_running_requests=1,
        speculative_algorithm="DDTREE",
        speculative_ddtree_budget="auto",
    ).engine
    pol = eng.decoder.budgets.policy
    seen = {"ema": None}
    learn = pol.observe_curves

    def observe_curves(slots, budgets, curves, chain=None, full=None):
        if curves is not None and (full is None or all(full)):
            c = np.asarray(curves, dtype=np.float64)[0, :16]
            e = seen["ema"]
            seen["ema"] = c if e is None else (1 - PRIOR_EMA) * e + PRIOR_EMA * c
        return learn(slots, budgets, curves, chain, full)

    pol.observe_curves = observe_curves
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    ratios, pred, real = [], [], []
    print(f"{'prompt':>6} {'base/mean, budget 1':>20} {'budget 8':>9} {'budget 16':>10}")

    def on_step(advanced, index):
        rec = eng.last_round
        if rec is not None and rec.predicted:
            pred.append(rec.predicted[0])
            real.append(rec.accepted[0])

    for i, ids in enumerate(prompts(eng.tokenizer, a.prompts)):
        keep_running(eng, [ids], 1, sp, on_step)  # one prompt, then its curves
        if pol.prior_chain is None or seen["ema"] is None:
            continue
        base = pol.shape.base(np.array([pol.prior_chain]))
        if base is None:
            continue
        r = base[0, :16] / seen["ema"]
        ratios.append(r)
        print(f"{i:>6} {r[0]:>20.3f} {r[7]:>9.3f} {r[15]:>10.3f}")
    m = np.mean(ratios, 0)
    print(f"{'mean':>6} {m[0]:>20.3f} {m[7]:>9.3f} {m[15]:>10.3f}")
    print(f"predicted accepted drafts {np.mean(pred):.2f}, realised {np.mean(real):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
