"""Every rung's accept at every position, and the trajectories they make: the offline engine runs
DDTREE at the cap (B=64, T=0, fp32, the embedded pair) with each round's accept cut to the bonus
token, so its rounds start at every position of the greedy continuation in turn; each round's
B=64 walk gives every smaller tree's accept exactly (`counterfactual_rungs.counterfactual`) and
the drafter's top-1 per depth gives the DFLASH chain's (against the continuation: no censoring).

A rung's throughput is not its mean accept over some other rung's positions: a round starts right
after the token the last round missed, and missed tokens cluster, so the chain's own rounds start
at harder positions than a tree's do (`counterfactual_rungs`' rows, taken at B=64's positions,
rate the chain above its own runs). From the table this walks each fixed rung's own trajectory
(checked against the engine's real runs of DFLASH, B=32 and B=64: `--check`) and replays
`BudgetPolicy` over batches of trajectories under the 8B shape's served round costs, against
every fixed rung on the same requests.

    PYTHONPATH=. python3 studies/trajectory_rungs.py --prompt-set heldout --prompts 8 \\
        --output traj.json --check --batches 1,4,8,16
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from counterfactual_rungs import MS, counterfactual, prompt_ids  # noqa: E402
from host_time import keep_running  # noqa: E402
from replay_policy import CAP, CHAIN, RUNG_NAMES, observe_round  # noqa: E402


def record(
    n_prompts: int,
    max_tokens: int,
    prompt_set: str,
    device: str = "cpu",
    dtype: str = "float32",
    model_path: str | None = None,
) -> list[dict]:
    """Per distinct request: its continuation and, per position, every rung's accepted drafts,
    the drafter's curve (budgets 1..64) and chain gain."""
    import torch

    import ddtree.engine.round.decoder as dec
    from ddtree import LLM, SamplingParams
    from ddtree.speculative.accept import AcceptResult

    torch.set_num_threads(2)
    llm = LLM(
        model_path,
        device=device,
        dtype=dtype,
        max_running_requests=n_prompts,
        speculative_algorithm="DDTREE",
        speculative_ddtree_budget=64,
        disable_cuda_graph=True,  # the draft and walk are hooked on the host
    )
    eng = llm.engine
    runner, grab = eng.runner, {}
    draft = runner.draft

    def draft_tree(*a, **kw):
        out = draft(*a, **kw)
        grab["logits"] = out.logits
        return out

    runner.draft = draft_tree
    # without the verify graph every accept walk is the eager one: hooked here
    walk = dec.accept_tree

    def accept_bonus_only(tree, target_tokens):
        res = walk(tree, target_tokens)
        cpu = dataclasses.replace(
            tree,
            **{
                f.name: getattr(tree, f.name).cpu()
                for f in dataclasses.fields(tree)
                if isinstance(getattr(tree, f.name), torch.Tensor)
            },
        )
        logits = grab["logits"].float().cpu()
        grab["cf"] = counterfactual(cpu, logits, walk(cpu, target_tokens.cpu()))[0]
        grab["curve"] = tree.path_probs.double().cumsum(1)[:, :CAP].cpu().numpy()
        grab["chain_pred"] = tree.chain_probs.double().sum(1).cpu().numpy()
        grab["top1"] = logits[:, :CHAIN].argmax(-1).numpy()
        b, width = res.out_tokens.shape
        bonus = target_tokens[:, 0].to(torch.int64)
        out = torch.full_like(res.out_tokens, -1)
        out[:, 0] = bonus
        zero = torch.zeros_like(res.accept_length)
        return AcceptResult(zero, torch.zeros_like(res.path), out, zero + 1, zero)

    dec.accept_tree = accept_bonus_only
    rows: dict[int, list[dict]] = {}

    def on_step(advanced, index):
        if "cf" not in grab:  # a prefill step
            return
        for i, r in enumerate(advanced):
            rows.setdefault(index[r.rid], []).append(
                {
                    "pos": len(r.output_ids) - 1,  # output tokens before the round
                    "trees": grab["cf"][i].tolist(),
                    "curve64": grab["curve"][i].round(4).tolist(),
                    "chain_pred": float(grab["chain_pred"][i]),
                    "top1": grab["top1"][i].tolist(),
                }
            )
        grab.clear()

    ids = prompt_ids(eng.tokenizer, n_prompts, prompt_set)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        reqs = keep_running(eng, ids, n_prompts, sp, on_step)
    finally:
        dec.accept_tree = walk
    out = []
    for i in sorted(reqs):
        cont = list(reqs[i].output_ids)
        table = []
        for row in sorted(rows[i], key=lambda r: r["pos"]):
            p = row.pop("pos")
            assert p == len(table) + 1, (p, len(table))  # positions[j]: the round at j + 1
            top1 = row.pop("top1")
            ch = 0
            while ch < CHAIN and p + ch < len(cont) and top1[ch] == cont[p + ch]:
                ch += 1
            table.append({**row, "chain": ch})
        out.append({"prompt": i, "tokens": cont, "positions": table})
    return out


def accepts(req: dict) -> np.ndarray:
    """[positions, rungs] accepted drafts per rung (`RUNG_NAMES` order; AR 0); row j: the round
    that starts after j + 1 output tokens."""
    return np.array([[0, t["trees"][0], t["chain"], *t["trees"][1:]] for t in req["positions"]])


def walk_fixed(req: dict, rung: int, max_tokens: int) -> list[int]:
    """Tokens emitted per round by a fixed rung from the prefill's token to max_tokens."""
    acc, pos, out = accepts(req), 1, []
    while pos < max_tokens:
        n = min(int(acc[pos - 1, rung]) + 1, max_tokens - pos)
        out.append(n)
        pos += n
    return out


def check(reqs: list[dict], prompt_set: str, max_tokens: int) -> dict:
    """τ per fixed config: walked on the table vs the engine's own run (same prompts)."""
    import torch

    from ddtree import LLM, SamplingParams
    from ddtree.bench.acceptance import DEFAULT_PROMPTS

    torch.set_num_threads(2)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    configs = {
        "chain": dict(speculative_algorithm="DFLASH"),
        "tree32": dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=32),
        "tree64": dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=64),
    }
    out = {}
    for name, cfg in configs.items():
        llm = LLM(None, device="cpu", max_running_requests=len(reqs), **cfg)
        if prompt_set == "heldout":
            prompts = [DEFAULT_PROMPTS[r["prompt"] % len(DEFAULT_PROMPTS)] for r in reqs]
            got = llm.generate(prompts, sp)
        else:
            ids = prompt_ids(llm.engine.tokenizer, max(r["prompt"] for r in reqs) + 1, prompt_set)
            got = llm.generate([{"prompt_token_ids": ids[r["prompt"]]} for r in reqs], sp)
        real = [list(o.accept_lengths) for o in got]
        walked = [walk_fixed(r, RUNG_NAMES.index(name), max_tokens) for r in reqs]
        out[name] = {
            "same_rounds": sum(a == b for a, b in zip(real, walked)),
            "requests": len(reqs),
            "tau_real": float(np.mean([n for x in real for n in x])),
            "tau_walked": float(np.mean([n for x in walked for n in x])),
        }
    return out


def simulate(
    reqs: list[dict],
    bs: int,
    rounds: int,
    max_tokens: int,
    rung=None,
    seed=0,
    overhead=None,
    pol=None,
) -> dict:
    """bs requests in flight over `rounds` rounds (a finished one replaced by the next, cycling
    the table from a random start), one rung per round: `rung` = a rung index (fixed) or None
    for `BudgetPolicy` (`--speculative-ddtree-budget auto`: `pol`, one carried over from an
    earlier level, else a fresh one whose profile is `overhead` seconds, or 12%, under the served
    costs). Costs: the 8B shape's served ms."""
    from ddtree.engine.budget.policy import BudgetPolicy, CostTable, ServedCost

    rng = np.random.default_rng(seed)
    true = np.array([0.0] + [MS[bs][n] for n in RUNG_NAMES[1:]]) / 1e3
    true[0] = true[RUNG_NAMES.index("chain")] * 0.85  # AR: never the pick at these acceptances
    cost = None
    if rung is None and pol is None:
        # the startup profile: 12% under the served rounds, or `overhead` seconds under them
        batches = tuple(sorted(MS))
        prof = (
            np.array(
                [[0.0] + [MS[b][n] for n in RUNG_NAMES[1:]] for b in batches], dtype=np.float64
            )
            / 1e3
        )
        prof[:, 0] = prof[:, RUNG_NAMES.index("chain")] * 0.85
        prof = prof * 0.88 if overhead is None else prof - overhead
        ladder = (0, 8, 16, 32, 64)
        cost = ServedCost(CostTable(ladder, batches, (4096,), prof[:, None, :], chain=CHAIN))
        pol = BudgetPolicy(ladder, cost, max(MS), CHAIN)
    elif pol is not None:
        cost = pol.cost
    acc = [accepts(r) for r in reqs]
    order = rng.permutation(len(reqs))
    nxt, slots = 0, np.arange(bs)  # the policy's slot rows (a level reuses the first bs)
    cur, pos, owners = [0] * bs, [1] * bs, [object() for _ in range(bs)]
    for i in range(bs):
        cur[i] = int(order[nxt % len(order)])
        pos[i] = int(rng.integers(1, max_tokens - 8))  # staggered
        nxt += 1
    tok, sec, picks = 0, 0.0, np.zeros(len(RUNG_NAMES), dtype=np.int64)
    for _ in range(rounds):
        rows = [reqs[cur[i]]["positions"][pos[i] - 1] for i in range(bs)]
        a = np.array([acc[cur[i]][pos[i] - 1] for i in range(bs)])
        if rung is not None:
            r = int(rung)
        else:
            caps = [min(CAP, max_tokens - pos[i] - 1) for i in range(bs)]
            d = pol.choose(slots, owners, caps, 1024)
            r = d.rung
            full = [max_tokens - pos[i] > 16 for i in range(bs)]
            observe_round(pol, slots, d, rows, np.minimum(a[:, r], d.budgets), full)
            cost.observe(bs, 1024, r, true[r] * rng.lognormal(0.0, 0.03))
        picks[r] += 1
        sec += true[r]
        for i in range(bs):
            n = min(int(a[i, r]) + 1, max_tokens - pos[i])
            tok += n
            pos[i] += n
            if pos[i] >= max_tokens:
                cur[i], pos[i], owners[i] = int(order[nxt % len(order)]), 1, object()
                nxt += 1
    return {
        "tok_per_s": tok / sec,
        "picks": dict(zip(RUNG_NAMES, picks.tolist())),
        "policy": pol,
    }


def tau_summary(reqs: list[dict], max_tokens: int) -> dict:
    """Per rung: tokens per round over its own trajectory and over every position."""
    out = {}
    for name in ("chain", "tree16", "tree32", "tree64"):
        r = RUNG_NAMES.index(name)
        own = [n for q in reqs for n in walk_fixed(q, r, max_tokens)]
        every = np.mean([accepts(q)[:, r].mean() + 1 for q in reqs])
        out[name] = {"own": float(np.mean(own)), "every_pos": float(every)}
    return out


def fixed_rates(reqs, bs: int, rounds: int, max_tokens: int, seed: int) -> dict[str, float]:
    return {
        n: simulate(reqs, bs, rounds, max_tokens, RUNG_NAMES.index(n), seed)["tok_per_s"]
        for n in RUNG_NAMES[1:]
    }


def replay_batches(reqs, batches, rounds: int, max_tokens: int, seeds: int) -> dict:
    """Per batch: every fixed rung and a fresh policy, each over `seeds` draws."""
    out = {}
    for bs in batches:
        runs = [fixed_rates(reqs, bs, rounds, max_tokens, s) for s in range(seeds)]
        fixed = {n: float(np.mean([x[n] for x in runs])) for n in runs[0]}
        auto = [simulate(reqs, bs, rounds, max_tokens, None, s) for s in range(seeds)]
        rate = float(np.mean([x["tok_per_s"] for x in auto]))
        best = max(fixed, key=fixed.get)
        out[bs] = {
            "fixed_over_chain": {n: round(v / fixed["chain"], 3) for n, v in fixed.items()},
            "auto_over_chain": round(rate / fixed["chain"], 3),
            "auto_of_best": round(rate / fixed[best], 3),
            "best": best,
            "picks": auto[0]["picks"],
        }
    return out


def replay_levels(reqs, levels, rounds: int, max_tokens: int, seeds: int, overhead_s: float):
    """One policy through the batches in turn (as `bench at-scale` runs one server), per draw:
    its share of the best fixed rung at each level."""
    out: dict[int, list] = {}
    for s in range(seeds):
        pol = None
        for bs in levels:
            fixed = fixed_rates(reqs, bs, rounds, max_tokens, s)
            got = simulate(reqs, bs, rounds, max_tokens, None, s, overhead_s, pol)
            pol, best = got["policy"], max(fixed, key=fixed.get)
            out.setdefault(bs, []).append(
                {
                    "auto_of_best": round(got["tok_per_s"] / fixed[best], 3),
                    "best": best,
                    "picks": got["picks"],
                }
            )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-set", choices=("textwrap", "heldout"), default="heldout")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model-path", help="e.g. inflate:qwen3-8b (default: the embedded pair)")
    p.add_argument("--table", help="reuse a JSON (or .json.gz) written by --output")
    p.add_argument("--output", help="JSON: the table, the check and the replay")
    p.add_argument("--check", action="store_true", help="walk vs the engine's fixed runs")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--rounds", type=int, default=600)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--levels", help="e.g. 1,4,8,16: one policy through these batches in turn")
    p.add_argument(
        "--overhead-ms", type=float, default=1.2, help="--levels: the profile this far under served"
    )
    a = p.parse_args(argv)
    if a.table:
        opener = gzip.open if a.table.endswith(".gz") else open
        with opener(a.table, "rt", encoding="utf-8") as f:
            reqs = json.load(f)["requests"]
    else:
        reqs = record(a.prompts, a.max_tokens, a.prompt_set, a.device, a.dtype, a.model_path)
    res: dict = {"tau": tau_summary(reqs, a.max_tokens)}
    if a.check:
        res["check"] = check(reqs, a.prompt_set, a.max_tokens)
    batches = [int(x) for x in a.batches.split(",")]
    res["replay"] = replay_batches(reqs, batches, a.rounds, a.max_tokens, a.seeds)
    if a.levels:
        levels = [int(x) for x in a.levels.split(",")]
        res["levels"] = replay_levels(
            reqs, levels, a.rounds, a.max_tokens, a.seeds, a.overhead_ms / 1e3
        )
    print(json.dumps(res, indent=1))
    if a.output:
        with open(a.output, "w", encoding="utf-8") as f:
            json.dump({"args": vars(a), "result": res, "requests": reqs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
