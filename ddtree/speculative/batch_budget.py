"""One verify budget for the whole batch, divided by value, and the packed (ragged) verify layout.

A round drafts every request's best-first tree [b, W] (node 0 the root). Node j's drafter path
probability is its marginal contribution to the expected accepted length (DDTree Prop. 1), so the
most accepted tokens a round can expect from R drafted rows come from the R most probable nodes
of all requests together: a confident request gets a deep tree, an uncertain one a short chain or
only its root (an AR row). Roots are free: every request verifies its root, whatever it is given.

A parent is never less probable than its child, so any value threshold keeps an ancestor-closed
set; ties are broken to the shallower best-first rank, then the lower request, then (within a
request) the lower node index, which is never a child before its parent. The verify then runs
only the kept nodes: request i's q_len = 1 + cut[i] rows, packed one request after another.

Everything is fixed-shape and sync-free (the row budget R may be a host int or a device scalar;
the packed row count is a host int, a bucket >= b + R), so both steps fit in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree.speculative.tree import DraftTree, path_sums, row_logsumexp

__all__ = [
    "Allocation",
    "PackedLayout",
    "allocate",
    "batch_gain",
    "node_probs_from_logits",
    "node_values",
    "pack",
    "unpack",
]


def node_values(tree: DraftTree) -> Tensor:
    """[b, W] fp32 expected accepted tokens of each node: its path probability, lowered to the
    least probability on its root path (a no-op for the builders' own scores, a guarantee for any
    producer that a parent is worth at least its child). Padding -1, the root 1."""
    probs = tree.node_probs
    if probs is None:
        raise ValueError(
            "a batch-wide budget needs DraftTree.node_probs (build_tree / build_chain)"
        )
    v = torch.where(tree.tree_mask, probs.float()[:, None, :], float("inf")).amin(-1)
    root = torch.arange(tree.num_nodes, device=probs.device) == 0
    return torch.where(root[None, :], 1.0, torch.where(tree.valid, v, -1.0))


def node_probs_from_logits(tree: DraftTree, draft_logits: Tensor) -> Tensor:
    """[b, n] fp32 drafter path probability of each node (root 1, padding 0) from the drafter's
    logits [b, D, V] the tree was built from: each node's token log-prob at its depth (its logit
    less the depth's log Z) summed down its root path (`path_sums`). For a tree built without
    `node_scores` (the draft graphs' trees): a log Z per depth and one gathered logit per node,
    no top-k."""
    b, n = tree.tokens.shape
    D, V = draft_logits.shape[1], draft_logits.shape[2]
    depth = (tree.depths - 1).clamp(0, D - 1)
    flat = draft_logits.reshape(b, D * V).gather(1, depth * V + tree.tokens.clamp(0, V - 1))
    token_lp = flat.float() - row_logsumexp(draft_logits)[..., 0].gather(1, depth)
    token_lp = torch.where(tree.depths > 0, token_lp, 0.0)
    return torch.where(tree.valid, path_sums(tree, token_lp).exp(), 0.0)


@dataclass
class Allocation:
    cut: Tensor  # [b] int64 drafted nodes request i verifies (0: its root alone), sum <= R
    keep: Tensor  # [b, W] bool kept nodes: the root, and an ancestor-closed set of cut[i] nodes


def _ranked(tree: DraftTree, cap: Tensor) -> tuple[Tensor, Tensor]:
    """(rank [b, W]: each node's best-first rank in its request, key [b, W]: the value of its
    rank-r node, -1 past the request's eligible nodes or its cap)."""
    b, W = tree.tokens.shape
    node = torch.arange(W, device=tree.tokens.device)
    value = torch.where(node[None, :] == 0, -1.0, node_values(tree))  # roots are free
    # per request, best first: value descending, ties to the lower node index (a parent first)
    order = value.sort(dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, node.expand(b, W).contiguous())
    sorted_v = value.gather(1, order)
    cap = cap.to(device=node.device, dtype=torch.int64)
    ok = (sorted_v >= 0) & (node[None, :] < cap[:, None])
    return rank, torch.where(ok, sorted_v, -1.0)


def _global_order(key: Tensor):
    """All requests' ranked values, best first: flattened rank-major, so a stable sort breaks
    ties to the lower rank (a request's picks stay a prefix of its own order), then to the lower
    request. Flat index r * b + i."""
    return key.t().reshape(-1).sort(descending=True, stable=True)


def allocate(tree: DraftTree, cap: Tensor, total: int | Tensor) -> Allocation:
    """The `total` (R) drafted nodes of highest value across the batch, at most cap[i] (>= 0; 0:
    an AR row) from request i. cap [b] int64 on the tree's device."""
    b, W = tree.tokens.shape
    device = tree.tokens.device
    rank, key = _ranked(tree, cap)
    top = _global_order(key)
    take = (torch.arange(b * W, device=device) < total) & (top.values >= 0)
    cut = torch.zeros(b, dtype=torch.int64, device=device)
    cut.scatter_add_(0, top.indices % b, take.to(torch.int64))
    node = torch.arange(W, device=device)
    keep = (rank < cut[:, None]) | (node[None, :] == 0)
    return Allocation(cut, keep)


def batch_gain(tree: DraftTree, cap: Tensor) -> Tensor:
    """[b * W + 1] fp32: gain[R] = the expected accepted drafts of the batch's R best nodes (what
    `allocate(tree, cap, R)` keeps; flat past the last eligible node), gain[0] = 0. A round
    emits b + gain[R] tokens in expectation: the host's row budget (`RowCost.best_rows`) reads
    it back beside the round's tokens, for the next round's choice."""
    _, key = _ranked(tree, cap)
    values = _global_order(key).values.clamp(min=0)
    return torch.cat([values.new_zeros(1), values.cumsum(0)])


@dataclass
class PackedLayout:
    """The packed verify: request i's kept nodes at flat rows qo_indptr[i] .. qo_indptr[i+1] - 1,
    in node order (a parent before its child), then padding rows up to the bucket T.

    `tree` is the cut tree compacted to local order ([b, W], request i's kept nodes first, parents
    remapped, padding after): the accept walk and the commit run on it unchanged, since local
    node l of request i sits at logical KV position seq_lens[i] + l, as node l does in a dense
    verify. Read target outputs back into it with `unpack`."""

    tree: DraftTree  # [b, W] compacted cut tree; tree_mask is the verify's padded [b, W, W] mask
    q_lens: Tensor  # [b] int64 = 1 + cut
    qo_indptr: Tensor  # [b + 1] int64
    local_node: Tensor  # [b, W] full-tree node of each local node; -1 past q_len
    local_row: Tensor  # [b, W] flat row of each local node; -1 past q_len
    node_row: Tensor  # [b, W] flat row of each full-tree node; -1 where cut
    flat_req: Tensor  # [T] request of each flat row; -1 on padding rows
    flat_local: Tensor  # [T] local node index of each flat row; 0 on padding rows
    input_ids: Tensor  # [T] node tokens; 0 on padding rows
    positions: Tensor  # [T] RoPE positions seq_lens + depth; 0 on padding rows
    kv_positions: Tensor  # [T] logical KV positions seq_lens + local; 0 on padding rows

    @property
    def row_valid(self) -> Tensor:
        return self.flat_req >= 0


def _scatter_rows(values: Tensor, index: Tensor, num_rows: int, fill: int) -> Tensor:
    """[num_rows] values placed at index (rows past num_rows: dropped via a spill slot)."""
    out = torch.full((num_rows + 1,), fill, dtype=values.dtype, device=values.device)
    return out.scatter_(0, index.clamp(max=num_rows), values)[:num_rows]


def pack(tree: DraftTree, keep: Tensor, seq_lens: Tensor, num_rows: int) -> PackedLayout:
    """The packed verify of the kept nodes (keep [b, W] ancestor-closed, root kept), in num_rows
    flat rows (a host int >= keep.sum(), e.g. a bucket of b + R). seq_lens [b]: cached tokens."""
    b, W = tree.tokens.shape
    device = tree.tokens.device
    keep = keep & tree.valid
    node = torch.arange(W, device=device)
    local = keep.cumsum(1) - 1  # local index of each kept node
    q_lens = keep.sum(1)
    qo_indptr = torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)])
    node_row = torch.where(keep, qo_indptr[:-1, None] + local, -1)
    spill = torch.where(keep, local, W)  # cut nodes land in a dropped column
    local_node = torch.full((b, W + 1), -1, dtype=torch.int64, device=device)
    local_node = local_node.scatter_(1, spill, node.expand(b, W).contiguous())[:, :W]
    lvalid = local_node >= 0
    src = local_node.clamp(min=0)
    local_row = torch.where(lvalid, qo_indptr[:-1, None] + node[None, :], -1)

    par = tree.parents.gather(1, src)
    par_local = local.gather(1, par.clamp(min=0))
    parents = torch.where(lvalid & (par >= 0), par_local, -1)
    mask = tree.tree_mask.gather(1, src[:, :, None].expand(b, W, W))
    mask = mask.gather(2, src[:, None, :].expand(b, W, W))
    eye = torch.eye(W, dtype=torch.bool, device=device)[None]
    mask = (mask & lvalid[:, :, None] & lvalid[:, None, :]) | eye
    compact = DraftTree(
        torch.where(lvalid, tree.tokens.gather(1, src), 0),
        parents,
        torch.where(lvalid, tree.depths.gather(1, src), 0),
        lvalid,
        mask,
        tree.num_depths,
    )
    if tree.node_probs is not None:
        compact.node_probs = torch.where(lvalid, tree.node_probs.gather(1, src), 0.0)

    flat = torch.where(lvalid, local_row, num_rows).flatten()
    req = torch.arange(b, device=device)[:, None].expand(b, W).flatten()
    seq = seq_lens.to(device=device, dtype=torch.int64)
    return PackedLayout(
        tree=compact,
        q_lens=q_lens,
        qo_indptr=qo_indptr,
        local_node=local_node,
        local_row=local_row,
        node_row=node_row,
        flat_req=_scatter_rows(req, flat, num_rows, -1),
        flat_local=_scatter_rows(node.expand(b, W).flatten(), flat, num_rows, 0),
        input_ids=_scatter_rows(compact.tokens.flatten(), flat, num_rows, 0),
        positions=_scatter_rows((seq[:, None] + compact.depths).flatten(), flat, num_rows, 0),
        kv_positions=_scatter_rows((seq[:, None] + node[None, :]).flatten(), flat, num_rows, 0),
    )


def unpack(flat: Tensor, layout: PackedLayout, fill: float | int = 0) -> Tensor:
    """Per-row outputs [T, ...] of the packed verify -> [b, W, ...] in the compact tree's local
    order (`fill` past each request's q_len): target tokens for `accept_tree(layout.tree, ...)`."""
    b, W = layout.local_row.shape
    rows = flat.index_select(0, layout.local_row.clamp(min=0).flatten())
    rows = rows.view(b, W, *flat.shape[1:])
    ok = (layout.local_row >= 0).view(b, W, *([1] * (flat.dim() - 1)))
    return torch.where(ok, rows, fill)  # a Python scalar: no host copy (capturable)
