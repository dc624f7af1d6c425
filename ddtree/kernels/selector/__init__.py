"""Kernels of DFlash2's candidate selector, each one launch after the PyTorch transition table
(`markov_tree.transitions`, one batched matmul): `selector_chain`, the greedy chain's walk
(reference `markov_tree.greedy_chain`), and `select_markov_nodes`, the path-conditioned tree's
node selection (its D beams in the kernel, then `tree.select_from_beams`; reference
`markov_tree.select_markov_nodes`). The kernels where `use_kernel` (CUDA with Triton; on the CPU
only under TRITON_INTERPRET=1 and DDTREE_FUSED_KERNELS_INTERPRET=1: the tests), the references
with DDTREE_REFERENCE=kernels, without Triton, and for trees past the kernel's size. Both
read the same table with the same fp32 adds and orders: equal bit for bit."""

from __future__ import annotations

import torch

from ddtree import envs
from ddtree.kernels.availability import decorated_now, kernels_run_on, triton_importable
from ddtree.speculative.markov_tree import (
    MarkovDraft,
    MarkovNodes,
    greedy_chain,
    select_markov_nodes_reference,
    transitions,
)
from ddtree.speculative.tree import select_from_beams

__all__ = ["MAX_PAIRS", "select_markov_nodes", "selector_chain", "use_kernel"]

# (slot, child) pairs one program ranks per depth (budget and k padded to powers of two)
MAX_PAIRS = 4096


def _triton():
    from ddtree.kernels.selector import triton as mod

    return decorated_now(mod)


def use_kernel(t: torch.Tensor) -> bool:
    return not envs.REFERENCE.has("kernels") and kernels_run_on(t) and triton_importable()


def selector_chain(roots: torch.Tensor, draft: MarkovDraft) -> tuple[torch.Tensor, torch.Tensor]:
    """`markov_tree.ChainSteps`: (tokens [b, D], log q [b, D]) of the greedy chain."""
    if use_kernel(draft.unary):
        t = transitions(roots, draft)
        return _triton().selector_chain(t.logq[..., 0], t.child[..., 0], draft.cand)
    return greedy_chain(roots, draft)


def select_markov_nodes(
    root_tokens: torch.Tensor,
    draft: MarkovDraft,
    budget: int,
    k: int,
    shadow_linear: bool,
    limit: torch.Tensor,
    budgets: torch.Tensor | None = None,
) -> MarkovNodes:
    """`markov_tree.SelectMarkov`: the beams in one launch where the kernel runs."""
    b, D, _ = draft.unary.shape
    pairs = (1 << (budget - 1).bit_length()) * (1 << (k - 1).bit_length())
    if not (use_kernel(draft.unary) and 2 <= budget and pairs <= MAX_PAIRS):
        return select_markov_nodes_reference(
            root_tokens, draft, budget, k, shadow_linear, limit, budgets
        )
    t = transitions(root_tokens, draft)
    scores, pslots, toks = _triton().markov_beams(t.logq, t.child, draft.cand, budget, k)
    nodes = select_from_beams(
        root_tokens,
        scores.reshape(b, D * budget),
        pslots.reshape(b, D * budget),
        toks.reshape(b, D * budget),
        budget,
        shadow_linear,
        limit,
        budgets,
    )
    return MarkovNodes(nodes, scores[:, :, 0])
