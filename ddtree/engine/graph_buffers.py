"""Static buffers of the CUDA graph runner and the forwards that run on them: the verify buffers (tree, metadata,
logits, taps, the in-graph accept walk), the commit buffers (accepted path and length on the verify rows), the
drafter block and draft-tree buffers, and how a round's live data is filled in. `CudaGraphRunner`
(ddtree/engine/cuda_graph.py) captures and replays these forwards.

Each forward owns static inputs sized for the largest captured batch; a graph for padded batch bs reads the
first bs rows. On replay the live metadata is copied in and rows [b, bs) hold the padding state: a padded
request caches n tokens of its own (kv_len = n, no context), sees only itself (identity tree mask; an empty
drafter context), and writes its K/V into the runner's scratch pages, which the block manager never hands out.
So padding never touches a real request's KV and never yields a row with nothing visible (no NaN).

What a replay covers (nothing in between needs the host):
  - draft: drafter block -> drafter LM head -> the round's draft tree (`build_tree` with the decoder's budget /
    top-k cap / shadow-linear, or `build_chain` for DFLASH) with per-request depth limits read from a static
    tensor (block_size - 1 where unlimited, so one graph serves every round). The draft graphs of one tree spec
    are captured when the decoder announces its spec (`set_tree_spec`); without one the plain block graph
    (hidden states out, LM head eager) is captured on first use.
  - verify: target forward -> target LM head on all padded rows (written into one static logits buffer shared by
    every graph) -> greedy argmax per node -> the accept walk on the static tree (parents / depths / valid).
    The decoder uses the in-graph walk when every request is greedy and no `target_override` is set; otherwise
    it samples from the logits and walks eagerly.
  - commit: the KV move of the accepted path and the drafter-context write (`ModelRunner.commit_kv`) on the
    verify replay's static rows / lengths / taps, graphs keyed by padded batch (padded rows: path 0, length 0,
    their moves and writes stay in the scratch pages). Used whenever the round's verify replayed here.
"""

from __future__ import annotations

import bisect

import torch

from ddtree.attention.backend import AttentionMetadata, DraftAttentionMetadata
from ddtree.speculative.accept import AcceptResult, accept_tree
from ddtree.speculative.tree import DraftTree, build_chain, build_tree


class GraphBuffers:
    """The static buffers and the forwards on them, mixed into `CudaGraphRunner`, which supplies `runner`,
    `buckets`, `verify_set`, `commit_graphs`, `tree_spec` and `_draft_set` (the capture side)."""

    def _init_verify(self, max_bs: int) -> None:
        """Padding rows, the verify buffers (padding state) and, with the in-graph accept walk, the commit buffers."""
        runner = self.runner
        cfg, dev = runner.cfg, runner.device
        M, P, p = max_bs, runner.bm.max_pages_per_req, cfg.page_size
        scratch = torch.tensor(runner.scratch_pages, dtype=torch.int64, device=dev)
        self.pad_rows = scratch[torch.arange(P, device=dev) % len(scratch)].expand(M, P).clone(
            memory_format=torch.contiguous_format)
        head = runner.target.lm_head.weight
        V = head.shape[0]
        n = self.n = cfg.max_verify_width
        j = torch.arange(n, device=dev)
        self.pad_slots = (scratch[j // p] * p + j % p).repeat(M)  # every padded row writes the same scratch slots
        self.pad_mask = torch.eye(n, dtype=torch.bool, device=dev).expand(M, n, n).clone(
            memory_format=torch.contiguous_format)
        self.v_ids = torch.zeros(M * n, dtype=torch.int64, device=dev)
        self.v_pos = torch.zeros(M * n, dtype=torch.int64, device=dev)
        self.v_slots = self.pad_slots.clone()
        self.v_rows = self.pad_rows.clone()
        self.v_kv_lens = torch.full((M,), n, dtype=torch.int64, device=dev)
        self.v_mask = self.pad_mask.clone()
        self.v_indptr = torch.arange(0, (M + 1) * n, n, device=dev)
        self.v_arange = j
        # the tree fields the in-graph accept walk reads (padding rows: no drafted node, nothing accepted)
        self.v_par = torch.full((M, n), -1, dtype=torch.int64, device=dev)
        self.v_dep = torch.zeros(M, n, dtype=torch.int64, device=dev)
        self.v_valid = torch.zeros(M, n, dtype=torch.bool, device=dev)
        self.v_logits = torch.empty(M * n, V, dtype=head.dtype, device=dev)  # one buffer for every verify graph
        K = len(runner.tap_layers)
        self.v_taps = (torch.zeros(M * n, K * runner.target.config.hidden_size, dtype=head.dtype, device=dev)
                       if K else None)
        self.v_real = 0  # leading rows that may hold live data (the rest are in the padding state)
        # depth bound of the trees the decoder verifies (drafted block minus its root); the walk needs n > 1
        self.accept_depth = cfg.block_size - 1 if n > 1 and cfg.block_size > 1 else None
        self._verified = 0  # live rows of the verify replay whose commit is pending (0: none)
        if self.accept_depth is not None:
            self.c_path = torch.zeros(M, self.accept_depth + 1, dtype=torch.int64, device=dev)
            self.c_len = torch.zeros(M, dtype=torch.int64, device=dev)
            self.c_real = 0

    def _init_draft(self, max_bs: int) -> None:
        """The drafter block buffers (padding state); the draft-tree buffers come per tree spec (`_init_tree`)."""
        runner = self.runner
        cfg, dev, M = runner.cfg, runner.device, max_bs
        S = self.S = cfg.block_size
        self.D = S - 1
        self.d_ids = torch.full((M, S), runner.drafter.config.mask_token_id, dtype=torch.int64, device=dev)
        self.d_arange = torch.arange(S, device=dev)
        self.d_pos = self.d_arange.expand(M, S).clone(memory_format=torch.contiguous_format)  # own memory even at M = 1
        self.d_rows = self.pad_rows.clone()
        self.d_ctx = torch.zeros(M, dtype=torch.int64, device=dev)
        self.d_depth = torch.full((M,), self.D, dtype=torch.int64, device=dev)  # per-request depth limits
        self.d_limited = 0  # leading rows whose depth limit may be < D
        self.d_logits = None  # [M, D, V] static drafter logits, made with the first tree spec
        self.d_real = 0

    def _init_tree(self, spec: tuple) -> None:
        """The static drafter logits (with the first spec) and the spec's static DraftTree fields."""
        if self.d_logits is None:
            head = self.runner.target.lm_head.weight
            self.d_logits = torch.empty(self.buckets[-1], self.D, head.shape[0], dtype=head.dtype,
                                        device=self.runner.device)
        # the tree lands in static buffers outside the graph pool: a graph-owned output could share memory
        # with an intermediate of a verify graph captured earlier, and the tree is read after verify
        M, dev = self.buckets[-1], self.runner.device
        N = 1 + (self.D if spec[0] == "DFLASH" else spec[1])
        self.tree_bufs[spec] = (torch.zeros(M, N, dtype=torch.int64, device=dev),
                                torch.full((M, N), -1, dtype=torch.int64, device=dev),
                                torch.zeros(M, N, dtype=torch.int64, device=dev),
                                torch.zeros(M, N, dtype=torch.bool, device=dev),
                                torch.zeros(M, N, N, dtype=torch.bool, device=dev))

    # ---- verify ------------------------------------------------------------------------------------------
    def can_verify(self, b: int, n: int, max_kv_len: int) -> bool:
        """max_kv_len: the longest live request after this verify's write (= its cached tokens + n)."""
        return n == self.n and self.verify_set.fits(b, max_kv_len)

    def _verify_forward(self, bs: int, backend, host_kv_lens: list[int]):
        n, T = self.n, bs * self.n
        meta = AttentionMetadata(
            q_lens=[n] * bs, kv_lens=host_kv_lens, qo_indptr=self.v_indptr[: bs + 1], kv_lens_t=self.v_kv_lens[:bs],
            block_table=self.v_rows[:bs], slot_mapping=self.v_slots[:T], page_size=self.runner.cfg.page_size,
            tree_mask=self.v_mask[:bs],
        )
        hidden, taps = self.runner.target_forward(self.v_ids[:T], self.v_pos[:T], meta, backend)
        if taps is not None:
            self.v_taps[:T].copy_(taps)
        logits = self.runner.target.logits(hidden)
        self.v_logits[:T].copy_(logits)
        tokens = logits.view(bs, n, -1).argmax(-1)
        # logits and taps are read from v_logits / v_taps (a graph-owned copy would hold memory per graph)
        if self.accept_depth is None:
            return (tokens,)
        tree = DraftTree(self.v_ids[:T].view(bs, n), self.v_par[:bs], self.v_dep[:bs], self.v_valid[:bs],
                         self.v_mask[:bs], self.accept_depth)
        res = accept_tree(tree, tokens)
        return tokens, res.accept_length, res.path, res.out_tokens, res.num_out, res.last_node

    def verify(self, meta, tree) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, AcceptResult | None]:
        """meta: the round's RoundMeta (rows gathered after allocation). Returns (logits [b*n, V] in the LM head's
        dtype, taps [b*n, K*H] or None, greedy tokens [b, n], the greedy accept walk or None when the tree's
        depth bound is not the captured one)."""
        b, n = tree.tokens.shape
        T = b * n
        if b < self.v_real:  # rows that held live data last time return to the padding state
            lo, hi = b, self.v_real
            self.v_slots[lo * n : hi * n].copy_(self.pad_slots[lo * n : hi * n])
            self.v_rows[lo:hi].copy_(self.pad_rows[lo:hi])
            self.v_kv_lens[lo:hi].fill_(n)
            self.v_mask[lo:hi].copy_(self.pad_mask[lo:hi])
            self.v_pos[lo * n : hi * n].zero_()
            self.v_par[lo:hi].fill_(-1)
            self.v_dep[lo:hi].zero_()
            self.v_valid[lo:hi].zero_()
        self.v_real = b
        lens = meta.lens[:, None]
        self.v_ids[:T].copy_(tree.tokens.flatten())
        torch.add(lens, tree.depths, out=self.v_pos[:T].view(b, n))
        self.v_rows[:b].copy_(meta.rows)
        self.v_slots[:T].copy_(self.runner.slots_of(meta.rows, lens + self.v_arange).flatten())
        torch.add(meta.lens, n, out=self.v_kv_lens[:b])
        self.v_mask[:b].copy_(tree.tree_mask)
        if self.accept_depth is not None:
            self.v_par[:b].copy_(tree.parents)
            self.v_dep[:b].copy_(tree.depths)
            self.v_valid[:b].copy_(tree.valid)
        out = self.verify_set.run(b, [k + n for k in meta.kv_lens])
        taps = self.v_taps[:T] if self.v_taps is not None else None
        res = None
        if self.accept_depth is not None and tree.depth_bound == self.accept_depth:
            res = AcceptResult(*(x[:b] for x in out[1:]))
        self._verified = b
        return self.v_logits[:T], taps, out[0][:b], res

    # ---- commit ------------------------------------------------------------------------------------------
    def drop_pending_commit(self) -> None:
        """The round's verify ran eagerly: no replayed verify rows await a commit."""
        self._verified = 0

    def can_commit(self, path: torch.Tensor, taps) -> bool:
        """This round's verify replayed here (its rows, lengths and taps are still in the static buffers)."""
        ok = (self._verified == path.shape[0] and self.accept_depth is not None
              and path.shape[1] == self.accept_depth + 1
              and (taps is None or (self.v_taps is not None and taps.data_ptr() == self.v_taps.data_ptr())))
        if not ok:
            self.drop_pending_commit()
        return ok

    def _commit_forward(self, bs: int) -> None:
        n = self.n
        taps = self.v_taps[: bs * n].view(bs, n, -1) if self.v_taps is not None else None
        self.runner.commit_kv(self.v_kv_lens[:bs] - n, self.v_rows[:bs], self.c_path[:bs], self.c_len[:bs], taps)

    def commit(self, path: torch.Tensor, accept_length: torch.Tensor) -> None:
        """`ModelRunner.commit_kv` for the rows of this round's verify replay; padded rows commit nothing (their
        moves stay in the scratch pages)."""
        b = path.shape[0]
        self.drop_pending_commit()
        if b < self.c_real:
            self.c_path[b : self.c_real].zero_()
            self.c_len[b : self.c_real].zero_()
        self.c_real = b
        self.c_path[:b].copy_(path)
        self.c_len[:b].copy_(accept_length)
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        graph = self.commit_graphs.get(bs)
        if graph is None:
            self._commit_forward(bs)
        else:
            graph.replay()

    # ---- draft -------------------------------------------------------------------------------------------
    def can_draft(self, b: int, block_size: int, max_ctx_len: int) -> bool:
        return self.drafts and block_size == self.S and b <= self.buckets[-1] and max_ctx_len <= \
            self.runner.cfg.max_context

    def _draft_meta(self, bs: int, host_ctx_lens: list[int]) -> DraftAttentionMetadata:
        return DraftAttentionMetadata(ctx_lens=host_ctx_lens, ctx_lens_t=self.d_ctx[:bs], block_table=self.d_rows[:bs],
                                      block_positions=self.d_pos[:bs], page_size=self.runner.cfg.page_size)

    def _draft_forward(self, bs: int, backend, host_ctx_lens: list[int]):
        meta = self._draft_meta(bs, host_ctx_lens)
        return (self.runner.draft_forward(self.d_ids[:bs], self.d_pos[:bs], meta, backend),)

    def _draft_tree_forward(self, spec: tuple, bs: int, backend, host_ctx_lens: list[int]):
        """Drafter block -> drafter LM head (into the static logits) -> the tree, all on static buffers."""
        runner = self.runner
        hidden = runner.draft_forward(self.d_ids[:bs], self.d_pos[:bs], self._draft_meta(bs, host_ctx_lens), backend)
        logits = runner.drafter.logits(hidden[:, 1:], runner.target.lm_head)
        self.d_logits[:bs].copy_(logits)
        roots, depth = self.d_ids[:bs, 0], self.d_depth[:bs]
        algorithm, budget, topk_cap, shadow_linear = spec
        if algorithm == "DFLASH":
            tree = build_chain(roots, logits, max_depth=depth)
        else:
            tree = build_tree(roots, logits, budget, topk_cap, shadow_linear, max_depth=depth)
        for buf, x in zip(self.tree_bufs[spec], (tree.tokens, tree.parents, tree.depths, tree.valid, tree.tree_mask)):
            buf[:bs].copy_(x)
        return ()

    def _load_draft(self, meta, roots: torch.Tensor) -> int:
        b = roots.shape[0]
        if b < self.d_real:
            lo, hi = b, self.d_real
            self.d_rows[lo:hi].copy_(self.pad_rows[lo:hi])
            self.d_ctx[lo:hi].zero_()
            self.d_pos[lo:hi].copy_(self.d_arange.expand(hi - lo, self.S))
        self.d_real = b
        self.d_ids[:b, 0].copy_(roots)  # columns 1.. hold the mask token, never written
        torch.add(meta.lens[:, None], self.d_arange, out=self.d_pos[:b])
        self.d_rows[:b].copy_(meta.rows)
        self.d_ctx[:b].copy_(meta.lens)
        return b

    def draft(self, meta, roots: torch.Tensor) -> torch.Tensor:
        """Returns the drafter's final hidden [b, S, H] for the round's blocks (the plain block graph)."""
        gs = self._draft_set(None)
        b = self._load_draft(meta, roots)
        (hidden,) = gs.run(b, list(meta.kv_lens))
        return hidden[:b]

    def draft_tree(self, meta, roots: torch.Tensor, depth_limits: list[int] | None) -> tuple[torch.Tensor, DraftTree]:
        """One replay from the roots to the round's tree (the decoder's spec). depth_limits: per-request depth
        limits (None: all D). Returns (drafter logits [b, D, V], the tree)."""
        gs = self._draft_set(self.tree_spec)
        b = self._load_draft(meta, roots)
        if depth_limits is not None:
            self.d_depth[:b].copy_(torch.tensor(depth_limits, dtype=torch.int64))
            self.d_depth[b:self.d_limited].fill_(self.D)
            self.d_limited = b
        elif self.d_limited:
            self.d_depth[: self.d_limited].fill_(self.D)
            self.d_limited = 0
        gs.run(b, list(meta.kv_lens))
        tokens, parents, depths, valid, mask = (x[:b] for x in self.tree_bufs[self.tree_spec])
        return self.d_logits[:b], DraftTree(tokens, parents, depths, valid, mask, self.D)
