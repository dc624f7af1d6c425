"""DDTree draft-tree construction on the device, batched over requests.

Everything here is fixed-shape and sync-free (no .item(), no data-dependent shapes, no Python branches
on tensor values), so `build_tree` / `build_chain` can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor


@dataclass
class DraftTree:
    """Batched draft tree; n = 1 + budget nodes per request, node 0 is the root.

    Nodes are ordered root, then by increasing depth (parents precede children), within a depth by
    descending score. Padding nodes (fewer prefixes than budget) come last.
    """

    tokens: Tensor  # [b, n] int64; tokens[:, 0] = root (bonus) token; padding 0
    parents: Tensor  # [b, n] int64; root and padding -1; parent index < node index
    depths: Tensor  # [b, n] int64; root 0, drafted nodes 1..D, padding 0
    valid: Tensor  # [b, n] bool; root True, padding False
    tree_mask: (
        Tensor  # [b, n, n] bool; row i = ancestors of i and i itself (padding rows: self only)
    )
    num_depths: int | None = None  # static bound D on node depth; None means n - 1
    # [b, B] fp32 drafter path probability of the build's candidates in best-first order, before
    # any per-request budget cut (0 past the candidates): its prefix sum at b - 1 is the drafter's
    # expected accepted drafts of the budget-b tree (DDTree Prop. 1), for every b <= B at once
    path_probs: Tensor | None = None
    # [b, D] fp32 drafter path probability of the top-1 chain's node at each depth (0 past the
    # request's depth limit): its sum is the DFLASH chain's expected accepted drafts, so a tree
    # round also tells the budget policy what the chain rung would gain
    chain_probs: Tensor | None = None
    # [b, n] fp32 drafter path probability of each node in node order (root 1, padding 0): a
    # node's marginal contribution to the expected accepted length, what a batch-wide budget
    # ranks (speculative/batch_budget.py). Non-increasing from a parent to its child
    node_probs: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def depth_bound(self) -> int:
        return self.num_nodes - 1 if self.num_depths is None else self.num_depths

    def narrow(self, n: int) -> DraftTree:
        """The first n nodes (views). Exact when no request has more than n valid nodes: valid nodes
        come first and their ancestors precede them, so nothing cut is referenced."""
        if n == self.num_nodes:
            return self
        return DraftTree(
            self.tokens[:, :n],
            self.parents[:, :n],
            self.depths[:, :n],
            self.valid[:, :n],
            self.tree_mask[:, :n, :n],
            self.num_depths,
            self.path_probs,
            self.chain_probs,
            None if self.node_probs is None else self.node_probs[:, :n],
        )

    def positions(self, seq_lens: Tensor) -> Tensor:
        """[b, n] position ids: seq_lens[:, None] + depths (siblings share a position)."""
        return seq_lens[:, None].to(self.depths.dtype) + self.depths

    @classmethod
    def from_parents(
        cls, tokens: Tensor, parents: Tensor, num_depths: int | None = None
    ) -> DraftTree:
        """Derive depths/valid/mask from parent links (parent < node; -1 marks root and padding)."""
        n = tokens.shape[1]
        bound = n - 1 if num_depths is None else num_depths
        anc = ancestors(parents, bound)
        depths = (anc[:, :, 1:] != anc[:, :, :-1]).sum(-1)  # upward steps actually taken
        valid = (parents >= 0) | (torch.arange(n, device=tokens.device) == 0)[None, :]
        return cls(tokens, parents, depths, valid, ancestor_mask(parents, bound), num_depths)


def ancestors(parents: Tensor, num_depths: int) -> Tensor:
    """[b, n, D+1]: column t = t-th ancestor of each node, repeating the topmost one (root) after it."""
    b, n = parents.shape
    cur = torch.arange(n, device=parents.device).expand(b, n)
    cols = [cur]
    for _ in range(num_depths):
        up = parents.gather(1, cur)
        cur = torch.where(up >= 0, up, cur)
        cols.append(cur)
    return torch.stack(cols, dim=-1)


def ancestor_mask(parents: Tensor, num_depths: int) -> Tensor:
    """[b, n, n] bool: row i = ancestors of i plus i itself (padding, with parent -1: self only)."""
    b, n = parents.shape
    mask = torch.zeros(b, n, n, dtype=torch.bool, device=parents.device)
    return mask.scatter_(2, ancestors(parents, num_depths), True)


# fp32 elements the temporaries of one `row_logsumexp` chunk may hold (its fp32 copy and exp)
LSE_CHUNK_ELEMS = 1 << 25


def row_logsumexp(x: Tensor) -> Tensor:
    """fp32 logsumexp over the last dim, [..., 1], in chunks of rows whose temporaries stay under
    LSE_CHUNK_ELEMS elements whatever the batch. A whole-tensor logsumexp materialises an fp32
    copy and its exp of every row: at batch 256 of a 152k vocabulary that is gigabytes outside
    every planned buffer (the draft graph's capture ran out of memory there)."""
    V = x.shape[-1]
    flat = x.reshape(-1, V)
    step = max(1, LSE_CHUNK_ELEMS // V)
    if flat.shape[0] <= step:
        return x.float().logsumexp(dim=-1, keepdim=True)
    parts = [flat[i : i + step].float().logsumexp(dim=-1) for i in range(0, flat.shape[0], step)]
    return torch.cat(parts).view(*x.shape[:-1], 1)


def topk_logprobs(draft_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """fp32 log-probs and token ids of the top-k tokens per depth: ([b, D, k], [b, D, k]).

    topk runs on the logits (not on log-probs) so subtracting log Z cannot merge distinct values into
    ties; build_tree and build_chain share this so their top-1 tokens always agree.
    """
    vals, ids = draft_logits.topk(k, dim=-1)  # native dtype: exact, and half the bytes of fp32
    return vals.float() - row_logsumexp(draft_logits), ids


def _best_first(score: Tensor, k: int) -> Tensor:
    """Indices of the k best entries along dim 1: descending score, ties to the lower index.

    A stable sort makes tie-breaking exact and identical on CPU and CUDA (topk's tie order is
    unspecified); on the H200 it is also faster than topk for these row lengths.
    """
    # Scores never hold -0.0 (sums/differences of +0.0 and negatives round to +0.0), which a
    # radix sort would order below +0.0.
    return score.sort(dim=1, descending=True, stable=True).indices[:, :k]


def _depth_limit(max_depth: Tensor | None, b: int, D: int, device: torch.device) -> Tensor:
    if max_depth is None:
        return torch.full((b,), D, dtype=torch.int64, device=device)
    return max_depth.to(device=device, dtype=torch.int64).clamp(0, D)


def _beam_candidates(B: int, K: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(parent slot, rank) pairs, in flat (slot, rank) order, that can enter a depth's top B.

    Beam scores and per-depth log-probs are both sorted best-first, so pair (s, r) is beaten by
    every (s' <= s, r' <= r) pair; it can be in the top B only if (s + 1) * (r + 1) <= B. That keeps
    about B * ln(B) of the B * K pairs. Built with device ops only (no host copy), capture-safe.
    """
    total = sum(min(K, B // (s + 1)) for s in range(B))  # host ints: the static shape
    per_slot = (B // torch.arange(1, B + 1, device=device)).clamp(max=K)
    ends = per_slot.cumsum(0)
    pos = torch.arange(total, device=device)
    slot = torch.searchsorted(ends, pos, right=True)
    return slot, pos - (ends - per_slot).gather(0, slot)


class TreeNodes(NamedTuple):
    """A node selection's output: the DraftTree fields (n = 1 + budget, root first) and the path
    score of each selected candidate in best-first order, before any budget cut (-inf past the
    candidates; build_tree exponentiates it into `DraftTree.path_probs`)."""

    tokens: Tensor  # [b, n] int64
    parents: Tensor  # [b, n] int64
    depths: Tensor  # [b, n] int64
    valid: Tensor  # [b, n] bool
    tree_mask: Tensor  # [b, n, n] bool
    path_scores: Tensor  # [b, budget] fp32


# select(root_tokens [b], logp [b, D, K] fp32, ids [b, D, K], budget, shadow_linear,
#        limit [b] int64 in 0..D, budgets [b] int64 | None) -> TreeNodes, bit-identical to
# `select_nodes`. The seam for a fused build: speculative/ imports no kernels
# (tests/test_layering.py), so the engine hands build_tree `ddtree.kernels.tree_build.select_nodes`
# (one Triton launch where our kernels run, this module's `select_nodes` elsewhere); a caller that
# passes nothing gets the PyTorch reference below (the CPU path and the oracle).
SelectNodes = Callable[[Tensor, Tensor, Tensor, int, bool, Tensor, "Tensor | None"], TreeNodes]


def build_tree(
    root_tokens: Tensor,
    draft_logits: Tensor,
    budget: int,
    topk_cap: int,
    shadow_linear: bool,
    max_depth: Tensor | None = None,
    budgets: Tensor | None = None,
    select: SelectNodes | None = None,
    node_scores: bool = False,
) -> DraftTree:
    """Best `budget` prefixes (score = sum of per-depth fp32 log-probs, tokens within each depth's top-K).

    budgets [b] (<= budget): request i keeps only the first budgets[i] nodes of the best-first
    order, i.e. the budgets[i]-node tree (the order is prefix-closed: a parent ranks before its
    child), packed first; the other nodes become padding. One build serves mixed budgets.
    select: the node selection (None: `select_nodes`; see `SelectNodes`). node_scores: also
    `node_probs` (2 D launches more; what a batch-wide budget ranks)."""
    b, D, V = draft_logits.shape
    assert budget >= 1 and topk_cap >= 1 and D >= 1
    device = draft_logits.device
    logp, ids = topk_logprobs(draft_logits, min(topk_cap, budget, V))
    limit = _depth_limit(max_depth, b, D, device)
    cut = None if budgets is None else budgets.to(device=device, dtype=torch.int64)
    nodes = (select or select_nodes)(root_tokens, logp, ids, budget, shadow_linear, limit, cut)
    tree = DraftTree(*nodes[:5], D)
    tree.path_probs = nodes.path_scores.exp()  # exp(-inf) = 0 past the candidates
    tree.chain_probs = _chain_probs(logp, limit)
    if node_scores:
        tree.node_probs = node_path_scores(tree, logp, ids).exp()
    return tree


def node_path_scores(tree: DraftTree, logp: Tensor, ids: Tensor) -> Tensor:
    """[b, n] fp32 path score of each node in node order (root 0, padding -inf): each node's
    token log-prob at its depth (logp / ids [b, D, K] of `topk_logprobs`) added to its parent's
    score, depth by depth: the beam's own additions in its order, so the scores equal the
    selection's `path_scores` bit for bit, and a child never scores above its parent (adding a
    log-prob <= 0 rounds to at most the parent's score)."""
    b, n = tree.tokens.shape
    D, K = logp.shape[1], logp.shape[2]
    idx = (tree.depths - 1).clamp(0, D - 1)[..., None].expand(b, n, K)
    hit = ids.gather(1, idx) == tree.tokens[..., None]  # topk ids are distinct: one hit at most
    token_lp = torch.where(hit, logp.gather(1, idx), 0.0).sum(-1)
    token_lp = torch.where(tree.depths > 0, token_lp, 0.0)  # the root's score stays 0
    return torch.where(tree.valid, path_sums(tree, token_lp), float("-inf"))


def path_sums(tree: DraftTree, token_lp: Tensor) -> Tensor:
    """[b, n] each node's `token_lp` (its token's log-prob, 0 at the root) summed down its root
    path, depth by depth in the beam's own order of additions. Padding nodes: meaningless."""
    par = tree.parents.clamp(min=0)
    # pass t makes every node of depth <= t final (its parent was final after pass t - 1)
    score = token_lp
    for _ in range(tree.depth_bound - 1):
        score = score.gather(1, par) + token_lp
    return score


def select_nodes(
    root_tokens: Tensor,
    logp: Tensor,
    ids: Tensor,
    budget: int,
    shadow_linear: bool,
    limit: Tensor,
    budgets: Tensor | None = None,
) -> TreeNodes:
    """The PyTorch node selection: the per-depth beam, the best `budget` of its D * budget
    prefixes, the node order and the tree (see `SelectNodes`). ~13 launches per depth on CUDA."""
    b, D, K = logp.shape
    device = logp.device
    B = budget

    # Per-depth beam of the best B prefixes. A depth-(d+1) prefix in the best B has its parent in the
    # best B of depth d (otherwise each of those B better parents' top-1 extension would beat it).
    beam = torch.full((b, B), float("-inf"), device=device)
    beam[:, 0] = 0.0  # the root, the only "depth-0 prefix"
    cand_slot, cand_rank = _beam_candidates(B, K, device)
    scores, picks = [], []
    for d in range(D):
        cand = beam.index_select(1, cand_slot) + logp[:, d].index_select(1, cand_rank)
        pick = _best_first(cand, B)  # ties: lower parent slot, then lower rank
        beam = cand.gather(1, pick)
        scores.append(beam)
        picks.append(pick)
    pick_all = torch.stack(picks, 1)  # [b, D, B]
    score_all = torch.stack(scores, 1).reshape(b, D * B)  # depth-major: flat = (depth-1)*B + slot
    pslot_all = cand_slot[pick_all].reshape(b, D * B)
    tok_all = ids.gather(2, cand_rank[pick_all]).reshape(b, D * B)
    return select_from_beams(
        root_tokens, score_all, pslot_all, tok_all, B, shadow_linear, limit, budgets
    )


def select_from_beams(
    root_tokens: Tensor,
    score_all: Tensor,
    pslot_all: Tensor,
    tok_all: Tensor,
    B: int,
    shadow_linear: bool,
    limit: Tensor,
    budgets: Tensor | None = None,
) -> TreeNodes:
    """The tree from D per-depth beams of B prefixes each: score_all / pslot_all (parent's beam
    slot at the depth above) / tok_all [b, D * B] depth-major (flat = (depth - 1) * B + slot), -inf
    scores where a beam has fewer than B prefixes, beam slot 0 the top-1 chain at every depth. The
    best B prefixes overall (shadow_linear: the chain first), ordered by depth then slot."""
    b, DB = score_all.shape
    D, device = DB // B, score_all.device
    flat = torch.arange(D * B, device=device)
    depth_of = flat // B + 1
    ok = (score_all > float("-inf")) & (depth_of[None, :] <= limit[:, None])
    key = torch.where(ok, score_all, float("-inf"))
    if shadow_linear:
        # The top-1 chain is beam slot 0 at every depth (max score, lowest tie index), so it is
        # always available; forcing it first makes accept length >= the chain's for any target.
        chain = ((flat % B) == 0)[None, :] & (depth_of[None, :] <= limit.clamp(max=B)[:, None])
        key = torch.where(chain, float("inf"), key)
    # Ties go to the lower flat index, i.e. the shallower prefix: a parent never loses to its
    # (equal-score) child, so the selection stays prefix-closed.
    sel = _best_first(key, B)
    sel_ok = ok.gather(1, sel)
    path_scores = torch.where(sel_ok, score_all.gather(1, sel), float("-inf"))
    if budgets is not None:
        rank = torch.arange(B, device=device)
        sel_ok = sel_ok & (rank[None, :] < budgets[:, None])
    # Node order = depth-major flat order (depth, then beam slot = score order); padding last.
    order = torch.where(sel_ok, sel, sel + D * B).sort(dim=1).values
    node_ok = order < D * B
    node_flat = order % (D * B)

    node_depth = node_flat // B + 1
    node_id = torch.arange(1, B + 1, device=device).expand(b, B)
    flat_to_node = torch.zeros(b, D * B, dtype=torch.int64, device=device).scatter(
        1, node_flat, node_id
    )
    parent_flat = ((node_depth - 2) * B + pslot_all.gather(1, node_flat)).clamp(min=0)
    parent = torch.where(node_depth == 1, 0, flat_to_node.gather(1, parent_flat))

    tree = _assemble(
        root_tokens,
        torch.where(node_ok, tok_all.gather(1, node_flat), 0),
        torch.where(node_ok, parent, -1),
        torch.where(node_ok, node_depth, 0),
        node_ok,
        D,
    )
    return TreeNodes(
        tree.tokens, tree.parents, tree.depths, tree.valid, tree.tree_mask, path_scores
    )


def _chain_probs(logp: Tensor, limit: Tensor) -> Tensor:
    """[b, D] path probability of the top-1 chain's depth-d node (0 past the depth limit)."""
    depth = torch.arange(1, logp.shape[1] + 1, device=logp.device)
    return torch.where(depth[None, :] <= limit[:, None], logp[:, :, 0].cumsum(1).exp(), 0.0)


def build_chain(
    root_tokens: Tensor,
    draft_logits: Tensor,
    max_depth: Tensor | None = None,
    node_scores: bool = False,
) -> DraftTree:
    """The DFLASH chain of top-1 tokens (n = 1 + D); nodes beyond max_depth[b] are padding.
    node_scores: also `node_probs` (as `build_tree`'s: what a batch-wide budget ranks)."""
    b, D, _ = draft_logits.shape
    device = draft_logits.device
    logp, ids = topk_logprobs(draft_logits, 1)
    depth = torch.arange(1, D + 1, device=device).expand(b, D)
    limit = _depth_limit(max_depth, b, D, device)
    ok = depth <= limit[:, None]
    tree = _assemble(
        root_tokens,
        torch.where(ok, ids[:, :, 0], 0),
        torch.where(ok, depth - 1, -1),
        torch.where(ok, depth, 0),
        ok,
        D,
        chain=True,
    )
    tree.chain_probs = _chain_probs(logp, limit)
    if node_scores:  # node d is the depth-d chain node
        one = torch.ones(b, 1, dtype=torch.float32, device=device)
        tree.node_probs = torch.cat([one, tree.chain_probs], 1)
    return tree


def _assemble(
    root: Tensor,
    tokens: Tensor,
    parents: Tensor,
    depths: Tensor,
    ok: Tensor,
    D: int,
    chain: bool = False,
) -> DraftTree:
    b = tokens.shape[0]
    device = tokens.device
    root = root.to(device=device, dtype=torch.int64).reshape(b, 1)
    tokens = torch.cat([root, tokens], 1)
    parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=device), parents], 1)
    depths = torch.cat([torch.zeros((b, 1), dtype=torch.int64, device=device), depths], 1)
    valid = torch.cat([torch.ones((b, 1), dtype=torch.bool, device=device), ok], 1)
    if chain:
        # a chain's ancestors-and-self are the nodes at or above it: lower triangular on the valid
        # prefix, self only on padding (what ancestor_mask's D gathers build, in 4 launches)
        node = torch.arange(tokens.shape[1], device=device)
        below = node[None, :] <= node[:, None]
        mask = (below[None] & valid[:, :, None]) | (node[None, :] == node[:, None])[None]
    else:
        mask = ancestor_mask(parents, D)
    return DraftTree(tokens, parents, depths, valid, mask, D)
