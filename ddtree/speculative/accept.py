"""Accept walk over a verified draft tree, vectorized over depths and batched over requests.

Fixed shapes and no host syncs, so it can run inside the same CUDA graph as the verify forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree.speculative.tree import DraftTree


@dataclass
class AcceptResult:
    accept_length: Tensor  # [b] int64: accepted drafted nodes k (0..D)
    path: Tensor  # [b, D+1] int64: root, accepted nodes..., padded with the last path node
    out_tokens: Tensor  # [b, D+1] int64: k accepted tokens, then the bonus token, then -1
    num_out: Tensor  # [b] int64: k + 1
    last_node: Tensor  # [b] int64: deepest accepted node (0 = root)


def accept_tree(tree: DraftTree, target_tokens: Tensor) -> AcceptResult:
    """target_tokens[:, i] = the target's token drawn at node i (argmax or sample).

    From the root, repeatedly move to the child whose token equals the target's token at the
    current node. Siblings carry distinct tokens, so at most one node per depth is accepted and the
    accepted set is a single root-to-node path.
    """
    b, n = tree.tokens.shape
    D = tree.depth_bound
    device = tree.tokens.device
    target_tokens = target_tokens.to(torch.int64)
    par = tree.parents.clamp(min=0)
    # a node matches if its token is what the target drew at its parent
    match = tree.valid & (tree.tokens == target_tokens.gather(1, par)) & (tree.parents >= 0)
    node = torch.arange(n, device=device)
    # accepted = every node on its root path matches (the root always does): one masked reduction
    # over the ancestors-and-self mask instead of a walk of D dependent steps (~5 launches each, 75
    # of a B=64 round's graph); padding rows hold only themselves and never match
    on_path = match | (node == 0)[None, :]
    acc = ~(tree.tree_mask & ~on_path[:, None, :]).any(dim=-1)

    k = acc.sum(dim=1) - 1
    # path_raw[:, d] = the accepted node at depth d (0 where none; real nodes at depth >= 1 are > 0)
    src = torch.where(acc, node[None, :], 0)
    path_raw = torch.zeros(b, D + 1, dtype=torch.int64, device=device)
    path_raw = path_raw.scatter_reduce(1, tree.depths.clamp(0, D), src, reduce="amax")
    last_node = path_raw.gather(1, k[:, None])
    step = torch.arange(D + 1, device=device)[None, :]
    path = torch.where(step <= k[:, None], path_raw, last_node)

    bonus = target_tokens.gather(1, last_node)
    drafted = torch.cat([tree.tokens.gather(1, path)[:, 1:], bonus], dim=1)
    out_tokens = torch.where(step < k[:, None], drafted, torch.where(step == k[:, None], bonus, -1))
    return AcceptResult(k, path, out_tokens, k + 1, last_node[:, 0])
