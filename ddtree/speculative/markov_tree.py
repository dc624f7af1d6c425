"""Draft trees for DFlash2's candidate selector: path-conditioned (Markov) best-first trees.

A DFlash2 draft gives, per depth d, K candidates c (the unary logits' top-K) and their scores
against a predecessor token p: s_d(c | p) = u_d[c] + <P[p], E_d[c]> (P the predecessor codebook,
E_d[c] = successor_codebook[c] * hidden_projection(h_d): `MarkovDraft.edge`). A node of depth d - 1
with token p has children distributed as q_d(. | p) = softmax_c s_d(c | p) (times the unary mass
of the candidates: `Transitions`); its path score is its parent's plus log q_d(its token | the
parent's token), so every score is a sum of log-probs <= 0 and a prefix scores >= each of its
extensions.

That keeps DDTree's per-depth beam exact here, by an argument that needs no shared per-depth
distribution: let T be the best B nodes overall (prefix-closed: a parent scores >= its child). A
node of T at depth d + 1 has its parent in T; every depth-d node scoring above that parent is in T
too, and T has B nodes, so the parent ranks in the best B of depth d. By induction each depth's
members of T are extensions of the kept beam and rank in its best B. The beam also keeps the greedy
chain (argmax child of the chain node) at slot 0 of every depth: T holds at most B - d nodes of
depth d + 1 >= 2 (their d ancestors are in T), so one forced slot never displaces a member, and
shadow-linear (the chain first) needs it there anyway.

A child's distribution depends on its parent only through the parent's token, and a node of depth
d >= 1 carries one of the K candidates of position d (depth 0: the root). So every transition of
a round is known up front: `transitions` rescores all (parent candidate, child candidate) pairs of
all depths in one batched bilinear form [b * D, K, r] x [b * D, r, K], and ranks each parent's
children. The beam then only gathers table rows by its nodes' candidate index (no per-node
rescoring), the greedy chain follows each row's best child, and chain and tree read the same
numbers. Fixed shapes, no host syncs: capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from ddtree.speculative.tree import (
    DraftTree,
    TreeNodes,
    _assemble,
    _best_first,
    _depth_limit,
    row_logsumexp,
    select_from_beams,
)


class MarkovDraft(NamedTuple):
    """One DFlash2 draft of b requests over D positions with K candidates each, rank r."""

    logits: Tensor  # [b, D, V] unary logits (output multiplier and softcap applied)
    unary: Tensor  # [b, D, K] fp32 top-K unary logits, descending
    cand: Tensor  # [b, D, K] int64 their token ids
    edge: Tensor  # [b, D, K, r] fp32 successor_codebook[cand] * hidden_projection(h_d)
    codebook: Tensor  # [V, r] the predecessor codebook (any float dtype)


def child_scores(draft: MarkovDraft, d: int, parents: Tensor) -> Tensor:
    """s_d(c | p) [b, n, K] fp32 for parent tokens [b, n] at depth index d (0-based: the children
    are drafted position d + 1), node by node (tests: an oracle independent of `transitions`)."""
    b, n = parents.shape
    code = draft.codebook.index_select(0, parents.reshape(-1)).view(b, n, -1).float()
    return draft.unary[:, d, None, :] + torch.bmm(code, draft.edge[:, d].transpose(1, 2))


class Transitions(NamedTuple):
    """Per depth index d and parent row j (the parent's candidate index at position d - 1; at d = 0
    every row is the root's), its children best first: ranked by the raw score s (a stable sort:
    ties to the higher unary), so subtracting log Z can never reorder them. The log-probability
    is log softmax_K s + log m_d, m_d the unary softmax mass of the K candidates: the selector
    orders tokens within its candidate set, the unary model estimates that the token is in it.
    The constant shifts each depth's scores alike (the chain and each node's child ranking are
    unchanged) and moves budget between depths toward where the draft is likely to be right."""

    logq: Tensor  # [b, D, K, K] fp32 log q_d(child | parent row j), descending along the last dim
    child: Tensor  # [b, D, K, K] int64 the children's candidate index (a column of cand[:, d])


def transitions(root_tokens: Tensor, draft: MarkovDraft) -> Transitions:
    b, D, K = draft.unary.shape
    r = draft.edge.shape[-1]
    root = root_tokens.to(device=draft.unary.device, dtype=torch.int64)
    parent = torch.cat([root[:, None, None].expand(b, 1, K), draft.cand[:, :-1]], 1)
    code = draft.codebook.index_select(0, parent.reshape(-1)).view(b * D, K, r).float()
    edge = draft.edge.reshape(b * D, K, r)
    s = draft.unary.reshape(b * D, 1, K) + torch.bmm(code, edge.transpose(1, 2))
    order = s.sort(dim=-1, descending=True, stable=True).indices
    # calibrated: q orders the K candidates; that the token is among them at all is the unary
    # model's estimate, their softmax mass m_d (a per-depth constant: no ranking changes)
    log_mass = draft.unary.logsumexp(-1) - row_logsumexp(draft.logits).squeeze(-1)
    logq = s.gather(-1, order) - s.logsumexp(-1, keepdim=True) + log_mass.reshape(b * D, 1, 1)
    return Transitions(logq.view(b, D, K, K), order.view(b, D, K, K))


def greedy_chain(root_tokens: Tensor, draft: MarkovDraft) -> tuple[Tensor, Tensor]:
    """(tokens [b, D], log q [b, D] fp32): each position's argmax of s given the token chosen
    before it, walked over `transitions` (the reference of `kernels/selector`'s one launch)."""
    t = transitions(root_tokens, draft)
    b, D, K = draft.unary.shape
    row = torch.zeros(b, 1, dtype=torch.int64, device=draft.unary.device)
    toks, logq = [], []
    for d in range(D):
        logq.append(t.logq[:, d, :, 0].gather(1, row)[:, 0])
        row = t.child[:, d, :, 0].gather(1, row)
        toks.append(draft.cand[:, d].gather(1, row)[:, 0])
    return torch.stack(toks, 1), torch.stack(logq, 1)


# (root_tokens [b], draft) -> (tokens [b, D], log q [b, D]) equal to `greedy_chain`: the seam for a
# fused walk; the engine passes kernels/selector's
ChainSteps = Callable[[Tensor, MarkovDraft], "tuple[Tensor, Tensor]"]


def build_markov_chain(
    root_tokens: Tensor,
    draft: MarkovDraft,
    max_depth: Tensor | None = None,
    steps: ChainSteps | None = None,
) -> DraftTree:
    """The DFLASH chain as DFlash2 decodes it (each position's argmax of s given the token chosen
    before it; n = 1 + D, nodes past max_depth[b] padding), with its path probabilities."""
    b, D, _ = draft.unary.shape
    device = draft.unary.device
    toks, logq = (steps or greedy_chain)(root_tokens, draft)
    depth = torch.arange(1, D + 1, device=device).expand(b, D)
    limit = _depth_limit(max_depth, b, D, device)
    ok = depth <= limit[:, None]
    tree = _assemble(
        root_tokens,
        torch.where(ok, toks, 0),
        torch.where(ok, depth - 1, -1),
        torch.where(ok, depth, 0),
        ok,
        D,
        chain=True,
    )
    tree.chain_probs = torch.where(ok, logq.cumsum(1).exp(), 0.0)
    return tree


class MarkovNodes(NamedTuple):
    nodes: TreeNodes
    chain_scores: Tensor  # [b, D] fp32 path score of the greedy chain's node at each depth


# select(root_tokens [b], draft, budget, k, shadow_linear, limit [b], budgets [b] | None)
#   -> MarkovNodes: the seam for a fused selection (kernels may implement it; the engine chooses)
SelectMarkov = Callable[[Tensor, MarkovDraft, int, int, bool, Tensor, "Tensor | None"], MarkovNodes]


def build_markov_tree(
    root_tokens: Tensor,
    draft: MarkovDraft,
    budget: int,
    topk_cap: int,
    shadow_linear: bool,
    max_depth: Tensor | None = None,
    budgets: Tensor | None = None,
    select: SelectMarkov | None = None,
) -> DraftTree:
    """The best `budget` nodes by path-conditioned score, each node's children its k = min(topk_cap,
    budget, K) best candidates under its own token; `shadow_linear`: the greedy chain first (it
    counts toward the budget); budgets [b] cut each request to the first budgets[i] nodes of the
    best-first order (as `tree.build_tree`). path_probs / chain_probs as DraftTree defines them:
    here products of the selector's q along the path (the drafter's joint probability)."""
    b, D, K = draft.unary.shape
    assert budget >= 1 and topk_cap >= 1 and D >= 1
    device = draft.unary.device
    k = min(topk_cap, budget, K)
    limit = _depth_limit(max_depth, b, D, device)
    cut = None if budgets is None else budgets.to(device=device, dtype=torch.int64)
    select = select or select_markov_nodes_reference
    out = select(root_tokens, draft, budget, k, shadow_linear, limit, cut)
    tree = DraftTree(*out.nodes[:5], D)
    tree.path_probs = out.nodes.path_scores.exp()
    depth = torch.arange(1, D + 1, device=device)
    tree.chain_probs = torch.where(depth[None, :] <= limit[:, None], out.chain_scores.exp(), 0.0)
    return tree


def select_markov_nodes_reference(
    root_tokens: Tensor,
    draft: MarkovDraft,
    budget: int,
    k: int,
    shadow_linear: bool,
    limit: Tensor,
    budgets: Tensor | None = None,
) -> MarkovNodes:
    """The PyTorch node selection (`SelectMarkov`): per depth every beam node's k best children (its `transitions` row),
    the best B of those B * k (slot, rank) pairs, ties to the lower pair (the chain's pair (0, 0)
    forced to slot 0), then `tree.select_from_beams`."""
    b, D, K = draft.unary.shape
    device, B = draft.unary.device, budget
    t = transitions(root_tokens, draft)
    logq, child = t.logq[..., :k], t.child[..., :k]
    beam = torch.full((b, B), float("-inf"), device=device)
    beam[:, 0] = 0.0  # the root, the only "depth-0 prefix"
    row = torch.zeros(b, B, dtype=torch.int64, device=device)  # each node's candidate index
    first = torch.arange(B * k, device=device) == 0  # (slot 0, rank 0): the chain's next node
    scores, pslots, toks = [], [], []
    for d in range(D):
        idx = row[:, :, None].expand(b, B, k)
        cand = (beam[:, :, None] + logq[:, d].gather(1, idx)).reshape(b, B * k)
        pick = _best_first(torch.where(first, float("inf"), cand), B)
        beam = cand.gather(1, pick)
        row = child[:, d].gather(1, idx).reshape(b, B * k).gather(1, pick)
        scores.append(beam)
        pslots.append(pick // k)
        toks.append(draft.cand[:, d].gather(1, row))
    score_all = torch.stack(scores, 1)  # [b, D, B]
    nodes = select_from_beams(
        root_tokens,
        score_all.reshape(b, D * B),
        torch.stack(pslots, 1).reshape(b, D * B),
        torch.stack(toks, 1).reshape(b, D * B),
        B,
        shadow_linear,
        limit,
        budgets,
    )
    return MarkovNodes(nodes, score_all[:, :, 0])
