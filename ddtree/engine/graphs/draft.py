"""The draft graph family: the drafter block (width S = block_size) on static buffers, and per tree
spec the fused drafter block -> drafter LM head -> the round's draft tree (`drafter.build_tree`
with the decoder's budget / top-k cap / shadow-linear: DFlash's best-first tree, its node
selection the one-launch kernel of `kernels/tree_build` on CUDA, or its top-1 chain for DFLASH;
DFlash2's path-conditioned tree or selector chain) with per-request depth
limits read from a static tensor (block_size - 1 where unlimited, so one graph serves every round),
and per-request budgets likewise (the spec's budget where unlimited): the tree is built once at the
spec's budget and each request keeps the first `budget` nodes of its best-first order, packed
first, so mixed budgets need no eager build; the decoder then verifies the tree narrowed to the
round's width. The build's best-first path probabilities (`DraftTree.path_probs`, the budget
policy's gain curve) and the top-1 chain's (`chain_probs`) land in static buffers too. With
`--speculative-ddtree-budget auto` every rung has its own spec (the DDTree build at the rung's
budget, and the DFLASH chain), so a round of one budget b costs what the fixed B=b server's
draft costs, and mixed budgets build at the round's largest rung.
The draft graphs of one tree spec are captured when the decoder announces its spec
(`CudaGraphRunner.set_tree_spec`); without one the plain block graph (hidden states out, LM head
eager) is captured on first use. Padding rows: an empty drafter context in the scratch pages (see
graph_buffers.py).
"""

from __future__ import annotations

import torch

from ddtree.attention.backend import DraftAttentionMetadata
from ddtree.engine.graphs.buffers import Padding
from ddtree.kernels.tree_attention.dispatch import MODES, AttentionShape
from ddtree.speculative.tree import DraftTree


class DraftGraph:
    """The drafter block's static buffers (padding state) and its forwards: `forward` (hidden out)
    and `tree_forward(spec)` (into the static drafter logits and the spec's static tree fields)."""

    def __init__(self, runner, padding: Padding):
        self.runner = runner
        cfg, dev, M = runner.cfg, runner.device, padding.max_bs
        S = self.S = cfg.block_size
        self.D = S - 1
        self.max_bs = M
        self.pad_rows = padding.rows
        self.ids = torch.full(
            (M, S), runner.drafter.config.mask_token_id, dtype=torch.int64, device=dev
        )
        self.arange = torch.arange(S, device=dev)
        # own memory at M = 1
        self.pos = self.arange.expand(M, S).clone(memory_format=torch.contiguous_format)
        self.rows = self.pad_rows.clone()
        self.ctx = torch.zeros(M, dtype=torch.int64, device=dev)
        self.depth = torch.full(
            (M,), self.D, dtype=torch.int64, device=dev
        )  # per-request depth limits
        self.limited = 0  # leading rows whose depth limit may be < D
        # per DDTREE spec: [M] per-request budgets and [M, B] best-first path probabilities
        # (each spec's graphs read and write their own)
        self.budgets: dict[tuple, torch.Tensor] = {}
        self.path_probs: dict[tuple, torch.Tensor] = {}
        self.chain_probs: dict[tuple, torch.Tensor] = {}  # per spec: [M, D] the top-1 chain's
        self.budgeted: dict[tuple, int] = {}  # leading rows whose budget may be below the spec's
        self.logits = None  # [M, D, V] static drafter logits, made with the first tree spec
        self.trees: dict[tuple, tuple] = {}  # tree spec -> static DraftTree fields [M, ...]
        self.live = 0

    def attention_shape(self, bs: int, bound: int) -> AttentionShape:
        """The shape of the drafter's last attention call in `forward(bs, ., [bound] * bs)`."""
        d, k_pool = self.runner.drafter.config, self.runner.draft_kv.layer(0)[0]
        last = d.num_hidden_layers - 1
        causal = d.layer_is_causal(last)
        return AttentionShape(
            bs,
            self.S,
            bound + self.S,
            d.num_attention_heads,
            d.num_key_value_heads,
            d.head_dim,
            self.runner.cfg.page_size,
            k_pool.dtype,
            MODES["causal" if causal else "all"],
            True,
            k_pool.is_contiguous() and k_pool.data_ptr() % 16 == 0,
            d.layer_window(last) or 0,
        )

    def add_tree(self, spec: tuple) -> None:
        """The static drafter logits (with the first spec) and the spec's static DraftTree
        fields. They lie outside the graph pool: a graph-owned output could share memory with an
        intermediate of a verify graph captured earlier, and the tree is read after verify."""
        M, dev = self.max_bs, self.runner.device
        if self.logits is None:
            head = self.runner.target.lm_head.weight
            vocab = self.runner.target.config.vocab_size  # the LM head may hold one TP shard
            self.logits = torch.empty(M, self.D, vocab, dtype=head.dtype, device=dev)
        N = 1 + (self.D if spec[0] == "DFLASH" else spec[1])
        self.chain_probs[spec] = torch.zeros(M, self.D, dtype=torch.float32, device=dev)
        if spec[0] == "DDTREE":
            self.budgets[spec] = torch.full((M,), spec[1], dtype=torch.int64, device=dev)
            self.path_probs[spec] = torch.zeros(M, spec[1], dtype=torch.float32, device=dev)
        self.trees[spec] = (
            torch.zeros(M, N, dtype=torch.int64, device=dev),
            torch.full((M, N), -1, dtype=torch.int64, device=dev),
            torch.zeros(M, N, dtype=torch.int64, device=dev),
            torch.zeros(M, N, dtype=torch.bool, device=dev),
            torch.zeros(M, N, N, dtype=torch.bool, device=dev),
        )

    def pad(self, lo: int, hi: int) -> None:
        self.rows[lo:hi].copy_(self.pad_rows[lo:hi])
        self.ctx[lo:hi].zero_()
        self.pos[lo:hi].copy_(self.arange.expand(hi - lo, self.S))

    def load(
        self,
        meta,
        roots: torch.Tensor,
        depth_limits: list[int] | None = None,
        budgets: list[int] | None = None,
        spec: tuple | None = None,
    ) -> int:
        """The round's roots, rows and context lengths (meta: the Round), per-request depth
        limits (None: all D) and budgets of the DDTREE `spec` (None: the spec's); returns the
        live batch b."""
        b = roots.shape[0]
        if b < self.live:
            self.pad(b, self.live)
        self.live = b
        self.ids[:b, 0].copy_(roots)  # columns 1.. hold the mask token, never written
        torch.add(meta.lens[:, None], self.arange, out=self.pos[:b])
        self.rows[:b].copy_(meta.rows)
        self.ctx[:b].copy_(meta.lens)
        if depth_limits is not None:
            self.depth[:b].copy_(torch.tensor(depth_limits, dtype=torch.int64))
            self.depth[b : self.limited].fill_(self.D)
            self.limited = b
        elif self.limited:
            self.depth[: self.limited].fill_(self.D)
            self.limited = 0
        if spec in self.budgets:
            buf, low = self.budgets[spec], self.budgeted.get(spec, 0)
            if budgets is not None:
                buf[:b].copy_(torch.tensor(budgets, dtype=torch.int64))
                buf[b:low].fill_(spec[1])
                self.budgeted[spec] = b
            elif low:
                buf[:low].fill_(spec[1])
                self.budgeted[spec] = 0
        elif budgets is not None:
            raise ValueError(f"per-request budgets need a DDTREE tree spec, not {spec}")
        return b

    def _meta(self, bs: int, host_ctx_lens: list[int]) -> DraftAttentionMetadata:
        return DraftAttentionMetadata(
            ctx_lens=host_ctx_lens,
            ctx_lens_t=self.ctx[:bs],
            block_table=self.rows[:bs],
            block_positions=self.pos[:bs],
            page_size=self.runner.cfg.page_size,
        )

    def forward(self, bs: int, backend, host_ctx_lens: list[int]) -> tuple:
        meta = self._meta(bs, host_ctx_lens)
        return (self.runner.draft_forward(self.ids[:bs], self.pos[:bs], meta, backend),)

    def tree_forward(self, spec: tuple, bs: int, backend, host_ctx_lens: list[int]) -> tuple:
        """Drafter block -> drafter LM head (into the static logits) -> the tree, all on static
        buffers."""
        runner = self.runner
        hidden = runner.draft_forward(
            self.ids[:bs], self.pos[:bs], self._meta(bs, host_ctx_lens), backend
        )
        drafter = runner.drafter
        proposal = drafter.propose(hidden[:, 1:], runner.target.lm_head)
        self.logits[:bs].copy_(drafter.proposal_logits(proposal))
        roots, depth = self.ids[:bs, 0], self.depth[:bs]
        budgets = self.budgets[spec][:bs] if spec[0] == "DDTREE" else None
        tree = drafter.build_tree(roots, proposal, spec, depth, budgets)
        if spec[0] == "DDTREE":
            self.path_probs[spec][:bs].copy_(tree.path_probs)
        self.chain_probs[spec][:bs].copy_(tree.chain_probs)
        for buf, x in zip(
            self.trees[spec], (tree.tokens, tree.parents, tree.depths, tree.valid, tree.tree_mask)
        ):
            buf[:bs].copy_(x)
        return ()

    def tree(self, spec: tuple, b: int) -> tuple[torch.Tensor, DraftTree]:
        """(drafter logits [b, D, V], the tree) of the latest `tree_forward(spec)` replay."""
        tokens, parents, depths, valid, mask = (x[:b] for x in self.trees[spec])
        probs = self.path_probs[spec][:b] if spec in self.path_probs else None
        tree = DraftTree(tokens, parents, depths, valid, mask, self.D, probs)
        tree.chain_probs = self.chain_probs[spec][:b]
        return self.logits[:b], tree
