"""Why DFLASH accepts less on the inflated pair in bf16 (`python3 -m ddtree.tools.studies.at_scale_precision`):
teacher-forced acceptance of the small and the inflated pair, and of their mixes, on fixed token
sequences, so a flipped target token cannot change the text that later rounds are measured on.

For each held-out prompt the reference sequence is the small pair's fp32 greedy continuation. Each
variant (target, drafter, dtype, fp32 LM head or not) runs one causal target forward over the
sequence (target top-1 agreement with the reference) and one DFlash block at every anchor
(`DFlashDrafter.forward_train`, the engine's block semantics): the chain accept length is the number
of leading proposals equal to the reference's next tokens. Mixed variants feed the small drafter the
inflated target's taps (real dims of the carrier layers) and the inflated drafter the small target's
(zero-padded, the constant dim set), which splits a drop into its target and its drafter part.
Where a variant's chain breaks earlier than the fp32 pair's, the fp32 drafter logits give the gap
between the two tokens: gaps of a few bf16 steps are near-ties that any rounding may flip.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

# name -> (target, drafter, dtype); "big" = inflated
VARIANTS = {
    "small-fp32": ("small", "small", "float32"),
    "big-fp32": ("big", "big", "float32"),
    "small-bf16": ("small", "small", "bfloat16"),
    "big-bf16": ("big", "big", "bfloat16"),
    "bigT-smallD-bf16": ("big", "small", "bfloat16"),
    "smallT-bigD-bf16": ("small", "big", "bfloat16"),
}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="python3 -m ddtree.tools.studies.at_scale_precision"
    )
    p.add_argument("--shape", default="qwen3-8b", help="inflation shape (name or config.json)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96, help="reference continuation length")
    p.add_argument("--variants", default="small-bf16,big-bf16,bigT-smallD-bf16,smallT-bigD-bf16")
    p.add_argument("--fp32-lm-head", action="store_true", help="also each bf16 variant so")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a busy box: keep 1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the full 8B shape fits an H200)")
    p.add_argument(
        "--cache", default=None, help="reference sequences: read if present, else written"
    )
    p.add_argument("--json", default=None, help="write the result rows here")
    return p


@torch.no_grad()
def reference(target, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of the fp32 small target (full recompute per token: tiny model)."""
    out = []
    for ids in prompts:
        seq = list(ids)
        for _ in range(n):
            logits, _ = target.forward_train(
                torch.tensor([seq], device=target.lm_head.weight.device)
            )
            seq.append(int(logits[0, -1].argmax()))
        out.append(seq)
    return out


def reference_sequences(target, prompts: list[list[int]], n: int, cache: str | None):
    """`reference`, read from `cache` when it holds these prompts' n-token continuations (else
    computed and written there)."""
    if cache and os.path.exists(cache):
        with open(cache, encoding="utf-8") as f:
            seqs = json.load(f)
        if len(seqs) == len(prompts) and all(
            s[: len(p)] == list(p) and len(s) == len(p) + n for s, p in zip(seqs, prompts)
        ):
            return seqs
    seqs = reference(target, prompts, n)
    if cache:
        with open(cache, "w", encoding="utf-8") as f:
            json.dump(seqs, f)
    return seqs


class Side:
    """One model pair at one dtype: target, drafter, and how its taps map to the other width."""

    def __init__(self, target, drafter, dtype, fp32_head: bool):
        self.target = target.to(dtype)
        self.drafter = drafter.to(dtype)
        self.dtype, self.fp32_head = dtype, fp32_head

    def lm(self, hidden):
        w = self.target.lm_head.weight
        if self.fp32_head:  # SGLang's --enable-fp32-lm-head: logits of the bf16 hidden in fp32
            return F.linear(hidden.float(), w.float())
        return F.linear(hidden, w).float()

    def taps(self, seq: torch.Tensor):
        from ddtree.models.qwen3 import causal_attend

        t = self.target
        hidden, taps = t.hidden_states(
            seq[None],
            torch.arange(len(seq), device=seq.device)[None],
            causal_attend(t.scale),
            tuple(self.drafter.config.target_layer_ids),
        )
        return self.lm(hidden)[0], taps[0]


def to_small_taps(big_taps, big_ids, small_ids, carriers, h, H):
    pos = {b: t for t, b in enumerate(big_ids)}
    return torch.cat(
        [big_taps[:, pos[carriers[i]] * H : pos[carriers[i]] * H + h] for i in small_ids], -1
    )


def to_big_taps(small_taps, big_ids, small_ids, carriers, h, H, res):
    pos = {b: t for t, b in enumerate(big_ids)}
    out = small_taps.new_zeros(small_taps.shape[0], len(big_ids) * H)
    for t_small, i in enumerate(small_ids):
        t = pos[carriers[i]]
        out[:, t * H : t * H + h] = small_taps[:, t_small * h : (t_small + 1) * h]
    if res.const is not None:
        for t in range(len(big_ids)):
            out[:, t * H + res.const] = res.gamma
    return out


@torch.no_grad()
def blocks(side: Side, taps, seq, anchors, mask_id: int):
    """Drafter logits [A, S-1, V] of the blocks anchored at `anchors` (bonus token = seq[anchor])."""
    d = side.drafter
    S = d.config.block_size
    ids = torch.full((len(anchors), S), mask_id, device=seq.device)
    ids[:, 0] = seq[anchors]
    emb = side.target.model.embed_tokens(ids)[None]
    hidden = d.forward_train(taps[None].to(side.dtype), emb, anchors[None])[0]
    return side.lm(hidden[:, 1:])  # block_hidden ends with the final norm


def accept_lengths(logits, seq, anchors) -> torch.Tensor:
    S1 = logits.shape[1]
    want = torch.stack([seq[a + 1 : a + 1 + S1] for a in anchors.tolist()])
    ok = (logits.argmax(-1) == want).int()
    return ok.cumprod(-1).sum(-1)


def walk_tau(acc: torch.Tensor) -> float:
    """τ of DFLASH rounds along the text: a round at anchor i accepts acc[i] and emits acc[i] + 1
    tokens, the next round is anchored where they end (the engine's rounds, text held fixed)."""
    i = rounds = tokens = 0
    acc = acc.tolist()
    while i < len(acc):
        rounds, tokens, i = rounds + 1, tokens + acc[i] + 1, i + acc[i] + 1
    return tokens / max(rounds, 1)


def run(ns) -> list[dict]:
    from ddtree.assets import default_model_paths
    from ddtree.bench.acceptance import DEFAULT_PROMPTS
    from ddtree.engine.setup import load_tokenizer
    from ddtree.models.loader import load_drafter, load_target
    from ddtree.tools.inflate import inflate_pair
    from ddtree.tools.inflate.plan import plan_pair

    torch.set_num_threads(ns.threads)
    t_dir, d_dir = default_model_paths()
    tok = load_tokenizer(t_dir)
    small_t, small_d = (
        load_target(t_dir, torch.float32, ns.device),
        load_drafter(d_dir, torch.float32, ns.device),
    )
    prompts = [tok.encode(p, add_special_tokens=False)[-96:] for p in DEFAULT_PROMPTS[: ns.prompts]]
    t0 = time.perf_counter()
    seqs = reference_sequences(small_t, prompts, ns.tokens, ns.cache)
    print(
        f"# reference: {len(seqs)} x {ns.tokens} tokens in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    pair = inflate_pair(t_dir, d_dir, ns.shape, ns.device, torch.float32)
    plan = plan_pair(small_t.config, small_d.config, ns.shape)
    big_t, big_d = pair.target, pair.drafter
    h, H = small_t.config.hidden_size, big_t.config.hidden_size
    s_ids, b_ids = list(small_d.config.target_layer_ids), list(big_d.config.target_layer_ids)
    mask_id = small_d.config.mask_token_id

    def side(which_t, which_d, dtype, fp32_head):
        return Side(copy.deepcopy(which_t), copy.deepcopy(which_d), dtype, fp32_head)

    wanted = [v for v in ns.variants.split(",") if v]
    heads = (False, True) if ns.fp32_lm_head else (False,)
    ref_logits, rows = {}, []
    models = {"small": (small_t, small_d), "big": (big_t, big_d)}
    for name in ["small-fp32"] + [v for v in wanted if v != "small-fp32"]:
        tk, dk, dtype_name = VARIANTS[name]
        dtype = getattr(torch, dtype_name)
        for fp32_head in heads if dtype == torch.bfloat16 else (False,):
            t_side = side(*models[tk], dtype, fp32_head)
            d_side = t_side if tk == dk else side(*models[dk], dtype, fp32_head)
            t1 = time.perf_counter()
            agree = total = 0
            acc, gaps, broke, extended = [], [], 0, 0
            for k, ids in enumerate(seqs):
                seq = torch.tensor(ids, device=ns.device)
                n0 = len(prompts[k])
                tlog, taps = t_side.taps(seq)
                pred = tlog[n0 - 1 : -1].argmax(-1)
                agree += int((pred == seq[n0:]).sum())
                total += len(seq) - n0
                if dk != tk:
                    taps = (
                        to_small_taps(taps, b_ids, s_ids, pair.carriers, h, H)
                        if dk == "small"
                        else to_big_taps(taps, b_ids, s_ids, pair.carriers, h, H, plan.residual)
                    )
                S = d_side.drafter.config.block_size
                # bonus at n0: the first round
                anchors = torch.arange(n0, len(seq) - S + 1, device=ns.device)
                dlog = blocks(d_side, taps, seq, anchors, mask_id)[..., : small_t.config.vocab_size]
                a = accept_lengths(dlog, seq, anchors)
                acc.append(a)
                if name == "small-fp32":
                    ref_logits[k] = (dlog, a)
                    continue
                rlog, ra = ref_logits[k]
                broke += int((a < ra).sum())
                extended += int((a > ra).sum())
                # first position where this variant's chain breaks but the fp32 chain goes on
                for j in (a < ra).nonzero().flatten().tolist():
                    pos = int(a[j])
                    chosen = int(dlog[j, pos].argmax())
                    top = rlog[j, pos]
                    gaps.append(float(top.max() - top[chosen]))
            walks = [walk_tau(a) for a in acc]
            acc = torch.cat(acc).float()
            g = torch.tensor(gaps) if gaps else torch.zeros(1)
            row = {
                "variant": name + ("+fp32head" if fp32_head else ""),
                "target_top1_agree": agree / total,
                "tau_tf": 1 + float(acc.mean()),
                "tau_rounds": sum(walks) / len(walks),
                "anchors": len(acc),
                "chains_shorter": broke,
                "chains_longer": extended,
                "break_gap_p50": float(g.median()),
                "break_gap_p90": float(g.quantile(0.9)),
                "break_gap_max": float(g.max()),
                "seconds": time.perf_counter() - t1,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ns = make_parser().parse_args(argv)
    rows = run(ns)
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump({"meta": vars(ns), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
