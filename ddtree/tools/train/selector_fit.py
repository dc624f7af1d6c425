"""Selector-only training of a DFlash2 drafter warm-started from a DFlash one (`train-drafter
--architecture dflash2 --init-from DFLASH_DIR --selector-only`).

With the warm-started backbone frozen (and the convolutions at the identity) the selector sees
fixed inputs: per block position the drafter's final hidden, its unary top-K candidates and their
logits, the label and its teacher-forced predecessor (train/selector.py). They are computed once
(one target + drafter forward and one LM head per position, the cost that dominates a full
training step) and the selector is fitted on them for many passes: where a CPU affords a few dozen
full steps in an hour, it affords millions of selector updates. The result is a DFlash2 checkpoint
whose unary part is the DFlash drafter's; a full run (`--init-from` without `--selector-only`)
trains every weight.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models.configs import DrafterConfig
from ddtree.models.drafters import build_drafter
from ddtree.models.loader import save_model
from ddtree.tools.train.drafter import (
    anchor_valid,
    block_acceptance,
    block_embeds,
    default_gamma,
    sample_anchors,
    target_features,
)
from ddtree.tools.train.lm import autocast, lr_at, progress_bar
from ddtree.tools.train.selector import init_dflash2, predecessors, warm_start


@dataclass
class SelectorData:
    """One row per trained block position (weight > 0)."""

    hidden: torch.Tensor  # [N, H] the drafter's final hidden (bf16)
    unary: torch.Tensor  # [N, K] fp32 unary logits of `cand`
    cand: torch.Tensor  # [N, K] serving's top-K, the label in the K-th slot where it is not in it
    target: torch.Tensor  # [N] index of the label in cand
    served: torch.Tensor  # [N] bool: the label is among serving's candidates
    preds: torch.Tensor  # [N] teacher-forced predecessor
    weight: torch.Tensor  # [N] fp32 position weight exp(-(k - 1) / gamma)
    pos: torch.Tensor  # [N] its block position k (1..S-1)
    block: torch.Tensor  # [N] the block it belongs to (rows of a block are consecutive, by k)

    def __len__(self) -> int:
        return self.target.shape[0]

    def save(self, path: str) -> None:
        torch.save({k: getattr(self, k) for k in self.__dataclass_fields__}, path)

    @classmethod
    def load(cls, path: str) -> "SelectorData":
        return cls(**torch.load(path, map_location="cpu"))


@torch.no_grad()
def selector_features(
    drafter: nn.Module,
    target: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    anchors_per_seq: int,
    gamma: float,
    seed: int = 0,
    batch_size: int = 8,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = True,
) -> SelectorData:
    cfg = drafter.config
    S, K, T = cfg.block_size, cfg.selector_top_k, ids.shape[1]
    dev = next(drafter.parameters()).device
    parts: dict[str, list] = {k: [] for k in SelectorData.__dataclass_fields__}
    k_pos = torch.arange(1, S, device=dev)
    blocks = 0
    bar = progress_bar(ids.shape[0], 0, progress, "selector features")
    for lo in range(0, ids.shape[0], batch_size):
        b_ids = ids[lo : lo + batch_size].to(dev)
        b_mask = None if mask is None else mask[lo : lo + batch_size].to(dev)
        gen = torch.Generator().manual_seed(seed * 7919 + lo)
        anchors, keep = sample_anchors(anchor_valid(b_ids, b_mask), anchors_per_seq, gen)
        with autocast(dev, autocast_dtype):
            feats, _, _ = target_features(target, b_ids, cfg.target_layer_ids)
            hidden = drafter.forward_train(
                feats, block_embeds(target, b_ids, anchors, cfg), anchors
            )[:, :, 1:]
        pos = anchors[..., None] + k_pos
        ok = (pos < T) & keep[..., None]
        pos_c = pos.clamp(max=T - 1)
        labels = b_ids.gather(1, pos_c.flatten(1)).view_as(pos)
        if b_mask is not None:
            ok &= b_mask.gather(1, pos_c.flatten(1)).view_as(pos)
        preds = predecessors(b_ids.gather(1, anchors), labels)
        w = torch.exp(-(k_pos - 1).float() / gamma).expand_as(pos)
        blk = blocks + torch.arange(pos[..., 0].numel(), device=dev).view(pos.shape[:2])
        kk, bb = k_pos.expand_as(pos), blk[..., None].expand_as(pos)
        blocks += pos[..., 0].numel()
        h, lab, prd, wt, kk, bb = (x[ok] for x in (hidden, labels, preds, w, kk, bb))
        for r in range(0, h.shape[0], 2048):  # the LM head a few thousand rows at a time
            sl = slice(r, r + 2048)
            logits = drafter.logits(h[sl], target.lm_head).float()
            unary, cand = logits.topk(K, dim=-1)
            hit = cand == lab[sl, None]
            served = hit.any(-1)
            cand[:, -1] = torch.where(served, cand[:, -1], lab[sl])
            unary[:, -1] = torch.where(served, unary[:, -1], logits.gather(1, lab[sl, None])[:, 0])
            parts["hidden"].append(h[sl].to(torch.bfloat16).cpu())
            parts["unary"].append(unary.cpu())
            parts["cand"].append(cand.cpu())
            parts["target"].append(torch.where(served, hit.int().argmax(-1), K - 1).cpu())
            parts["served"].append(served.cpu())
            parts["preds"].append(prd[sl].cpu())
            parts["weight"].append(wt[sl].cpu())
            parts["pos"].append(kk[sl].cpu())
            parts["block"].append(bb[sl].cpu())
        bar.update(b_ids.shape[0])
    bar.close()
    return SelectorData(**{k: torch.cat(v) for k, v in parts.items()})


@torch.no_grad()
def chain_tau(sel: nn.Module, data: SelectorData, rows: int = 8192) -> float:
    """Mean accepted length (bonus included) of the greedy selector chain over the complete blocks
    of `data`: 1 + its leading positions whose pick is the label among serving's candidates. The
    chain conditions on its own previous token, which is the label for as long as it is accepted:
    teacher forcing is exact here (train/selector.py)."""
    dev = sel.hidden_projection.weight.device
    oks = []
    for lo in range(0, len(data), rows):
        sl = slice(lo, lo + rows)
        scores = sel.scores(
            data.hidden[sl].to(dev).float(),
            data.unary[sl].to(dev),
            data.preds[sl].to(dev),
            data.cand[sl].to(dev),
        )
        oks.append(((scores.argmax(-1) == data.target[sl].to(dev)) & data.served[sl].to(dev)).cpu())
    ok = torch.cat(oks)
    n = int(data.block.max()) + 1 if len(data) else 0
    S1 = int(data.pos.max()) if len(data) else 0
    count = torch.zeros(n, dtype=torch.int64).index_add_(0, data.block, torch.ones_like(data.block))
    first_miss = torch.full((n,), S1 + 1, dtype=torch.int64)
    first_miss.scatter_reduce_(0, data.block, torch.where(ok, S1 + 1, data.pos), reduce="amin")
    full = count == S1
    return float(first_miss[full].float().mean()) if full.any() else 0.0


def fit_selector(
    drafter: nn.Module,
    data: SelectorData,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    warmup_ratio: float = 0.04,
    weight_decay: float = 0.0,
    progress: bool = True,
    history: list | None = None,
    val: SelectorData | None = None,
    eval_every: int = 100,
) -> None:
    """AdamW on the candidate selector's weights alone, minibatches of positions (weighted K-way
    cross-entropy), linear warmup then cosine decay. With `val` (features of held-out sequences):
    its `chain_tau` every `eval_every` steps, and the selector of the best one is kept (the
    codebooks memorise a small training set, and a per-position accuracy can rise while the first
    position, which every accepted chain needs, gets worse: early stopping on held-out chains)."""
    sel = drafter.candidate_selector
    drafter.requires_grad_(False)
    sel.requires_grad_(True)
    opt = torch.optim.AdamW(sel.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    best = (chain_tau(sel, val), 0, _state(sel)) if val is not None else None
    if history is not None and best is not None:
        history.append({"step": 0, "val_chain_tau": best[0]})
    dev = sel.hidden_projection.weight.device
    gen = torch.Generator().manual_seed(seed)
    order, at = torch.randperm(len(data), generator=gen), 0
    warm = max(1, math.ceil(warmup_ratio * steps))
    bar = progress_bar(steps, 0, progress, "fit selector")
    for step in range(steps):
        if at + batch_size > len(data):
            order, at = torch.randperm(len(data), generator=gen), 0
        idx = order[at : at + batch_size]
        at += batch_size
        h, u, c, t, s, p, w = (
            x[idx].to(dev)
            for x in (
                data.hidden,
                data.unary,
                data.cand,
                data.target,
                data.served,
                data.preds,
                data.weight,
            )
        )
        cur = lr_at(step, steps, lr, warm)
        for group in opt.param_groups:
            group["lr"] = cur
        scores = sel.scores(h.float(), u, p, c)
        loss = (F.cross_entropy(scores, t, reduction="none") * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(sel.parameters(), 1.0)
        opt.step()
        acc = float(((scores.argmax(-1) == t) & s).float().mean())
        if history is not None:
            history.append({"step": step + 1, "loss": loss.item(), "lr": cur, "pick_acc": acc})
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.3f}", refresh=False)
        bar.update(1)
        if best is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
            v = chain_tau(sel, val)
            if history is not None:
                history.append({"step": step + 1, "val_chain_tau": v})
            if v > best[0]:
                best = (v, step + 1, _state(sel))
    bar.close()
    if best is not None:
        sel.load_state_dict(best[2])
        if history is not None:
            history.append({"best_step": best[1], "best_val_chain_tau": best[0]})
    drafter.requires_grad_(False)


def _state(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def train_selector_only(
    target: nn.Module,
    drafter_cfg: dict,
    sequences: tuple[torch.Tensor, torch.Tensor | None],
    init_from: str,
    *,
    steps: int,
    lr: float = 3e-3,
    batch_size: int = 4096,
    anchors_per_seq: int = 16,
    gamma: float | None = None,
    seed: int = 0,
    device: str = "cpu",
    autocast_dtype: torch.dtype | None = None,
    out_dir: str | None = None,
    save_dtype: torch.dtype | None = None,
    progress: bool = True,
    history: list | None = None,
    eval_sequences=None,
    weight_decay: float = 0.0,
    features: str | None = None,
) -> nn.Module:
    """A DFlash2 drafter for `target`: `init_from`'s DFlash weights (exactly its function), then
    its selector fitted on features of `sequences` ((ids, loss_mask)), the best step by held-out
    `eval_sequences` kept; `history` gets the fit's steps and {"step", "tau", "tau_init"}:
    held-out block acceptance after and before. `features`: a file caching the training and
    held-out features (they depend on the data, anchors, seed and the DFlash weights only, so a
    refit at another rank or learning rate reuses them)."""
    cfg = DrafterConfig.from_dict(drafter_cfg)
    if not cfg.is_dflash2:
        raise ValueError("selector-only training needs a DFlash2DraftModel config")
    gamma = gamma or default_gamma(cfg.block_size)
    target.requires_grad_(False).eval()
    torch.manual_seed(seed)
    drafter = build_drafter(cfg)
    init_dflash2(drafter)
    warm_start(drafter, init_from)
    drafter.to(device).eval()
    tau_init = None
    if eval_sequences is not None:
        tau_init = block_acceptance(drafter, target, eval_sequences[0], mask=eval_sequences[1])
    ids, mask = sequences

    def collect(seqs, salt):
        return selector_features(
            drafter, target, seqs[0], seqs[1], anchors_per_seq, gamma, seed + salt, 8,
            autocast_dtype, progress,
        )  # fmt: skip

    if features and os.path.exists(features + ".train"):
        data = SelectorData.load(features + ".train")
        val = SelectorData.load(features + ".val") if eval_sequences is not None else None
    else:
        data = collect((ids, mask), 0)
        val = collect(eval_sequences, 1) if eval_sequences is not None else None
        if features:
            data.save(features + ".train")
            if val is not None:
                val.save(features + ".val")
    fit_selector(
        drafter,
        data,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        seed=seed,
        weight_decay=weight_decay,
        progress=progress,
        history=history,
        val=val,
    )
    drafter.eval()
    if eval_sequences is not None and history is not None:
        tau = block_acceptance(drafter, target, eval_sequences[0], mask=eval_sequences[1])
        history.append({"step": steps, "tau": tau, "tau_init": tau_init, "positions": len(data)})
    if out_dir:
        save_model(drafter, out_dir, drafter_cfg, dtype=save_dtype)
    return drafter
