"""Causal-LM pretraining of a small target (dense Qwen3, or hybrid Qwen3.5 with Gated DeltaNet layers), cached
generation, and the training-loop utilities shared with the drafter recipe (schedule, batching, autocast,
resumable checkpoints)."""

from __future__ import annotations

import contextlib
import math
import os
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels.gdn import gated_delta_rule_chunked, gated_delta_rule_recurrent
from ddtree.models.configs import TargetConfig
from ddtree.models.gated_deltanet import dense_conv_silu
from ddtree.models.loader import build_target, save_model
from ddtree.models.qwen3 import Qwen3ForCausalLM, causal_attend
from ddtree.models.qwen3_5 import Qwen3_5ForCausalLM
from ddtree.models.shapes import qwen3_5_config, qwen3_config  # noqa: F401 - re-exported


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.0) -> float:
    """Linear warmup to `peak` over `warmup` steps, then cosine decay to `min_ratio * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(device: str | torch.device, dtype: torch.dtype | None):
    """bf16 autocast on CUDA by default; fp32 (no autocast) on CPU unless a dtype is asked for."""
    kind = torch.device(device).type
    if dtype is None:
        dtype = torch.bfloat16 if kind == "cuda" else None
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(kind, dtype=dtype)


def batches(
    data, batch_size: int, seed: int, start_step: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Yields (ids [B, T], mask or None) forever. `data` is ids [N, T], a pair (ids, mask) or an iterable of
    batches (tensors or such pairs). Tensor data is shuffled per epoch from (seed, epoch) alone, so step s
    always sees the same batch and a resumed run continues exactly; an iterable is consumed from its start."""
    if (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and isinstance(data[0], torch.Tensor)
        and (data[1] is None or isinstance(data[1], torch.Tensor))
        and data[0].dim() == 2
    ):
        ids, mask = data
    elif isinstance(data, torch.Tensor):
        ids, mask = data, None
    else:
        for item in _cycle(data):
            yield (item if isinstance(item, (tuple, list)) else (item, None))
        return
    n = ids.shape[0]
    per_epoch = max(1, n // batch_size)
    step = start_step
    while True:
        epoch, k = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        idx = perm[k * batch_size : (k + 1) * batch_size] if n >= batch_size else perm
        yield ids[idx], (None if mask is None else mask[idx])
        step += 1


def _cycle(data: Iterable):
    while True:
        empty = True
        for item in data:
            empty = False
            yield item
        if empty:
            raise ValueError("empty training data")


def save_checkpoint(
    path: str, model: nn.Module, opt: torch.optim.Optimizer, step: int, extra: dict
) -> None:
    """Atomic torch.save of model + optimizer + step (written to a temp file, then renamed)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, **extra}, tmp
    )
    os.replace(tmp, path)


def load_checkpoint(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return state


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """HF-style init: normal(0, std) linears/embeddings, norms at 1."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


def progress_bar(total: int, initial: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True)


# ---------------------------------------------------------------- causal LM


class _DenseRecurrentState:
    """`LinearStateContext` for batched [B, T] generation with hybrid targets: per GDN layer the last K-1
    pre-conv inputs [B, K-1, C] and the delta-rule state, carried from one call to the next."""

    def __init__(self, chunk_size: int):
        self.chunk_size, self.windows, self.states = chunk_size, {}, {}

    def conv(self, j, x, weight, bias):
        K = weight.shape[-1]
        ext = torch.cat([self.windows.get(j, x.new_zeros(x.shape[0], K - 1, x.shape[-1])), x], 1)
        self.windows[j] = ext[:, ext.shape[1] - (K - 1) :]
        # outputs past the zero padding see only ext
        return dense_conv_silu(ext, weight, bias)[:, K - 1 :]

    def rule(self, j, q, k, v, gate):
        g, beta = gate.values()
        if q.shape[1] == 1:  # decode: a chunked step would pad one token to a whole chunk
            o, self.states[j] = gated_delta_rule_recurrent(q, k, v, g, beta, self.states.get(j))
        else:
            o, self.states[j] = gated_delta_rule_chunked(
                q, k, v, g, beta, self.states.get(j), self.chunk_size
            )
        return o


def causal_forward(model: nn.Module, ids: torch.Tensor, tap_layers: tuple[int, ...] = ()):
    """`model.forward_train(ids, tap_layers)`; hybrid targets run it on 16-token delta-rule chunks (the same
    function, ~3x cheaper than the default 64 on training-length rows)."""
    if not isinstance(model, Qwen3_5ForCausalLM):
        return model.forward_train(ids, tap_layers)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    hidden, taps = model.hidden_states(
        ids, pos, causal_attend(model.scale), tap_layers, _DenseRecurrentState(16)
    )
    return model.logits(hidden), taps


def lm_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    logits, _ = causal_forward(model, ids)
    labels = ids[:, 1:].clone()
    if mask is not None:
        labels[~mask[:, 1:]] = -100
    return F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=-100
    )


def export_lm(model: nn.Module, cfg: dict, out_dir: str, dtype: torch.dtype | None = None) -> None:
    hybrid = isinstance(model, Qwen3_5ForCausalLM)
    cfg = dict(
        cfg,
        architectures=["Qwen3_5ForCausalLM" if hybrid else "Qwen3ForCausalLM"],
        model_type="qwen3_5_text" if hybrid else "qwen3",
    )
    if dtype is not None:
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    skip = ("lm_head.",) if cfg.get("tie_word_embeddings") else ()
    save_model(model, out_dir, cfg, dtype=dtype, skip=skip)


def train_lm(
    cfg: dict,
    sequences,
    *,
    steps: int,
    lr: float = 3e-3,
    batch_size: int = 32,
    warmup: float | int = 0.04,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    seed: int = 0,
    device: str = "cpu",
    autocast_dtype: torch.dtype | None = None,
    out_dir: str | None = None,
    save_every: int = 0,
    resume: bool = True,
    save_dtype: torch.dtype | None = None,
    progress: bool = True,
    history: list | None = None,
    eval_sequences: torch.Tensor | None = None,
    threads: int | None = None,
) -> nn.Module:
    """Pretrain a target (dense Qwen3, or hybrid Qwen3.5 for a `qwen3_5_config`) from scratch on `sequences`
    (see `batches` for accepted forms) with AdamW, warmup (a ratio if < 1, else steps) and cosine decay.
    With `out_dir`, checkpoints to out_dir/checkpoint/state.pt every `save_every` steps (resumed when
    `resume`) and exports HF format (config.json + model.safetensors, tied lm_head skipped) loadable by
    `load_target` and transformers.
    `history` (if given) receives {"step", "loss", "lr"} per step and {"step", "eval_loss"} at the end."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    # hybrid Qwen3.5 when layer_types has linear_attention
    model = build_target(TargetConfig.from_dict(cfg))
    init_weights(model, float(cfg.get("initializer_range", 0.02)))
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
    )
    ckpt = os.path.join(out_dir, "checkpoint", "state.pt") if out_dir else None
    start = 0
    if ckpt and resume and os.path.exists(ckpt):
        start = int(load_checkpoint(ckpt, model, opt)["step"])
    warm = int(warmup * steps) if warmup < 1 else int(warmup)
    stream = batches(sequences, batch_size, seed, start)
    bar = progress_bar(steps, start, progress, "train-target")
    for step in range(start, steps):
        ids, mask = next(stream)
        ids = ids.to(device)
        mask = None if mask is None else mask.to(device)
        cur = lr_at(step, steps, lr, warm, min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = cur
        with autocast(device, autocast_dtype):
            loss = lm_loss(model, ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        val = loss.item()
        if history is not None:
            history.append({"step": step + 1, "loss": val, "lr": cur})
        bar.set_postfix(loss=f"{val:.3f}", refresh=False)
        bar.update(1)
        if ckpt and save_every and (step + 1) % save_every == 0:
            save_checkpoint(ckpt, model, opt, step + 1, {"config": cfg})
    bar.close()
    model.eval()
    if eval_sequences is not None and history is not None:
        with torch.no_grad(), autocast(device, autocast_dtype):
            history.append(
                {"step": steps, "eval_loss": lm_loss(model, eval_sequences.to(device)).item()}
            )
    if out_dir:
        export_lm(model, cfg, out_dir, save_dtype)
    return model


def _cached_attend(scale: float, cache: dict):
    """Causal attention that appends each layer's new K/V to `cache` (a dense per-call KV cache)."""

    def attend(layer: int, q, k, v):
        if layer in cache:
            k = torch.cat([cache[layer][0], k], 1)
            v = torch.cat([cache[layer][1], v], 1)
        cache[layer] = (k, v)
        groups = q.shape[-2] // k.shape[-2]
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        kh, vh = kh.repeat_interleave(groups, 1), vh.repeat_interleave(groups, 1)
        # a prefill chunk is causal; a single new token sees everything cached
        causal = q.shape[1] > 1
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale).transpose(
            1, 2
        )

    return attend


def _next_logits(
    model: nn.Module, ids: torch.Tensor, cache: dict | None, done: int
) -> torch.Tensor:
    """Logits of the last position. Qwen3 / Qwen3.5 targets reuse `cache` (KV per attention layer, plus the
    recurrent state under key "linear"; new tokens = ids[:, done:]); other targets re-run the whole prefix."""
    if cache is None:
        return model.forward_train(ids)[0][:, -1]
    new = ids[:, done:]
    pos = torch.arange(done, ids.shape[1], device=ids.device).expand_as(new)
    linear = (
        cache.setdefault("linear", _DenseRecurrentState(16))
        if isinstance(model, Qwen3_5ForCausalLM)
        else None
    )
    hidden, _ = model.hidden_states(new, pos, _cached_attend(model.scale, cache), (), linear)
    return model.logits(hidden[:, -1])


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts,
    new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 256,
    device: str | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> list[list[int]]:
    """Plain autoregressive generation for small models (dense KV cache, plus the recurrent state of hybrid
    targets; full re-forward for others). `prompts` is ids [N, P] or a list of id lists (grouped by length,
    so no padding ever enters attention). Greedy at temperature 0, else sampled from softmax(logits / T)
    with a seeded generator. Returns prompt + continuation per prompt."""
    device = device or next(model.parameters()).device
    rows = prompts.tolist() if isinstance(prompts, torch.Tensor) else [list(p) for p in prompts]
    gen = torch.Generator(device=device).manual_seed(seed)
    out: list[list[int] | None] = [None] * len(rows)
    by_len: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_len.setdefault(len(r), []).append(i)
    for _, idx in sorted(by_len.items()):
        for lo in range(0, len(idx), batch_size):
            part = idx[lo : lo + batch_size]
            ids = torch.tensor([rows[i] for i in part], dtype=torch.long, device=device)
            cache = {} if isinstance(model, (Qwen3ForCausalLM, Qwen3_5ForCausalLM)) else None
            done = 0
            for _ in range(new_tokens):
                with autocast(device, autocast_dtype):
                    last = _next_logits(model, ids, cache, done).float()
                done = ids.shape[1]
                if temperature <= 0:
                    nxt = last.argmax(-1)
                else:
                    probs = torch.softmax(last / temperature, -1)
                    nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
                ids = torch.cat([ids, nxt[:, None]], 1)
            for j, i in enumerate(part):
                out[i] = ids[j].tolist()
    return out  # type: ignore[return-value]
