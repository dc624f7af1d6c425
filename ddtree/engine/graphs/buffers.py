"""The verify and commit graph families: each owns its static buffers, how a round's live data is
loaded into them (`load`), how rows return to the padding state (`pad`), and the forward a graph
captures (`forward`). The draft family is in ddtree/engine/graphs/draft.py; `CudaGraphRunner`
(cuda_graph.py) captures and replays them.

Static inputs are sized for the largest captured batch M; a graph for padded batch bs reads the
first bs rows. `load` writes the live rows [0, b) and returns rows [b, previous b) to the padding
state: a padded request caches n tokens of its own (kv_len = n, no context), sees only itself
(identity tree mask; an empty drafter context), and writes its K/V into the runner's scratch pages,
which the block manager never hands out. So padding never touches a real request's KV and never
yields a row with nothing visible (no NaN).

What a replay covers (nothing in between needs the host):
  - verify: target forward -> target LM head on all padded rows (into one static logits buffer
    shared by every graph) -> greedy argmax per node -> the accept walk on the static tree (parents
    / depths / valid). The decoder uses the in-graph walk when every request is greedy and no
    the bench's decoder rewrites the target tokens; otherwise it samples from the logits and walks eagerly.
  - commit: the KV move of the accepted path and the drafter-context write (`ModelRunner.commit_kv`)
    on the verify graph's static rows / lengths / taps, graphs keyed by padded batch (padded rows:
    path 0, length 0, their moves and writes stay in the scratch pages). Used whenever the round's
    verify replayed.

Hybrid (Gated DeltaNet) targets: the state pool's rows are addressed through a static index tensor
(`VerifyGraph.state_rows`, filled by `load`; padded rows: the pool's scratch row), so the verify's tree
recurrence, node-state stash and conv windows along ancestor chains, and the commit's state copy
(extra_buffer) or replay (no_buffer) run inside the graphs; padded rows read and write only the scratch
row (several padded rows share it: its contents are garbage, never read by a live row). The one-node
family (AR rounds, auto's width 1) steps the state rows in place inside its verify graph
(`HybridStatePool.in_place`) and its commit graph holds no state commit; a replay of that verify
graph advances the rows it holds (live rows' or the scratch row), so replaying it outside a round
(the budget profile) needs every row in the padding state first.
"""

from __future__ import annotations

import torch

from ddtree.attention.backend import AttentionMetadata
from ddtree.kernels.tree_attention.dispatch import MODES, AttentionShape
from ddtree.speculative.accept import AcceptResult, accept_tree
from ddtree.speculative.tree import DraftTree


class Padding:
    """Block-table rows and KV slots of a padded request: the runner's scratch pages, shared by
    every family."""

    def __init__(self, runner, max_bs: int):
        dev, P = runner.device, runner.bm.max_pages_per_req
        self.page_size = runner.cfg.page_size
        pool = runner.state_pool
        # the hybrid state pool's row of padded requests (None: dense target)
        self.state_row = None if pool is None else pool.scratch_row
        self.scratch = torch.tensor(runner.scratch_pages, dtype=torch.int64, device=dev)
        self.rows = (
            self.scratch[torch.arange(P, device=dev) % len(self.scratch)]
            .expand(max_bs, P)
            .clone(memory_format=torch.contiguous_format)
        )
        self.max_bs = max_bs

    def slots(self, width: int) -> torch.Tensor:
        """[max_bs * width] KV slots: every padded row writes the same `width` scratch slots (a
        width past the scratch pages, the extend's, wraps around them)."""
        j = torch.arange(width, device=self.scratch.device)
        p = self.page_size
        return (self.scratch[(j // p) % len(self.scratch)] * p + j % p).repeat(self.max_bs)


def static_metadata(fam, bs: int, T: int, q_lens, host_kv_lens) -> AttentionMetadata:
    """The attention metadata of a verify family's static buffers (`indptr`, `kv_lens`, `rows`,
    `slots`, `mask`) at padded batch bs and T rows; q_lens / host_kv_lens: the host's."""
    return AttentionMetadata(
        q_lens=q_lens,
        kv_lens=host_kv_lens,
        qo_indptr=fam.indptr[: bs + 1],
        kv_lens_t=fam.kv_lens[:bs],
        block_table=fam.rows[:bs],
        slot_mapping=fam.slots[:T],
        page_size=fam.runner.cfg.page_size,
        tree_mask=fam.mask[:bs],
    )


class VerifyGraph:
    """Tree verify at width n = max_verify_width (+ the greedy accept walk when the tree has
    depth)."""

    def __init__(self, runner, padding: Padding, n: int | None = None, share=None):
        """n: the width (default max_verify_width); share: a wider VerifyGraph whose logits and
        taps buffers this one reuses (a round reads only its own width's)."""
        self.runner = runner
        cfg, dev, M = runner.cfg, runner.device, padding.max_bs
        head = runner.target.lm_head.weight
        n = self.n = n or cfg.max_verify_width
        self.pad_rows, self.pad_slots = padding.rows, padding.slots(n)
        self.pad_mask = (
            torch.eye(n, dtype=torch.bool, device=dev)
            .expand(M, n, n)
            .clone(memory_format=torch.contiguous_format)
        )
        self.ids = torch.zeros(M * n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(M * n, dtype=torch.int64, device=dev)
        self.slots = self.pad_slots.clone()
        self.rows = self.pad_rows.clone()
        self.kv_lens = torch.full((M,), n, dtype=torch.int64, device=dev)
        self.mask = self.pad_mask.clone()
        self.indptr = torch.arange(0, (M + 1) * n, n, device=dev)
        self.arange = torch.arange(n, device=dev)
        # the tree fields the in-graph accept walk reads (padding rows: no drafted node, nothing
        # accepted)
        self.parents = torch.full((M, n), -1, dtype=torch.int64, device=dev)
        self.depths = torch.zeros(M, n, dtype=torch.int64, device=dev)
        self.valid = torch.zeros(M, n, dtype=torch.bool, device=dev)
        K = len(runner.tap_layers)
        if share is not None:
            self.logits = share.logits[: M * n]
            self.taps = share.taps[: M * n] if share.taps is not None else None
        else:
            # one for every graph
            vocab = runner.target.config.vocab_size  # the LM head may hold one TP shard
            self.logits = torch.empty(M * n, vocab, dtype=head.dtype, device=dev)
            self.taps = (
                torch.zeros(
                    M * n, K * runner.target.config.hidden_size, dtype=head.dtype, device=dev
                )
                if K
                else None
            )
        # depth bound of the trees the decoder verifies (drafted block minus its root); the walk
        # needs n > 1
        self.accept_depth = cfg.block_size - 1 if n > 1 and cfg.block_size > 1 else None
        # hybrid: state-pool rows of the live requests (padded: the scratch row); the GDN layers
        # read the tree fields too
        self.hybrid = padding.state_row is not None
        self.pad_state_row = padding.state_row
        if self.hybrid:
            self.state_rows = torch.full((M,), padding.state_row, dtype=torch.int64, device=dev)
        self.tree_fields = self.accept_depth is not None or self.hybrid
        self.live = 0  # leading rows that may hold live data (the rest are in the padding state)

    @staticmethod
    def shape_of(runner, bs: int, n: int, bound: int) -> AttentionShape:
        """The shape of a target tree-verify attention call: bs rows of n nodes, host KV lengths <=
        bound."""
        t, k_pool = runner.target.config, runner.kv.layer(0)[0]
        return AttentionShape(
            bs,
            n,
            bound,
            t.num_attention_heads,
            t.num_key_value_heads,
            t.head_dim,
            runner.cfg.page_size,
            k_pool.dtype,
            MODES["tree"],
            False,
            k_pool.is_contiguous() and k_pool.data_ptr() % 16 == 0,
        )

    def attention_shape(self, bs: int, bound: int) -> AttentionShape:
        """The shape of every target attention call of `forward(bs, ., [bound] * bs)`."""
        return self.shape_of(self.runner, bs, self.n, bound)

    def pad(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) back to the padding state."""
        n = self.n
        self.slots[lo * n : hi * n].copy_(self.pad_slots[lo * n : hi * n])
        self.rows[lo:hi].copy_(self.pad_rows[lo:hi])
        self.kv_lens[lo:hi].fill_(n)
        self.mask[lo:hi].copy_(self.pad_mask[lo:hi])
        self.pos[lo * n : hi * n].zero_()
        self.parents[lo:hi].fill_(-1)
        self.depths[lo:hi].zero_()
        self.valid[lo:hi].zero_()
        if self.hybrid:
            self.state_rows[lo:hi].fill_(self.pad_state_row)

    def load(self, meta, tree: DraftTree) -> int:
        """The round's rows (meta: the Round, rows gathered after allocation) and tree; returns the live
        batch b."""
        b, n = tree.tokens.shape
        T = b * n
        if b < self.live:  # rows that held live data last time return to the padding state
            self.pad(b, self.live)
        self.live = b
        lens = meta.lens[:, None]
        self.ids[:T].copy_(tree.tokens.flatten())
        torch.add(lens, tree.depths, out=self.pos[:T].view(b, n))
        self.rows[:b].copy_(meta.rows)
        self.slots[:T].copy_(self.runner.slots_of(meta.rows, lens + self.arange).flatten())
        torch.add(meta.lens, n, out=self.kv_lens[:b])
        self.mask[:b].copy_(tree.tree_mask)
        if self.tree_fields:
            self.parents[:b].copy_(tree.parents)
            self.depths[:b].copy_(tree.depths)
            self.valid[:b].copy_(tree.valid)
        if self.hybrid:
            self.state_rows[:b].copy_(meta.slot_ids)
        return b

    def _tree(self, bs: int) -> DraftTree:
        """The static tree of rows [0, bs) (depth bound: the decoder's, 0 for one-node trees)."""
        n = self.n
        return DraftTree(
            self.ids[: bs * n].view(bs, n),
            self.parents[:bs],
            self.depths[:bs],
            self.valid[:bs],
            self.mask[:bs],
            self.accept_depth or 0,
        )

    def forward(self, bs: int, backend, host_kv_lens: list[int]) -> tuple:
        n, T = self.n, bs * self.n
        meta = static_metadata(self, bs, T, [n] * bs, host_kv_lens)
        linear = None
        if self.hybrid:  # GDN layers: the tree rule over the static tree and state rows
            linear = self.runner.state_pool.tree_context(self.state_rows[:bs], self._tree(bs))
        hidden, taps = self.runner.target_forward(
            self.ids[:T], self.pos[:T], meta, backend, linear=linear
        )
        if taps is not None:
            self.taps[:T].copy_(taps)
        logits = self.runner.target.logits(hidden, out=self.logits[:T])
        tokens = logits.view(bs, n, -1).argmax(-1)
        # logits and taps are read from self.logits / self.taps (a graph-owned copy would hold
        # memory per graph)
        if self.accept_depth is None:
            return (tokens,)
        res = accept_tree(self._tree(bs), tokens)
        return tokens, res.accept_length, res.path, res.out_tokens, res.num_out, res.last_node

    def outputs(self, out: tuple, b: int, depth_bound: int):
        """(logits [b*n, V], taps or None, greedy tokens [b, n], the accept walk or None) of a
        replay."""
        T = b * self.n
        taps = self.taps[:T] if self.taps is not None else None
        res = None
        if self.accept_depth is not None and depth_bound == self.accept_depth:
            res = AcceptResult(*(x[:b] for x in out[1:]))
        return self.logits[:T], taps, out[0][:b], res


class CommitGraph:
    """`ModelRunner.commit_kv` on the verify graph's rows, lengths and taps: the accepted path and
    length; for hybrid targets first the state commit on the verify's state rows (padded rows:
    path 0, length 0 on the scratch row)."""

    def __init__(self, verify: VerifyGraph):
        self.verify, self.runner = verify, verify.runner
        M, dev = verify.pad_rows.shape[0], verify.runner.device
        self.width = (verify.accept_depth or 0) + 1  # path columns: root + the depth bound
        self.path = torch.zeros(M, self.width, dtype=torch.int64, device=dev)
        self.length = torch.zeros(M, dtype=torch.int64, device=dev)
        self.live = 0

    def pad(self, lo: int, hi: int) -> None:
        self.path[lo:hi].zero_()
        self.length[lo:hi].zero_()

    def load(self, path: torch.Tensor, accept_length: torch.Tensor) -> int:
        """The round's accepted paths (a tree of a lower depth bound gives fewer columns: the
        rest repeat its last node, as the walk pads) and lengths; returns the live batch b."""
        b, w = path.shape
        if b < self.live:
            self.pad(b, self.live)
        self.live = b
        self.path[:b, :w].copy_(path)
        self.path[:b, w:].copy_(path[:, -1:].expand(b, self.width - w))
        self.length[:b].copy_(accept_length)
        return b

    def forward(self, bs: int) -> None:
        v, n = self.verify, self.verify.n
        if v.hybrid:  # the one-node family's verify stepped the state in place: nothing captured
            pool = self.runner.state_pool
            pool.commit(v.state_rows[:bs], self.path[:bs], self.length[:bs], nodes=n)
        taps = v.taps[: bs * n].view(bs, n, -1) if v.taps is not None else None
        self.runner.commit_kv(
            v.kv_lens[:bs] - n, v.rows[:bs], self.path[:bs], self.length[:bs], taps
        )
