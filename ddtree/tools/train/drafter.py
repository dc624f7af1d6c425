"""The DFlash drafter training recipe (field notes §3) against a frozen target; DFlash2 drafters add
the selector's loss (`train/selector.py`).

Per batch: target taps for the whole sequences (no grad); random anchors a per sequence; blocks
`[x_a, MASK x (S-1)]` embedded with the target's frozen `embed_tokens`; block position k (1..S-1) is trained
on the SAME-position label x_{a+k} (never a+k+1) with weight exp(-(k-1)/gamma), through the target's frozen
`lm_head`. A block sees context strictly before its anchor (the drafter's `forward_train` enforces it).
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddtree.models.configs import DrafterConfig
from ddtree.models.drafters import build_drafter
from ddtree.models.loader import save_model
from ddtree.models.qwen3 import Qwen3ForCausalLM, causal_attend
from ddtree.models.shapes import drafter_config_for  # noqa: F401 - re-exported
from ddtree.tools.train.lm import (
    autocast,
    batches,
    init_weights,
    load_checkpoint,
    lr_at,
    progress_bar,
    save_checkpoint,
)
from ddtree.tools.train.selector import (
    greedy_picks,
    init_dflash2,
    predecessors,
    selector_terms,
    warm_start,
)


def default_gamma(block_size: int) -> float:
    """gamma = 7 at block 16 and 4 at block 8 (published); other sizes scale 7*S/16 (unverified)."""
    return {16: 7.0, 8: 4.0}.get(block_size, 7.0 * block_size / 16)


def block_embeds(
    target: nn.Module, ids: torch.Tensor, anchors: torch.Tensor, cfg: DrafterConfig
) -> torch.Tensor:
    """Frozen target embedding of the blocks `[x_a, MASK x (S-1)]`: [B, A, S, H] in fp32."""
    blk = torch.full(
        (*anchors.shape, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=ids.device
    )
    blk[..., 0] = ids.gather(1, anchors)
    embed = getattr(target, "embed_tokens", None) or target.model.embed_tokens
    with torch.no_grad():
        return embed(blk).float()


def target_features(
    target: nn.Module, ids: torch.Tensor, taps: tuple[int, ...], want_logits: bool = False
):
    """(taps [B, T, K*H], final hidden or logits [B, T, *] or None, is_logits) under no_grad."""
    with torch.no_grad():
        if isinstance(target, Qwen3ForCausalLM) and not want_logits:
            pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            hidden, feats = target.hidden_states(ids, pos, causal_attend(target.scale), taps)
            return feats, hidden, False
        logits, feats = target.forward_train(ids, taps)
        return feats, logits, True


def sample_anchors(
    valid: torch.Tensor, num: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num` distinct anchors per row among `valid` [B, T] positions: (anchors [B, A], keep [B, A])."""
    scores = torch.rand(valid.shape, generator=gen).to(valid.device)
    scores = scores.masked_fill(~valid, -1.0)
    top, idx = scores.topk(min(num, valid.shape[1]), dim=1)
    idx, order = idx.sort(1)
    return idx, top.gather(1, order) >= 0


def anchor_valid(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Anchor a needs context (a >= 1) and a real first label x_{a+1} (inside the loss mask)."""
    T = ids.shape[1]
    pos = torch.arange(T, device=ids.device)
    valid = ((pos >= 1) & (pos <= T - 2)).expand(ids.shape).clone()
    if mask is not None:
        valid[:, :-1] &= mask[:, 1:].to(ids.device)
    return valid


def _rows_loss(drafter, lm_head, h, labels, w, teacher, teacher_is_logits, preds=None, alpha=1.0):
    """(weighted loss sum, chain match per row); `preds` (DFlash2): the teacher-forced predecessors,
    adding `alpha` x the selector's loss, the match then the greedy selector's."""
    logits = drafter.logits(h, lm_head).float()
    logp = logits.log_softmax(-1)
    if teacher is None:
        nll = -logp.gather(-1, labels[:, None]).squeeze(-1)
    else:
        t = teacher if teacher_is_logits else lm_head(teacher)
        nll = -(t.float().softmax(-1) * logp).sum(-1)
    if preds is None:
        return (nll * w).sum(), logits.argmax(-1) == labels
    sel, picks = selector_terms(drafter, h, logits, labels, preds, w)
    return (nll * w).sum() + alpha * sel, picks


def block_loss(
    drafter: nn.Module,
    target: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    gamma: float,
    kd: bool = False,
    chunk_elems: int = 1 << 27,
    selector_alpha: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss, per-block acceptance length [B, A] counted on the labels) for one batch; a
    DFlash2 drafter adds `selector_alpha` x its selector's loss (train/selector.py)."""
    cfg = drafter.config
    S, T = cfg.block_size, ids.shape[1]
    feats, teacher_all, is_logits = target_features(
        target, ids, cfg.target_layer_ids, want_logits=False
    )
    hidden = drafter.forward_train(feats, block_embeds(target, ids, anchors, cfg), anchors)[
        :, :, 1:
    ]
    k = torch.arange(1, S, device=ids.device)
    pos = anchors[..., None] + k  # label x_{a+k} for block row k: same position, no extra shift
    inside = pos < T
    pos_c = pos.clamp(max=T - 1)
    labels = ids.gather(1, pos_c.flatten(1)).view_as(pos)
    ok = inside & keep[..., None]
    if mask is not None:
        ok &= mask.to(ids.device).gather(1, pos_c.flatten(1)).view_as(pos)
    w = torch.exp(-(k - 1).float() / gamma).expand_as(pos) * ok
    teacher = None
    if kd:
        src = pos_c - 1  # the target's distribution for x_{a+k} lives at position a+k-1
        teacher = teacher_all.gather(
            1, src.flatten(1)[..., None].expand(-1, -1, teacher_all.shape[-1])
        )
        teacher = teacher.flatten(0, 1)
    h, lab, wf = hidden.flatten(0, 2), labels.flatten(), w.flatten()
    preds = None
    if cfg.is_dflash2:
        preds = predecessors(ids.gather(1, anchors), labels).flatten()
    lm_head = target.lm_head
    rows = max(1, chunk_elems // cfg.vocab_size)
    if h.shape[0] <= rows:
        total, match = _rows_loss(
            drafter, lm_head, h, lab, wf, teacher, is_logits, preds, selector_alpha
        )
    else:
        total, parts = h.new_zeros((), dtype=torch.float32), []
        for lo in range(0, h.shape[0], rows):
            sl = slice(lo, lo + rows)
            t = None if teacher is None else teacher[sl]
            part, m = checkpoint(
                _rows_loss,
                drafter,
                lm_head,
                h[sl],
                lab[sl],
                wf[sl],
                t,
                is_logits,
                None if preds is None else preds[sl],
                selector_alpha,
                use_reentrant=False,
            )
            total, parts = total + part, parts + [m]
        match = torch.cat(parts)
    loss = total / w.sum().clamp_min(1e-6)
    accepted = 1 + (match.view_as(pos) & ok).long().cumprod(-1).sum(-1)
    return loss, accepted


@torch.no_grad()
def acceptance_lengths(
    drafter: nn.Module,
    target: nn.Module,
    ids: torch.Tensor,
    labels: str = "target",
    anchor_chunk: int = 256,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-anchor DFLASH acceptance length [N, T] (1 + leading block rows whose argmax equals the label;
    0 where no full block fits). `labels="target"`: the target's argmax at a+k-1, i.e. what T=0 verification
    accepts when `ids` is the target's own greedy continuation; `"data"`: x_{a+k} itself. A DFlash2
    drafter's chain is its greedy selector's, conditioned on the label before (exact while
    accepted: train/selector.py)."""
    cfg = drafter.config
    S, (N, T) = cfg.block_size, ids.shape
    dev = next(drafter.parameters()).device
    ids = ids.to(dev)
    out = torch.zeros(N, T, dtype=torch.long)
    with autocast(dev, autocast_dtype):
        logits_t, feats = target.forward_train(ids, cfg.target_layer_ids)
        want = logits_t.argmax(-1) if labels == "target" else None
        for lo in range(1, T - S + 1, anchor_chunk):
            anchors = torch.arange(lo, min(T - S + 1, lo + anchor_chunk), device=dev).expand(N, -1)
            hid = drafter.forward_train(feats, block_embeds(target, ids, anchors, cfg), anchors)[
                :, :, 1:
            ]
            logits = drafter.logits(hid, target.lm_head)
            pos = anchors[..., None] + torch.arange(1, S, device=dev)
            lab = (
                want.gather(1, (pos - 1).flatten(1))
                if want is not None
                else ids.gather(1, pos.flatten(1))
            ).view_as(pos)
            if cfg.is_dflash2:
                preds = predecessors(ids.gather(1, anchors), lab)
                guess = greedy_picks(drafter, hid, logits, preds)
            else:
                guess = logits.argmax(-1)
            hit = (guess == lab).long().cumprod(-1).sum(-1)
            out[:, lo : lo + anchors.shape[1]] = (1 + hit).cpu()
    return out


def block_acceptance(
    drafter,
    target,
    ids: torch.Tensor,
    start: int = 1,
    labels: str = "target",
    batch_size: int = 64,
    mask: torch.Tensor | None = None,
) -> float:
    """Mean acceptance length over every full block anchored at >= `start` (the held-out tau estimate); with
    a loss `mask`, only blocks whose anchor and last label are inside it (e.g. the response) count."""
    acc = torch.cat(
        [
            acceptance_lengths(drafter, target, ids[i : i + batch_size], labels)
            for i in range(0, ids.shape[0], batch_size)
        ]
    )
    ok = acc > 0
    ok[:, :start] = False
    if mask is not None:
        S = drafter.config.block_size
        m = mask.bool().cpu()
        ok[:, : m.shape[1] - S + 1] &= m[:, : m.shape[1] - S + 1] & m[:, S - 1 :]
    return float(acc[ok].float().mean()) if ok.any() else 0.0


def chain_acceptance(lengths: torch.Tensor, start: int | list[int]) -> float:
    """Mean tau of the DFLASH chain walk: the first block is anchored at `start` (the first generated token;
    one per row or shared), each round moves the anchor by its acceptance length; blocks that no longer fit
    end the walk."""
    taus = []
    starts = [start] * lengths.shape[0] if isinstance(start, int) else list(start)
    for row, a in zip(lengths.tolist(), starts):
        while a < len(row) and row[a] > 0:
            taus.append(row[a])
            a += row[a]
    return sum(taus) / max(1, len(taus))


def train_drafter(
    target: nn.Module,
    drafter_cfg: dict | DrafterConfig,
    sequences,
    *,
    steps: int,
    lr: float = 6e-4,
    batch_size: int = 4,
    anchors_per_seq: int = 512,
    block_size: int | None = None,
    gamma: float | None = None,
    warmup_ratio: float = 0.04,
    min_lr_ratio: float = 0.0,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    kd: bool = False,
    seed: int = 0,
    device: str | None = None,
    autocast_dtype: torch.dtype | None = None,
    out_dir: str | None = None,
    save_every: int = 0,
    resume: bool = True,
    save_dtype: torch.dtype | None = None,
    progress: bool = True,
    history: list | None = None,
    eval_sequences=None,
    eval_every: int = 0,
    eval_start: int = 1,
    threads: int | None = None,
    selector_alpha: float = 1.0,
    init_from: str | None = None,
) -> nn.Module:
    """Train a DFlash or DFlash2 drafter (`drafter_cfg`'s architecture) for the frozen `target` (its
    parameters get requires_grad=False). DFlash2: convolutions start at the identity, the loss adds
    `selector_alpha` x the selector's (train/selector.py); `init_from` a DFlash drafter directory of
    the same geometry starts from its function exactly (`warm_start`).

    `sequences`: ids [N, T], (ids, loss_mask) or an iterable of such batches; anchors are drawn where the
    first label is inside the loss mask. AdamW, linear warmup (`warmup_ratio`), cosine decay, grad clip.
    With `out_dir`: drafter + optimizer + step go to out_dir/checkpoint/state.pt every `save_every` steps and
    at the end (resumed when `resume`), and the z-lab export (config.json + model.safetensors) to out_dir.
    `history` receives {"step", "loss", "lr", "train_tau"} per step and {"step", "tau"} per evaluation
    (`block_acceptance` on `eval_sequences` = ids or (ids, mask), every `eval_every` steps and at the end)."""
    if threads:
        torch.set_num_threads(threads)
    cfg_dict = dict(drafter_cfg.raw if isinstance(drafter_cfg, DrafterConfig) else drafter_cfg)
    if block_size is not None and block_size != DrafterConfig.from_dict(cfg_dict).block_size:
        cfg_dict["block_size"] = block_size
        cfg_dict["dflash_config"] = dict(cfg_dict.get("dflash_config") or {}, block_size=block_size)
    if save_dtype is not None:
        cfg_dict["torch_dtype"] = str(save_dtype).removeprefix("torch.")
    cfg = DrafterConfig.from_dict(cfg_dict)
    if cfg.mask_token_id is None:
        raise ValueError("drafter config needs dflash_config.mask_token_id")
    gamma = gamma or default_gamma(cfg.block_size)
    device = device or str(next(target.parameters()).device)
    target.requires_grad_(False).eval()
    torch.manual_seed(seed)
    drafter = build_drafter(cfg)
    init_weights(drafter, 0.02)
    if cfg.is_dflash2:
        init_dflash2(drafter)
        if init_from:
            warm_start(drafter, init_from)
    elif init_from:
        raise ValueError("init_from warm-starts a DFlash2 drafter from a DFlash one")
    drafter.to(device).train()
    decay = [p for p in drafter.parameters() if p.dim() >= 2]
    rest = [p for p in drafter.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    ckpt = os.path.join(out_dir, "checkpoint", "state.pt") if out_dir else None
    start = 0
    if ckpt and resume and os.path.exists(ckpt):
        state = load_checkpoint(ckpt, drafter, opt)
        if state.get("config") != cfg_dict:
            raise ValueError(
                f"{ckpt} was written for a different drafter config; remove it or pass resume=False"
            )
        start = int(state["step"])
    warm = max(1, math.ceil(warmup_ratio * steps))
    stream = batches(sequences, batch_size, seed, start)

    def evaluate(step):
        if eval_sequences is None:
            return
        drafter.eval()
        ev_ids, ev_mask = (
            eval_sequences if isinstance(eval_sequences, (tuple, list)) else (eval_sequences, None)
        )
        tau = block_acceptance(drafter, target, ev_ids, start=eval_start, mask=ev_mask)
        drafter.train()
        if history is not None:
            history.append({"step": step, "tau": tau})
        bar.write(f"step {step}: held-out block acceptance {tau:.3f}")

    bar = progress_bar(steps, start, progress, "train-drafter")
    for step in range(start, steps):
        ids, mask = next(stream)
        ids = ids.to(device)
        mask = None if mask is None else mask.to(device)
        gen = torch.Generator().manual_seed(seed * 7919 + step)
        anchors, keep = sample_anchors(anchor_valid(ids, mask), anchors_per_seq, gen)
        cur = lr_at(step, steps, lr, warm, min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = cur
        with autocast(device, autocast_dtype):
            loss, accepted = block_loss(
                drafter, target, ids, mask, anchors, keep, gamma, kd, selector_alpha=selector_alpha
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)
        opt.step()
        val = loss.item()
        train_tau = float(accepted[keep].float().mean()) if keep.any() else 0.0
        if history is not None:
            history.append({"step": step + 1, "loss": val, "lr": cur, "train_tau": train_tau})
        bar.set_postfix(loss=f"{val:.3f}", tau=f"{train_tau:.2f}", refresh=False)
        bar.update(1)
        if ckpt and save_every and (step + 1) % save_every == 0 and step + 1 < steps:
            save_checkpoint(ckpt, drafter, opt, step + 1, {"config": cfg_dict})
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            evaluate(step + 1)
    if ckpt and start < steps:
        save_checkpoint(ckpt, drafter, opt, steps, {"config": cfg_dict})
    evaluate(steps)
    bar.close()
    drafter.eval()
    if out_dir:
        save_model(drafter, out_dir, cfg_dict, dtype=save_dtype)
    return drafter
