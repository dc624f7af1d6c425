"""Forced acceptance for round benchmarks: random weights accept nothing, so the target tokens are rewritten
(by bench_decoder.py's `BenchDecoder`) to make the accept walk commit a chosen number of tokens.

The walk is steered along the first node of each depth. Nodes are ordered by depth, then by score, so that is
the drafter's top-1 chain (in DFLASH chains, and in DDTREE trees as deep as the tree keeps it; shadow-linear
keeps all of it). Fixed shapes, no host syncs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.speculative.tree import DraftTree


def forced_targets(tree: DraftTree, target_tokens: Tensor, lengths: Tensor) -> Tensor:
    """Target tokens [b, n] under which request i emits min(lengths[i], chain + 1) tokens: lengths[i] - 1
    accepted drafts along the chain of first nodes per depth, then a bonus token. The bonus is the target's
    own token at the last accepted node unless it would extend the walk; then the smallest id no child carries.
    A handful of batched ops (no loop over depths), so the forcing adds little to the round it times."""
    b, n = tree.tokens.shape
    D = tree.depth_bound
    device = tree.tokens.device
    node = torch.arange(n, device=device)
    at_depth = tree.valid[:, :, None] & (
        tree.depths[:, :, None] == torch.arange(1, D + 1, device=device)
    )
    # [b, D]: first node of each depth, n if none
    first = torch.where(at_depth, node[None, :, None], n).amin(1)
    path = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=device), first], 1)  # [b, D+1]
    linked = (first < n) & (tree.parents.gather(1, first.clamp(max=n - 1)) == path[:, :-1])
    chain = linked.long().cumprod(1).sum(1)  # drafted nodes on the unbroken chain
    k = torch.minimum((lengths.to(device=device, dtype=torch.int64) - 1).clamp(min=0), chain)  # [b]
    step = torch.arange(D, device=device)[None, :]
    # node path[j] (j < k) must draw the token of path[j+1]; other writes land in a spare column n
    dst = torch.where(step < k[:, None], path[:, :-1], n)
    out = torch.cat(
        [target_tokens.to(torch.int64), torch.zeros(b, 1, dtype=torch.int64, device=device)], 1
    )
    out = out.scatter(1, dst, tree.tokens.gather(1, first.clamp(max=n - 1)))[:, :n]
    cur = path.gather(1, k[:, None])  # [b, 1] last accepted node
    child_tok = torch.where((tree.parents == cur) & tree.valid, tree.tokens, -1)  # [b, n]
    own = out.gather(1, cur)
    extends = (child_tok == own).any(1, keepdim=True)
    # at most n - 1 children, so one of the ids 0..n-1 is free (n <= vocab)
    taken = (child_tok[:, :, None] == node[None, None, :]).any(1)  # [b, n]
    free = torch.where(taken, n, node[None, :]).min(1, keepdim=True).values
    return out.scatter(1, cur, torch.where(extends, free, own))


class AcceptTrace:
    """A `BenchDecoder` override replaying per-round emitted lengths (accepted + bonus), cycling through `trace`;
    every request of the batch follows the same length in a round. Lengths live on the device up front."""

    def __init__(self, trace: list[int], device):
        if not trace or min(trace) < 1:
            raise ValueError(f"accept trace needs lengths >= 1, got {trace}")
        self.trace = list(trace)
        self._lengths = [torch.tensor(k, dtype=torch.int64, device=device) for k in self.trace]
        self.round = 0

    def __call__(self, tree: DraftTree, target_tokens: Tensor) -> Tensor:
        k = self._lengths[self.round % len(self._lengths)]
        self.round += 1
        return forced_targets(tree, target_tokens, k.expand(tree.batch_size))
