"""The packed verify's graph family: a batch-wide budget's round (speculative/batch_budget.py)
verifies only the batch's kept nodes, packed one request after another into T flat rows, and
eagerly that forward is launch-bound (an eager target step costs tens of ms of host launches at
the 8B shape, a replay well under one), so it replays graphs as the dense verify does.

The rows a graph runs are fixed at capture: at padded batch bs (a power of two: a padding request
owns no rows, so only a few empty attention programs pay for the coarse bucket), T = bs + E rows
for each E of
`packed_extras` (drafted rows beyond the roots: powers of two from a quarter of the batch, then
every node of a tree at the widest width W), so a few confident requests' deep trees beside
many roots cost a few rows, not a width's worth for every request; `BudgetPlanner` fills the
chosen graph's rows with the next most valuable nodes (padding rows cost what real ones do), and
the pool's peak is the widest dense verify's rows plus one LM-head chunk. What is not fixed is
how the rows split between requests: each request's q_len comes from the static `indptr` (the
Triton kernel reads it there; the launch shape depends only on bs, W and the context bound), its
tree mask is a [W, W] block.

Padding: requests past the live batch own no rows (q_len 0, no context: their programs return at
once) and point at the scratch pages; rows past the kept ones belong to no request and write the
scratch slot. Those rows' attention outputs are never written (their hidden rows are garbage, and
only ever row-wise: nothing live reads them). Outputs: the greedy token of every row (the LM head
in chunks inside the graph), the final hidden rows (for the requests that need their logits:
sampled, log-prob and grammar rows) and the taps (in the widest dense family's buffer: a round
reads one family's).
"""

from __future__ import annotations

import torch

from ddtree.engine.config import LOGIT_CHUNK_ELEMS
from ddtree.engine.graphs.buffers import Padding, VerifyGraph, static_metadata

PACKED_MIN_EXTRA = 8  # the fewest drafted rows a packed graph adds to its batch's roots


def packed_extras(bs: int, width: int) -> list[int]:
    """The drafted rows (beyond the bs roots) of the packed graphs at padded batch bs, ascending:
    powers of two from max(PACKED_MIN_EXTRA, bs / 4) below bs x (width - 1), then that (every
    node of every tree at the widest width)."""
    top = bs * (width - 1)
    e = max(PACKED_MIN_EXTRA, bs // 4)
    e = 1 << (e - 1).bit_length()
    out = []
    while e < top:
        out.append(e)
        e *= 2
    return out + [top] if top > 0 else out


def chunked_argmax(target, hidden: torch.Tensor) -> torch.Tensor:
    """The greedy token of every row of hidden [T, H]: the LM head over chunks of rows."""
    step = max(1, LOGIT_CHUNK_ELEMS // target.config.vocab_size)
    return torch.cat([target.logits(h).argmax(-1) for h in hidden.split(step)])


class PackedVerifyGraph:
    """Static buffers of the packed verify, sized for the largest captured batch M at the widest
    width W (M x W rows), and its forward at (bs, w)."""

    def __init__(self, runner, padding: Padding, widest: VerifyGraph):
        self.runner = runner
        dev, M = runner.device, padding.max_bs
        W = self.n = widest.n
        hidden = runner.target.config.hidden_size
        self.pad_slots, self.pad_rows, self.pad_mask = (
            padding.slots(W),
            padding.rows,
            widest.pad_mask,
        )
        self.ids = torch.zeros(M * W, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(M * W, dtype=torch.int64, device=dev)
        self.slots = self.pad_slots.clone()
        self.rows = self.pad_rows.clone()
        self.kv_lens = torch.zeros(M, dtype=torch.int64, device=dev)
        self.indptr = torch.zeros(M + 1, dtype=torch.int64, device=dev)
        self.mask = self.pad_mask.clone()
        self.taps = widest.taps
        self.hidden = torch.empty(M * W, hidden, dtype=runner.dtype, device=dev)
        self.live = 0  # leading requests that may hold live data
        self.live_rows = 0  # leading rows that may hold live data
        # each request's exact q_len for a backend that reads the host's (the torch reference,
        # uncaptured), set for one replay by `CudaGraphRunner.verify_packed`; None: the widest
        # width bounds them (the Triton kernel, any graph)
        self.host_q_lens: list[int] | None = None

    def attention_shape(self, bs: int, bound: int):
        return VerifyGraph.shape_of(self.runner, bs, self.n, bound)

    def load(self, rnd, lay, slots: torch.Tensor) -> int:
        """The round's packed layout (`Round.packed`, num_rows flat rows) and its KV slots [T];
        returns the live batch b."""
        b, w = lay.tree.tokens.shape
        T = slots.shape[0]
        if b < self.live:  # requests that held live data return to the padding state
            self.rows[b : self.live].copy_(self.pad_rows[b : self.live])
            self.kv_lens[b : self.live].zero_()
            self.mask[b : self.live].copy_(self.pad_mask[b : self.live])
        if T < self.live_rows:
            self.slots[T : self.live_rows].copy_(self.pad_slots[T : self.live_rows])
            self.ids[T : self.live_rows].zero_()
            self.pos[T : self.live_rows].zero_()
        self.live, self.live_rows = b, T
        self.ids[:T].copy_(lay.input_ids)
        self.pos[:T].copy_(lay.positions)
        self.slots[:T].copy_(slots)
        self.indptr[: b + 1].copy_(lay.qo_indptr)
        self.indptr[b + 1 :].copy_(lay.qo_indptr[b:].expand(self.indptr.shape[0] - b - 1))
        self.rows[:b].copy_(rnd.rows)
        torch.add(rnd.lens, lay.q_lens, out=self.kv_lens[:b])
        self.mask[:b].copy_(self.pad_mask[:b])
        self.mask[:b, :w, :w].copy_(lay.tree.tree_mask)
        return b

    def forward(self, bs: int, T: int, backend, host_kv_lens: list[int]) -> tuple:
        q_lens = self.host_q_lens
        if q_lens is None:  # a probe, or a kernel that reads qo_indptr
            head_dim = self.runner.target.config.head_dim
            exact = backend.reads_host_q_lens(head_dim, self.runner.device)
            # a backend that reads the host's lengths gets a layout the rows hold (a probe's:
            # the rows spread over the requests); the kernel gets the bound: any request may
            # hold up to the widest width's rows
            q_lens = [T // bs + (i < T % bs) for i in range(bs)] if exact else [self.n] * bs
        meta = static_metadata(self, bs, T, q_lens, host_kv_lens)
        hidden, taps = self.runner.target_forward(self.ids[:T], self.pos[:T], meta, backend)
        self.hidden[:T].copy_(hidden)
        if taps is not None:
            self.taps[:T].copy_(taps)
        return (chunked_argmax(self.runner.target, hidden),)
