"""Target-token selection at every tree node: argmax at T=0, an exact sample from the filtered target
distribution at T>0. Each node draws independently (its own exponential race), so walking the tree with
these draws emits every token from p(. | emitted prefix): the output distribution is the target's."""

from __future__ import annotations

import torch

from ddtree.engine.request import SamplingParams


def filter_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Temperature-scaled fp32 logits with top-k / top-p filtered entries set to -inf. logits [..., V]."""
    x = logits.float() / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # keep the smallest prefix reaching top_p
        # the top token always stays: a top_p that rounds to 0 in fp32 would otherwise drop every entry
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample_from(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """One independent sample per row of logits [n, V] (exponential race: argmax p / E, E ~ Exp(1))."""
    if params.greedy:
        return logits.argmax(-1)
    probs = torch.softmax(
        filter_logits(logits, params.temperature, params.top_k, params.top_p), dim=-1
    )
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float32)
    race = -torch.log(u.clamp_min(1e-20))
    return (probs / race).argmax(-1)


def sample_nodes(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list,
    greedy: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [b, n, V] -> tokens [b, n]. Greedy rows share one batched argmax (`greedy`, when the caller has it
    already: a CUDA graph computed it)."""
    out = logits.argmax(-1) if greedy is None else greedy.clone()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_from(logits[i], p, generators[i])
    return out
