"""What every rung would have accepted, every round: the offline engine runs DDTREE at the cap
(B=64, T=0, fp32, the embedded pair: the 8B-shape pair before inflation), and each round's B=64
tree and target tokens give the smaller rungs' and the chain's accept lengths exactly (a best-first
tree of budget b is the b most probable nodes, ancestor-closed, so its accepted path is the B=64
path's prefix inside it; the DFLASH chain is the tree's spine, its accept the path's prefix along
the spine). The chain's is censored where the path runs off the tree's spine end.

`--check` runs the fixed B=16, B=32 and DFLASH servers on the same prompts: where one starts a
round at the same position, its accept equals the inferred one (16 prompts: 82 of 82, 123 of
123, 87 of 87 uncensored; tests/test_counterfactual_rungs.py).

Per request-round it records the drafter's predictions the policy would see (this round's and the
previous round's curve and chain gain; the full curve over budgets 1..64, for `studies/replay_policy.py`)
and the realised accepts, then answers offline:
1. calibration: realised / predicted per rung, by the predictor (last round's prediction, as
   `BudgetPolicy` decided before fef400e, against this round's), and by prediction quintile;
2. decisions: one rung per round for the round's batch, with the 8B-shape served round costs
   (BENCHMARKS, 2026-12-02) at batch 1, 4, 8 and 16, each fixed rung, the per-round oracle (it
   knows the round's accepts) and rungs chosen on the forecasts, as throughput over the chain's.

    PYTHONPATH=. python3 studies/counterfactual_rungs.py --prompts 64 --conc 8 --max-tokens 128 \
        --output cf.json                    # 1258 request-rounds, ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from host_time import keep_running, prompts  # noqa: E402

TREES = (8, 16, 32, 64)
CHAIN = 15


def node_logp(tree, draft_logits):
    """[b, n] each node's drafter path log-probability (root 0, padding -inf)."""
    import torch

    logp = torch.log_softmax(draft_logits.double(), -1)  # [b, D, V]
    b, n = tree.tokens.shape
    out = torch.full((b, n), -float("inf"), dtype=torch.float64)
    out[:, 0] = 0.0
    for i in range(1, n):  # parents precede children
        par, d = tree.parents[:, i], tree.depths[:, i]
        ok = tree.valid[:, i] & (par >= 0)
        own = logp[torch.arange(b), (d - 1).clamp(min=0), tree.tokens[:, i]]
        val = out[torch.arange(b), par.clamp(min=0)] + own
        out[:, i] = torch.where(ok, val, out[:, i])
    return out


def counterfactual(tree, draft_logits, res) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([b, len(TREES)] accepts, [b] chain accept, [b] chain censored)."""
    import torch

    lp = node_logp(tree, draft_logits)
    b, n = lp.shape
    # rank of each node among the drafted ones by path probability (0 = best)
    order = torch.argsort(torch.where(torch.arange(n)[None] == 0, -float("inf"), -lp), 1)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n).expand(b, n).clone())
    rank = rank - 1  # the root sorts first
    k = res.accept_length
    path = res.path[:, 1:]  # [b, D] accepted nodes at depths 1..
    D = path.shape[1]
    step = torch.arange(D)[None]
    on = step < k[:, None]
    pr = torch.where(on, rank.gather(1, path), n)  # off the path: never inside
    accepts = []
    for bb in TREES:
        inside = pr < bb
        accepts.append(torch.where(inside.all(1), k, (~inside).int().argmax(1)))
    # the spine: from the root, each node's most probable child
    spine = torch.zeros(b, D + 1, dtype=torch.int64)
    has = torch.zeros(b, D + 1, dtype=torch.bool)
    has[:, 0] = True
    for d in range(1, D + 1):
        child = (tree.parents == spine[:, d - 1 : d]) & tree.valid & (tree.depths == d)
        score = torch.where(child, lp, -float("inf"))
        best = score.argmax(1)
        has[:, d] = has[:, d - 1] & child.any(1)
        spine[:, d] = torch.where(has[:, d], best, 0)
    match = on & (path == spine[:, 1:]) & has[:, 1:]
    lead = torch.where(match.all(1) | ~(~match & on).any(1), k, (~match & on).int().argmax(1))
    # all k accepted nodes on the spine: the chain stops at k where the spine goes on in the tree
    # (the target drew another token there), else it may go further: censored
    spine_len = has[:, 1:].sum(1)
    censored = (lead == k) & (spine_len <= k) & (k < CHAIN)
    chain = torch.minimum(lead, torch.tensor(CHAIN))
    return torch.stack(accepts, 1).numpy(), chain.numpy(), censored.numpy()


def prompt_ids(tokenizer, n: int, prompt_set: str = "textwrap") -> list[list[int]]:
    """n prompts: `textwrap` (host_time's slices of a stdlib module) or `heldout` (`bench
    at-scale`'s served set: `bench acceptance`'s held-out prompts cycled, tokenised as the
    server's completions endpoint does)."""
    if prompt_set == "textwrap":
        return prompts(tokenizer, n)
    from ddtree.bench.acceptance import DEFAULT_PROMPTS

    base = [tokenizer.encode(p, add_special_tokens=False) for p in DEFAULT_PROMPTS]
    return [base[i % len(base)] for i in range(n)]


def collect(n_prompts: int, conc: int, max_tokens: int, prompt_set: str = "textwrap") -> list[dict]:
    import torch

    import ddtree.engine.round.decoder as dec
    from ddtree import LLM, SamplingParams

    torch.set_num_threads(2)
    llm = LLM(
        None,
        device="cpu",
        max_running_requests=conc,
        speculative_algorithm="DDTREE",
        speculative_ddtree_budget=64,
    )
    eng = llm.engine
    runner = eng.runner
    grab: dict = {}
    draft = runner.draft

    def draft_tree(*a, **kw):
        out = draft(*a, **kw)
        grab["logits"] = out.logits
        return out

    runner.draft = draft_tree
    # on the CPU (no verify graph) every accept walk is the eager one: hooked here
    walk = dec.accept_tree

    def accept_tree(tree, target_tokens):
        res = walk(tree, target_tokens)
        grab["cf"] = counterfactual(tree, grab["logits"], res)
        grab["curve"] = tree.path_probs.double().cumsum(1)[:, : max(TREES)].numpy()
        grab["chain_pred"] = tree.chain_probs.double().sum(1).numpy()
        grab["k"] = res.accept_length.numpy()
        return res

    dec.accept_tree = accept_tree
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows = []

    def on_step(advanced, index):
        if "cf" not in grab:  # a prefill step
            return
        acc, ch, cens = grab["cf"]
        rnd = rows[-1]["round"] + 1 if rows else 0
        for i, r in enumerate(advanced):
            rows.append(
                {
                    "round": rnd,
                    "rid": r.rid,
                    "prompt": index[r.rid],
                    "pos": len(r.output_ids) - int(grab["k"][i]) - 1,  # tokens before it
                    "k": int(grab["k"][i]),
                    "accept": acc[i].tolist(),
                    "chain": int(ch[i]),
                    "censored": bool(cens[i]),
                    "curve": grab["curve"][i, [b - 1 for b in TREES]].tolist(),
                    "curve64": grab["curve"][i].round(4).tolist(),  # budgets 1..64
                    "chain_pred": float(grab["chain_pred"][i]),
                }
            )
        grab.clear()

    try:
        keep_running(eng, prompt_ids(eng.tokenizer, n_prompts, prompt_set), conc, sp, on_step)
    finally:
        dec.accept_tree = walk
    return rows


def served_accepts(
    config: dict, n_prompts: int, conc: int, max_tokens: int, prompt_set: str = "textwrap"
) -> dict:
    """{(prompt, tokens before the round): accepted drafts} of a fixed server's rounds (the
    offline engine, the same prompts and order): what the counterfactual must equal where both
    runs started a round at the same position."""
    import torch

    from ddtree import LLM, SamplingParams

    torch.set_num_threads(2)
    eng = LLM(None, device="cpu", max_running_requests=conc, **config).engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = keep_running(eng, prompt_ids(eng.tokenizer, n_prompts, prompt_set), conc, sp)
    out = {}
    for i, r in reqs.items():
        pos = 1  # the prefill's token
        for n in r.stats.accept_lengths:  # emitted per round: accepted drafts + 1
            out[(i, pos)] = n - 1
            pos += n
    return out


def check(
    rows: list[dict], n_prompts: int, conc: int, max_tokens: int, prompt_set: str = "textwrap"
) -> dict:
    """Per rung: the rounds both runs started at the same position, and the share whose
    counterfactual accept equals the fixed server's (fp32: all, up to near-ties)."""
    configs = {
        "tree16": (1, dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16)),
        "tree32": (2, dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=32)),
        "chain": (None, dict(speculative_algorithm="DFLASH")),
    }
    out = {}
    for name, (col, cfg) in configs.items():
        got = served_accepts(cfg, n_prompts, conc, max_tokens, prompt_set)
        pairs = [
            (r["chain"] if col is None else r["accept"][col], got[(r["prompt"], r["pos"])])
            for r in rows
            if (r["prompt"], r["pos"]) in got and not (col is None and r["censored"])
        ]
        same = sum(a == b for a, b in pairs)
        out[name] = {"rounds": len(pairs), "equal": same}
    return out


# served round ms at the 8B shape (BENCHMARKS 2026-12-02, /metrics of the fixed servers and auto's
# per-rung rounds), by batch: chain, tree8, tree16, tree32, tree64
MS = {
    1: {"chain": 7.75, "tree8": 7.7, "tree16": 8.16, "tree32": 7.75, "tree64": 8.02},
    4: {"chain": 8.44, "tree8": 8.4, "tree16": 8.76, "tree32": 8.93, "tree64": 9.9},
    8: {"chain": 9.47, "tree8": 9.35, "tree16": 9.69, "tree32": 11.22, "tree64": 14.5},
    16: {"chain": 11.91, "tree8": 11.2, "tree16": 12.76, "tree32": 16.34, "tree64": 25.0},
}


def analyse(rows: list[dict], conc: int) -> dict:
    names = [f"tree{b}" for b in TREES] + ["chain"]
    by_rid: dict[str, list[dict]] = {}
    for r in rows:
        by_rid.setdefault(r["rid"], []).append(r)
    # per request-round: this round's and the previous round's predictions, realised accepts
    recs = []
    for rs in by_rid.values():
        for prev, cur in zip(rs, rs[1:]):
            recs.append(
                (
                    cur["round"],
                    np.array(prev["curve"] + [prev["chain_pred"]]),
                    np.array(cur["curve"] + [cur["chain_pred"]]),
                    np.array(cur["accept"] + [cur["chain"]], dtype=float),
                    cur["censored"],
                )
            )
    prev = np.array([r[1] for r in recs])
    now = np.array([r[2] for r in recs])
    real = np.array([r[3] for r in recs])
    cens = np.array([r[4] for r in recs])
    out = {"request_rounds": len(recs), "chain_censored_share": float(cens.mean())}
    cal = {}
    for j, name in enumerate(names):
        keep = ~cens if name == "chain" else np.ones(len(real), bool)
        p_last, p_now, y = prev[keep, j], now[keep, j], real[keep, j]
        dec = np.quantile(p_last, np.linspace(0, 1, 6))
        bins = np.clip(np.searchsorted(dec, p_last, side="right") - 1, 0, 4)
        cal[name] = {
            "mean_real": float(y.mean()),
            "real_over_last": float(y.mean() / p_last.mean()),
            "real_over_now": float(y.mean() / p_now.mean()),
            "corr_last": float(np.corrcoef(p_last, y)[0, 1]),
            "corr_now": float(np.corrcoef(p_now, y)[0, 1]),
            # by quintile of the last round's prediction: mean prediction, mean realised
            "quintiles": [
                (float(p_last[bins == q].mean()), float(y[bins == q].mean())) for q in range(5)
            ],
        }
    out["calibration"] = cal
    # decisions over the rounds' batches: argmax (bs + sum gain) / ms
    rounds: dict[int, list[int]] = {}
    for i, r in enumerate(recs):
        rounds.setdefault(r[0], []).append(i)
    dec_out = {}
    for bs_key, ms in MS.items():
        cost = np.array([ms[n] for n in names])
        fixed_tok = np.zeros(len(names))
        fixed_ms = np.zeros(len(names))
        tok = {"oracle": 0.0, "last": 0.0, "last_cal": 0.0, "now": 0.0}
        tms = dict.fromkeys(tok, 0.0)
        # per rung: realised / predicted (last round) over all rounds (no selection)
        f = real.mean(0) / prev.mean(0)
        for idx in rounds.values():
            bs = len(idx)
            y = real[idx].sum(0) + bs
            fixed_tok += y
            fixed_ms += cost
            choices = {
                "oracle": int(np.argmax(y / cost)),
                "last": int(np.argmax((bs + prev[idx].sum(0)) / cost)),
                "last_cal": int(np.argmax((bs + (prev[idx] * f).sum(0)) / cost)),
                "now": int(np.argmax((bs + (now[idx] * f).sum(0)) / cost)),
            }
            for k, c in choices.items():
                tok[k] += y[c]
                tms[k] += cost[c]
        fixed = fixed_tok / fixed_ms
        dec_out[f"ms@{bs_key}"] = {
            "fixed": dict(zip(names, (fixed / fixed[names.index("chain")]).round(4).tolist())),
            **{k: round(tok[k] / tms[k] / fixed[names.index("chain")], 4) for k in tok},
        }
    out["decisions_vs_chain"] = dec_out
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--conc", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--prompt-set",
        choices=("textwrap", "heldout"),
        default="textwrap",
        help="textwrap: slices of a stdlib module; heldout: bench at-scale's served prompts",
    )
    p.add_argument("--rows", help="reuse a JSON of rows written by --output")
    p.add_argument("--output", help="JSON: the rows and the analysis")
    p.add_argument(
        "--check",
        action="store_true",
        help="also run fixed B=16, B=32 and DFLASH and compare at the positions both ran",
    )
    a = p.parse_args(argv)
    if a.rows:
        rows = json.load(open(a.rows, encoding="utf-8"))["rows"]
    else:
        rows = collect(a.prompts, a.conc, a.max_tokens, a.prompt_set)
    res = analyse(rows, a.conc)
    if a.check:
        res["check"] = check(rows, a.prompts, a.conc, a.max_tokens, a.prompt_set)
    print(json.dumps(res, indent=1))
    if a.output:
        with open(a.output, "w", encoding="utf-8") as f:
            json.dump({"args": vars(a), "analysis": res, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
