"""Plain CPU reference of DDTree's best-first heap, one request at a time. Test oracle only.

Heap entries are (-score, rank tuple, parent node, depth, rank); popping an entry makes it a node and
pushes its next sibling (rank + 1 at the same depth) and its first child (rank 0 one depth deeper).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from torch import Tensor


@dataclass
class RefTree:
    tokens: list[int]  # root first, then nodes in pop order (a topological order)
    parents: list[int]  # root -1
    depths: list[int]
    ranks: list[tuple[int, ...]]  # per-depth candidate ranks of each node's prefix; root ()

    def prefixes(self) -> list[tuple[int, ...]]:
        """Token prefix (excluding the root token) of every node, root -> ()."""
        out: list[tuple[int, ...]] = []
        for i, p in enumerate(self.parents):
            out.append(() if p < 0 else out[p] + (self.tokens[i],))
        return out


def build_tree_ref(
    root_token: int,
    draft_logits: Tensor,
    budget: int,
    topk_cap: int,
    shadow_linear: bool,
    max_depth: int | None = None,
) -> RefTree:
    """draft_logits: [D, V] for one request. Returns at most `budget` nodes plus the root."""
    logits = draft_logits.detach().float().cpu()
    D, V = logits.shape
    limit = D if max_depth is None else max(0, min(D, max_depth))
    k = min(topk_cap, budget, V)
    vals, ids = logits.topk(k, dim=-1)
    logp = (vals - logits.logsumexp(dim=-1, keepdim=True)).tolist()
    cand = ids.tolist()

    def score(ranks: tuple[int, ...]) -> float:
        return sum(logp[i][r] for i, r in enumerate(ranks))

    tree = RefTree([root_token], [-1], [0], [()])

    def add(ranks: tuple[int, ...], parent: int) -> int:
        tree.tokens.append(cand[len(ranks) - 1][ranks[-1]])
        tree.parents.append(parent)
        tree.depths.append(len(ranks))
        tree.ranks.append(ranks)
        return len(tree.tokens) - 1

    # shadow-linear: the top-1 chain is placed first (nodes 1..spine) and counts toward the budget
    spine = min(budget, limit) if shadow_linear else 0
    for d in range(1, spine + 1):
        add((0,) * d, d - 1)

    heap: list[tuple[float, tuple[int, ...], int, int, int]] = []
    if limit >= 1:
        heap.append((-score((0,)), (0,), 0, 1, 0))
    others = 0
    while heap and others < budget - spine:
        _, ranks, parent, depth, rank = heapq.heappop(heap)
        if depth <= spine and not any(ranks):
            node = depth  # already placed as a spine node
        else:
            node = add(ranks, parent)
            others += 1
        if rank + 1 < k:
            sib = ranks[:-1] + (rank + 1,)
            heapq.heappush(heap, (-score(sib), sib, parent, depth, rank + 1))
        if depth < limit:
            child = ranks + (0,)
            heapq.heappush(heap, (-score(child), child, node, depth + 1, 0))
    return tree


def accept_ref(
    tokens: list[int], parents: list[int], valid: list[bool], target: list[int]
) -> list[int]:
    """Walk from the root: move to the child whose token equals target[current]. Returns the path."""
    path = [0]
    while True:
        cur = path[-1]
        nxt = [
            i
            for i in range(len(tokens))
            if valid[i] and parents[i] == cur and tokens[i] == target[cur]
        ]
        if not nxt:
            return path
        path.append(nxt[0])
