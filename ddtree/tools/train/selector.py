"""The DFlash2 parts of the drafter recipe: initialisation, the warm start from a DFlash drafter, and
the selector's loss.

Objective (the one vllm-project/speculators trains DFlash2 with, rewritten here): the DFlash loss on
the unary logits plus `selector_alpha` x a K-way cross-entropy of the selector. Per block position
k the candidates are the unary top-K (what serving rescores); when the label is not among them it
replaces the K-th candidate, so every position has a label in a K-way softmax. The selector scores
the candidates against the teacher-forced predecessor (the label at k - 1; the anchor at k = 1):
the greedy chain is accepted through k exactly while its tokens equal the labels, so along an
accepted chain the predecessor it conditions on IS the label, and teacher forcing is exact. Both
terms carry the DFlash position weights exp(-(k - 1) / gamma).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models.configs import DrafterConfig


@torch.no_grad()
def init_dflash2(drafter: nn.Module, std: float = 0.02) -> None:
    """Convolutions at the identity (base tap 0 = 1, no dynamic part: the drafter computes what a
    DFlash drafter with its other weights computes) and a small random selector."""
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0] = 1.0
            conv.kernel_projection.weight.zero_()
    sel = drafter.candidate_selector
    for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
        nn.init.normal_(p, 0.0, std)


@torch.no_grad()
def warm_start(drafter: nn.Module, dflash_dir: str, std: float = 0.02) -> None:
    """A DFlash2 drafter that proposes exactly what the DFlash drafter in `dflash_dir` proposes:
    its weights, identity convolutions and a selector whose hidden_projection is zero (every
    rescoring term 0, so the chain is DFlash's top-1 chain); the random codebooks give the
    projection its first gradients."""
    from ddtree.models.loader import load_state

    src = DrafterConfig.from_path(dflash_dir)
    cfg = drafter.config
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "target_layer_ids",
    )
    bad = [k for k in keys if getattr(src, k) != getattr(cfg, k)]
    if src.is_dflash2 or bad:
        raise ValueError(
            f"--init-from {dflash_dir}: not a DFlash drafter of this geometry "
            f"({', '.join(bad) or src.architecture} differ)"
        )
    init_dflash2(drafter, std)
    drafter.candidate_selector.hidden_projection.weight.zero_()
    convs = tuple(
        f"layers.{i}.{c}."
        for i in range(cfg.num_hidden_layers)
        for c in ("attention_conv", "mlp_conv")
    )
    # every DFlash tensor must be there; only the convolutions and the selector are new
    load_state(
        drafter,
        dflash_dir,
        lambda k: k[len("model.") :] if k.startswith("model.") else k,
        optional=("candidate_selector.", *convs),
    )


def predecessors(anchor_tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[..., S-1] teacher-forced predecessor of each drafted position: the anchor token, then the
    labels shifted by one."""
    return torch.cat([anchor_tokens[..., None], labels[..., :-1]], -1)


def selector_terms(
    drafter: nn.Module,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    preds: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted sum of the selector's K-way cross-entropy, whether serving's greedy selector picks
    the label) over rows: hidden [N, H], logits [N, V] (unary), labels / preds / weights [N]."""
    sel = drafter.candidate_selector
    K = sel.top_k
    cand = logits.detach().topk(K, dim=-1).indices
    hit = cand == labels[:, None]
    has = hit.any(-1)
    target = torch.where(has, hit.int().argmax(-1), K - 1)
    cand[:, -1] = torch.where(has, cand[:, -1], labels)
    scores = sel.scores(hidden, logits.gather(-1, cand), preds, cand)
    nll = F.cross_entropy(scores, target, reduction="none")
    # where the label had to be injected, serving could never pick it
    picks = has & (scores.argmax(-1) == target)
    return (nll * weights).sum(), picks


@torch.no_grad()
def greedy_picks(
    drafter: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, preds: torch.Tensor
) -> torch.Tensor:
    """Serving's greedy selector choice [...] given teacher-forced predecessors [...]: hidden
    [..., H], logits [..., V]."""
    sel = drafter.candidate_selector
    unary, cand = logits.topk(sel.top_k, dim=-1)
    scores = sel.scores(hidden, unary, preds, cand)
    return cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]


def dflash2_from_dflash(
    dflash_dir: str,
    target_dir: str,
    out_dir: str,
    selector_rank: int = 128,
    noise: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Write a DFlash2 drafter carrying the DFlash drafter in `dflash_dir` (`warm_start`: its
    function exactly when `noise` is 0); `noise` perturbs the convolutions and the selector (its
    projections scaled by 1 / sqrt(fan-in)), so they compute something, e.g. for device tests and
    timings that must not run on zeros. Returns `out_dir`."""
    from ddtree.models.configs import TargetConfig
    from ddtree.models.drafters import build_drafter
    from ddtree.models.loader import save_model
    from ddtree.models.shapes import drafter_config_for

    src = DrafterConfig.from_path(dflash_dir)
    cfg = drafter_config_for(
        TargetConfig.from_path(target_dir),
        src.num_hidden_layers,
        src.block_size,
        src.mask_token_id,
        src.target_layer_ids,
        torch_dtype=str(dtype).removeprefix("torch."),
        architecture="DFlash2DraftModel",
        selector_rank=selector_rank,
    )
    drafter = build_drafter(DrafterConfig.from_dict(cfg))
    torch.manual_seed(seed)
    warm_start(drafter, dflash_dir)
    if noise:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "conv" in name or "candidate_selector" in name:
                    fan_in = p.shape[-1] if name.endswith("weight") else 1
                    p.add_(noise / fan_in**0.5 * torch.randn(p.shape, generator=g))
    save_model(drafter, out_dir, cfg, dtype=dtype)
    return out_dir
