"""One decoding round as data: `Round` (created by `ModelRunner.begin`), `Draft` (what `draft`
returns) and `Verify` (what `verify` returns). The runner's phases take and return these, the same
types whether a CUDA graph replayed or eager code ran:

    rnd = runner.begin(reqs)                          # one host->device copy of lengths and slots
    draft = runner.draft(rnd, limits, budgets, spec)  # the drafter's block -> the round's DraftTree
    vo = runner.verify(rnd, draft.tree)               # one target forward over every request's tree
    # (or, a batch-wide budget: vo = runner.verify_packed(rnd, draft.tree, keep, num_rows), one
    #  forward over the kept nodes only; the round's tree is then rnd.packed.tree)
    runner.commit(rnd, vo, path, accept_length)       # the accepted nodes' KV and drafter context
    runner.advance(rnd, committed)                    # after the read-back: the requests' kv_len

The graph-or-eager choice is made once, in `begin` (`Round.graphed`: the batch and its contexts fit
the captured graphs); a phase that replayed says so on the round (`Round.verified_in_graph`), and the
commit replays exactly when the verify did (its graph reads the verify graph's static rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.engine.scheduling.request import Req
from ddtree.speculative.accept import AcceptResult
from ddtree.speculative.batch_budget import PackedLayout
from ddtree.speculative.tree import DraftTree


@dataclass
class Round:
    """Per-request data of one round. Valid while no request's slot or kv_len changes: from
    `begin` until `advance`."""

    reqs: list[Req]
    slots: list[int]  # host: block-table row of each request
    kv_lens: list[int]  # host: cached tokens per request at the round's start
    slot_ids: torch.Tensor  # [b] int64 device
    lens: torch.Tensor  # [b] int64 device (= kv_lens)
    # [b, max_pages] block-table rows; re-gathered once verify has allocated its pages
    rows: torch.Tensor
    # [b] int64 device: each request's pending token, the round's tree roots (0 if none)
    roots: torch.Tensor
    graphed: bool = False  # the CUDA graphs cover this batch (decided once, in `begin`)
    # nodes per request of the round's verify (0: not verified yet): the commit tells the state
    # pool, whose one-node verify stepped the GDN state in place
    width: int = 0
    verified_in_graph: bool = False  # the verify replayed: the commit replays on its rows
    # a batch-wide budget's packed verify (`ModelRunner.verify_packed`): its layout; the round's
    # tree is then `packed.tree` (each request's kept nodes in local order) and the verify's
    # logits and taps are flat rows
    packed: PackedLayout | None = None

    @property
    def batch(self) -> int:
        return len(self.reqs)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens)


@dataclass
class Draft:
    """The round's tree, and the drafter's logits [b, D, V] it was built from (the grammar rows
    rebuild their trees from them; None for a root-only tree, which drafts nothing)."""

    tree: DraftTree
    logits: torch.Tensor | None = None


@dataclass
class Verify:
    """The target's verify of a round's tree. A replayed graph also hands back the greedy tokens
    and the greedy accept walk computed in the same replay (None from eager code)."""

    # [b, n, V]: fp32 from eager code, the LM head's dtype from a graph (same values); a packed
    # verify's [s, W, V] for the requests it was asked for, in the compact tree's local order
    # (`Round.packed`), else None (a packed round of greedy rows reads the greedy tokens only)
    logits: torch.Tensor | None
    taps: torch.Tensor | None  # [b, n, K*H]: the drafter's context features (packed: [T, K*H])
    greedy_tokens: torch.Tensor | None = None  # [b, n] argmax per node
    greedy_accept: AcceptResult | None = None  # the walk under greedy_tokens


def root_tree(roots: torch.Tensor) -> DraftTree:
    """The one-node tree of each request's pending token: an AR round (width 1)."""
    b, dev = roots.shape[0], roots.device
    return DraftTree(
        tokens=roots[:, None],
        parents=torch.full((b, 1), -1, dtype=torch.int64, device=dev),
        depths=torch.zeros(b, 1, dtype=torch.int64, device=dev),
        valid=torch.ones(b, 1, dtype=torch.bool, device=dev),
        tree_mask=torch.ones(b, 1, 1, dtype=torch.bool, device=dev),
        num_depths=0,
    )


def accept_root(tokens: torch.Tensor) -> AcceptResult:
    """The accept walk of a one-node tree: its target token [b, 1] is the round's one emitted
    token (no draft to accept)."""
    b, dev = tokens.shape[0], tokens.device
    zeros = torch.zeros(b, dtype=torch.int64, device=dev)
    return AcceptResult(
        accept_length=zeros,
        path=zeros[:, None],
        out_tokens=tokens[:, :1],
        num_out=torch.ones_like(zeros),
        last_node=zeros,
    )
