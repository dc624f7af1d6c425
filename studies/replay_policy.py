"""auto's budget policy replayed on real drafts: the rounds `studies/counterfactual_rungs.py`
recorded (the embedded pair, B=64, with every rung's accept inferred and each round's full gain
curve) fed to `BudgetPolicy` as the planner feeds it, under the 8B shape's served round costs on
the H200 (BENCHMARKS, 2026-12-02), against every fixed rung on the same rounds.

Each slot of a batch replays one recorded request round by round (a finished one is replaced by
the next recording, a new owner); the policy picks one rung per round for the batch, learns from
that rung's curve (read back up to the rung it built) and accept, and its cost from the served
seconds (the profile 12% under them, as the H200's replays run under served rounds). A round's
position does not move with the rung chosen (what the recording allows); the chain's accept is a
lower bound where the recording censored it (8% of rows).

    PYTHONPATH=. python3 studies/counterfactual_rungs.py --prompts 96 --conc 8 --output cf.json
    PYTHONPATH=. python3 studies/replay_policy.py cf.json --batches 1,4,8,16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from counterfactual_rungs import MS as SERVED_MS  # noqa: E402
from host_time import H200_CONC, H200_MS  # noqa: E402

RUNG_NAMES = ("ar", "tree8", "chain", "tree16", "tree32", "tree64")
LADDER, CHAIN, CAP, MAX_TOKENS = (0, 8, 16, 32, 64), 15, 64, 128
# served ms per rung in `rungs` order (AR, tree8, chain, tree16, tree32, tree64): the fixed
# servers' /metrics at the 8B shape (counterfactual_rungs.MS), AR from host_time's H200 table
MS = {
    bs: (H200_MS[1][H200_CONC.index(bs)], *(SERVED_MS[bs][n] for n in RUNG_NAMES[1:]))
    for bs in SERVED_MS
}


def observe_round(pol, slots, d, rows: list[dict], accepted, full) -> None:
    """Feed `pol` a recorded round as `BudgetPlanner` does: the tree's curve read back up to the
    rung it built (its edge value past it; none for a chain round), every row's chain gain, and
    the drafts accepted. rows: the round's records (`curve64`, `chain_pred`); d: the decision."""
    if d.width <= 1:  # AR: nothing drafted, nothing to learn
        return
    budgets = np.asarray(d.budgets)
    curves = None
    if not d.chain:
        built = LADDER[int(np.searchsorted(LADDER, budgets.max()))]
        c = np.array([row["curve64"] for row in rows])
        curves = np.concatenate(
            [c[:, :built], np.repeat(c[:, built - 1 : built], CAP - built, 1)], 1
        )
    chain = np.array([row["chain_pred"] for row in rows])
    pol.observe_accepted(pol.observe_curves(slots, budgets, curves, chain, full), accepted)


def requests(rows: list[dict]) -> list[list[dict]]:
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["rid"], []).append(r)
    return [sorted(v, key=lambda r: r["round"]) for v in by.values()]


def replay(reqs: list[list[dict]], bs: int, rounds: int, seed: int = 0) -> dict:
    from ddtree.engine.budget.policy import BudgetPolicy, CostTable, ServedCost, rung_name, rungs

    rng = np.random.default_rng(seed)
    names = [rung_name(b, c) for b, c in rungs(LADDER, CHAIN)]
    assert tuple(names) == RUNG_NAMES  # MS's column order
    true = np.array(MS[bs]) / 1e3
    table = np.array([[np.array(MS[b]) / 1e3 * 0.88] for b in sorted(MS)])
    cost = ServedCost(CostTable(LADDER, tuple(sorted(MS)), (4096,), table, chain=CHAIN))
    pol = BudgetPolicy(LADDER, cost, bs, CHAIN)
    order = rng.permutation(len(reqs))
    nxt = 0
    slots, owners = np.arange(bs), [None] * bs
    cur, at = [None] * bs, [0] * bs
    for i in range(bs):  # staggered: each slot starts at a random round of its request
        cur[i], owners[i] = reqs[order[nxt % len(order)]], object()
        at[i] = int(rng.integers(0, len(cur[i])))
        nxt += 1
    tok, sec = 0.0, 0.0
    fixed_tok, fixed_sec = np.zeros(len(names)), np.zeros(len(names))
    picks: dict[str, int] = {}
    for _ in range(rounds):
        rows = [cur[i][at[i]] for i in range(bs)]
        d = pol.choose(slots, owners, [CAP] * bs, 1024)
        r = d.rung
        acc = np.array(
            [[0] + row["accept"][:1] + [row["chain"]] + row["accept"][1:] for row in rows]
        )
        # columns: ar, tree8, chain, tree16, tree32, tree64 (the rung order)
        full = [MAX_TOKENS - row["pos"] > 16 for row in rows]
        observe_round(pol, slots, d, rows, acc[:, r], full)
        cost.observe(bs, 1024, r, true[r] * rng.lognormal(0.0, 0.03))
        gained = acc.sum(0) + bs
        tok += gained[r]
        sec += true[r]
        fixed_tok += gained
        fixed_sec += true
        picks[names[r]] = picks.get(names[r], 0) + 1
        for i in range(bs):
            at[i] += 1
            if at[i] >= len(cur[i]):
                cur[i], owners[i], at[i] = reqs[order[nxt % len(order)]], object(), 0
                nxt += 1
    fixed = fixed_tok / fixed_sec
    return {
        "batch": bs,
        "of_best": float(tok / sec / fixed.max()),
        "best": names[int(np.argmax(fixed))],
        "fixed_over_chain": dict(
            zip(names, (fixed / fixed[names.index("chain")]).round(3).tolist())
        ),
        "picks": picks,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("rows", help="counterfactual_rungs.py --output JSON (with curve64)")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args(argv)
    with open(a.rows, encoding="utf-8") as f:
        reqs = requests(json.load(f)["rows"])
    if "curve64" not in reqs[0][0]:
        print("error: the rows have no curve64; rerun counterfactual_rungs.py", file=sys.stderr)
        return 2
    for bs in (int(x) for x in a.batches.split(",")):
        got = [replay(reqs, bs, a.rounds, seed=s) for s in range(a.seeds)]
        of = [g["of_best"] for g in got]
        print(
            f"batch {bs:>3}: auto {np.mean(of):.3f} of the best fixed rung ({got[0]['best']}; "
            f"min {min(of):.3f}), picks {got[0]['picks']}, fixed / chain {got[0]['fixed_over_chain']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
