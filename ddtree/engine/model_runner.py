"""Forwards over paged KV: prefill (extend), drafter block, tree verify, and the commit of accepted nodes.

A round is data (engine/round/data.py): `begin` makes its `Round` (one host->device copy of the lengths and
slots the host already knows, shared by draft, verify and commit), `draft` returns a `Draft`, `verify` a
`Verify`, `commit` moves the accepted nodes, and the host reads back only the emitted tokens after it. With
`enable_cuda_graph`, draft, verify and commit replay CUDA graphs when `begin` finds the batch covered
(`ddtree/engine/graphs/runner.py`), and short prefill extends replay theirs (`ddtree/engine/graphs/extend.py`).

`Req.kv_len` has one owner, this runner: it counts the request's tokens whose target KV, drafter
context and hybrid state are committed, and it changes only in `prefill` (after the extend),
`advance` (after a round's commit: root + accepted drafts; the bonus token stays pending) and
`release` (0 when the request's pages are freed).
"""

from __future__ import annotations

import time

import torch

from ddtree.attention.backend import (
    AttentionMetadata,
    DraftAttentionMetadata,
    get_backend,
    store_kv,
)
from ddtree.engine.config import (
    EXTEND_BATCHES,
    RunnerConfig,
    pages_per_request,
    scratch_pages,
    tree_spec,
)
from ddtree.engine.graphs.extend import pack_pass, plan_passes
from ddtree.engine.graphs.packed import chunked_argmax
from ddtree.engine.memory.block_manager import NO_HIT, BlockManager, PrefixHit
from ddtree.engine.memory.kv_cache import KVPool
from ddtree.engine.memory.state_checkpoints import StateCheckpoints
from ddtree.engine.memory.state_pool import HybridStatePool
from ddtree.engine.round import prompt_logprobs
from ddtree.engine.round.data import Draft, Round, Verify
from ddtree.engine.scheduling.request import Req
from ddtree.engine.scheduling.step_stats import StepStats
from ddtree.speculative.batch_budget import pack as pack_layout
from ddtree.speculative.batch_budget import unpack


class ModelRunner:
    def __init__(self, target, drafter, cfg: RunnerConfig, device, dtype):
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.device, self.dtype = torch.device(device), dtype
        tcfg = target.config
        self.backend = get_backend(cfg.attention_backend)
        self.attn_layers = tcfg.attention_layer_ids
        self.pool_index = {layer: j for j, layer in enumerate(self.attn_layers)}
        # Scratch pages past the block manager's range (never handed out): the KV writes of padded CUDA-graph
        # rows land there, so padding can never touch a real request's KV.
        n_scratch = scratch_pages(cfg.max_verify_width, cfg.page_size)
        self.scratch_pages = list(range(cfg.num_pages, cfg.num_pages + n_scratch))
        slots = (cfg.num_pages + len(self.scratch_pages)) * cfg.page_size
        self.kv = KVPool(
            len(self.attn_layers), slots, tcfg.num_key_value_heads, tcfg.head_dim, dtype, device
        )
        self.draft_kv = None
        self.tap_layers: tuple[int, ...] = ()
        if drafter is not None:
            dcfg = drafter.config
            self.draft_kv = KVPool(
                dcfg.num_hidden_layers,
                slots,
                dcfg.num_key_value_heads,
                dcfg.head_dim,
                dtype,
                device,
            )
            self.tap_layers = dcfg.target_layer_ids
        max_pages = pages_per_request(cfg.max_context, cfg.max_verify_width, cfg.page_size)
        self.bm = BlockManager(
            cfg.num_pages,
            cfg.page_size,
            cfg.max_running_requests,
            max_pages,
            device,
            prefix_cache=cfg.prefix_cache,
        )
        self.check_writes = False  # debug: assert no KV write reaches a shared cached page
        self.step_stats = StepStats()  # prefill path per step (graphed / eager), decode batches
        # Hybrid targets keep recurrent state per request in rows indexed by the request's block-table slot.
        self.state_pool = None
        if tcfg.is_hybrid:
            # conv windows and stashed inputs keep the model dtype; SSM states --mamba-ssm-dtype
            self.state_pool = HybridStatePool.for_config(
                tcfg,
                cfg.max_running_requests,
                cfg.max_verify_width,
                device,
                cfg.mamba_strategy,
                cfg.mamba_ssm_dtype,
                target.model.embed_tokens.weight.dtype,
                scratch_row=True,  # what padded CUDA-graph rows read and write
            )
        # hybrid prefix hits restore a recurrent-state checkpoint taken at a page boundary
        self.checkpoints = None
        if self.state_pool is not None and cfg.prefix_cache and cfg.state_checkpoints > 0:
            self.checkpoints = StateCheckpoints(self.state_pool, cfg.state_checkpoints)
            self.bm.drop_checkpoint = self.checkpoints.give_back
        # prefill chunks of a hybrid request end on its prompt's last page boundary (a checkpoint)
        self.checkpoint_align = cfg.page_size if self.checkpoints is not None else 0
        self.tree_spec: tuple | None = None  # the decoder's tree (set_tree_spec)
        self.graphs = None
        if cfg.enable_cuda_graph:
            from ddtree.engine.graphs.runner import make_graph_runner

            self.graphs = make_graph_runner(self)

    def free_pools(self) -> None:
        """Give back the pools and graphs: the runner serves no more. A server stopped in-process
        (tests, an embedding application) frees its KV memory even while something still holds
        the engine (FastAPI caches its endpoints, whose closures hold the serving objects)."""
        self.kv = self.draft_kv = self.state_pool = self.checkpoints = None
        self.graphs = None

    # ---- the round ---------------------------------------------------------------------------------
    def begin(self, reqs: list[Req]) -> Round:
        """A round of `reqs`: their slots, lengths and pending tokens on the device in one copy, and
        whether the CUDA graphs cover it (every phase then replays; else every phase runs eagerly)."""
        slots, kv_lens = [r.slot for r in reqs], [r.kv_len for r in reqs]
        roots = [r.output_ids[-1] if r.output_ids else 0 for r in reqs]
        host = torch.tensor([slots, kv_lens, roots], dtype=torch.int64).to(self.device)
        rows = self.bm.block_table.index_select(0, host[0])
        graphed = self.graphs is not None and self.graphs.covers(len(reqs), max(kv_lens))
        return Round(reqs, slots, kv_lens, host[0], host[1], rows, host[2], graphed)

    def set_tree_spec(
        self, algorithm: str, budget: int, topk_cap: int, shadow_linear: bool
    ) -> None:
        """The decoder's tree spec (what `draft` builds unless told another): with CUDA graphs, the
        draft graphs then run drafter -> tree in one replay."""
        if algorithm in ("DFLASH", "DDTREE"):
            self.tree_spec = tree_spec(algorithm, budget, topk_cap, shadow_linear)
        if self.graphs is not None:
            self.graphs.set_tree_spec(algorithm, budget, topk_cap, shadow_linear)

    def add_tree_specs(self, specs) -> None:
        """More tree specs a round may draft with (auto: one per rung), for the draft graphs."""
        if self.graphs is not None:
            self.graphs.add_tree_specs(specs)

    def slots_of(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rows [b, max_pages] block-table rows, positions [b, m] logical -> KV slots [b, m]."""
        p = self.cfg.page_size
        return rows.gather(1, positions // p) * p + positions % p

    def target_forward(
        self, input_ids, positions, meta: AttentionMetadata, backend=None, linear=None
    ):
        """Target layers over flat tokens -> (final-normed hidden [T, H], taps [T, K*H] or None)."""
        backend, scale = backend or self.backend, self.target.scale

        def attend(layer, q, k, v):
            return backend.extend(q, k, v, self.kv.layer(self.pool_index[layer]), meta, scale)

        return self.target.hidden_states(
            input_ids, positions, attend, self.tap_layers, linear=linear
        )

    def draft_forward(
        self, ids, positions, meta: DraftAttentionMetadata, backend=None
    ) -> torch.Tensor:
        """Drafter layers over [b, S] blocks -> final-normed hidden [b, S, H]."""
        backend, dcfg, scale = backend or self.backend, self.drafter.config, self.drafter.scale

        def attend(layer, q, k, v):
            return backend.draft_block(
                q,
                k,
                v,
                self.draft_kv.layer(layer),
                meta,
                scale,
                dcfg.layer_is_causal(layer),
                dcfg.layer_window(layer),
            )

        return self.drafter.block_hidden(self.target.embed_tokens(ids), positions, attend)

    # ---- prefix cache --------------------------------------------------------------------------------
    def match_prefix(self, req: Req) -> PrefixHit:
        """The cached prefix a waiting request may reuse (nothing locked yet). Hybrid targets need a
        state checkpoint at exactly the hit length (with no checkpoint rows nothing hits, but the
        match still counts the cached tokens missed for it: `CacheStats.state_miss_tokens`)."""
        if self.bm.cache is None:
            return NO_HIT
        n = req.prefill_len
        cap = n - 1
        plp = req.prompt_logprobs
        if plp is not None and not plp.done:  # its rows come from a forward over them
            cap = min(cap, plp.next_row)
        return self.bm.match(req.token_slice(0, n), cap, self.state_pool is not None)

    def admit(self, req: Req, hit: PrefixHit) -> None:
        """A slot for a waiting request, its cached prefix attached: prefill starts at hit.length."""
        self.bm.attach(req, hit, self._copy_page)
        if hit.length and self.checkpoints is not None:
            self.checkpoints.restore(hit.nodes[-1].checkpoint, req.slot)
        req.kv_len = hit.length
        if not req.output_ids:
            req.cached_tokens = hit.length
        if self.bm.cache is not None:
            stats = self.bm.cache.stats
            stats.queried_tokens += req.prefill_len
            stats.hit_tokens += hit.length
            stats.state_miss_tokens += hit.state_miss

    def _copy_page(self, src: int, dst: int, n: int) -> None:
        """Copy-on-write: the first n slots of cached page src into private page dst (target KV and
        drafter context)."""
        p = self.cfg.page_size
        offs = torch.arange(n, device=self.device)
        src_slots, dst_slots = src * p + offs, dst * p + offs
        if self.check_writes:
            self.bm.check_writes(dst_slots)
        self.kv.move(src_slots, dst_slots)
        if self.draft_kv is not None:
            self.draft_kv.move(src_slots, dst_slots)

    def _cache_prefilled(self, reqs: list[Req]) -> None:
        """After a prefill: cache each request's full pages; hybrid targets checkpoint the state of a
        chunk that ended on a page boundary."""
        if self.bm.cache is None:
            return
        p = self.cfg.page_size
        for r in reqs:
            node = self.bm.cache_prefix(r, r.token_slice(0, r.kv_len), r.kv_len)
            at_node = node is not None and r.kv_len == node.depth * p
            if self.checkpoints is not None and at_node:
                self.checkpoints.keep(self.bm.cache, node, r.slot)

    # ---- forwards ------------------------------------------------------------------------------------
    def _extend(self, reqs, q_lens, input_ids, positions, linear=None):
        """Ragged causal extend (prefill chunks): request i appends q_lens[i] tokens after its kv_len."""
        kv_lens = [r.kv_len + q for r, q in zip(reqs, q_lens)]
        host = torch.tensor([[r.slot for r in reqs], q_lens, kv_lens], dtype=torch.int64).to(
            self.device
        )
        rows = self.bm.block_table.index_select(0, host[0])
        ridx = torch.repeat_interleave(torch.arange(len(reqs), device=self.device), host[1])
        p = self.cfg.page_size
        slot_mapping = rows[ridx, positions // p] * p + positions % p
        if self.check_writes:
            self.bm.check_writes(slot_mapping)
        indptr = torch.zeros(len(reqs) + 1, dtype=torch.int64, device=self.device)
        indptr[1:] = host[1].cumsum(0)
        meta = AttentionMetadata(
            q_lens=list(q_lens),
            kv_lens=kv_lens,
            qo_indptr=indptr,
            kv_lens_t=host[2],
            block_table=rows,
            slot_mapping=slot_mapping,
            page_size=p,
        )
        hidden, taps = self.target_forward(input_ids, positions, meta, linear=linear)
        return hidden, taps, slot_mapping, indptr[1:] - 1

    @torch.inference_mode()
    def prefill(self, reqs: list[Req], q_lens: list[int]) -> torch.Tensor:
        """Extend each request by its next `q_lens[i]` prompt tokens; returns last-token logits
        [b, V]. With extend graphs a short batch replays them (`extend_graph.plan_passes`: a pass
        per <= widest-width piece of each request and <= largest-bucket group of requests), else
        it runs eagerly (the reference)."""
        for r, q in zip(reqs, q_lens):
            self.bm.allocate(r, r.kv_len + q)
        ext = self.graphs.extend if self.graphs is not None else None
        # prompt log-prob rows need every row's hidden state: the eager extend
        eager = ext is None or prompt_logprobs.wants_rows(reqs, q_lens)
        passes = None if eager else ext.plan(q_lens)
        if passes is None:
            logits = self._prefill_eager(reqs, q_lens)
        else:
            logits = self._prefill_graphed(reqs, passes)
        t0 = time.perf_counter()
        self._cache_prefilled(reqs)
        st = self.step_stats
        st.cache_insert_s += time.perf_counter() - t0
        graphable = plan_passes(q_lens, st.widths, EXTEND_BATCHES[-1]) is not None
        st.on_prefill(q_lens, passes, graphable, sum(1 for r in reqs if not r.needs_prefill))
        return logits

    def _prefill_eager(self, reqs: list[Req], q_lens: list[int]) -> torch.Tensor:
        ids, pos = [], []
        for r, q in zip(reqs, q_lens):
            ids.append(torch.tensor(r.token_slice(r.kv_len, r.kv_len + q), dtype=torch.int64))
            pos.append(torch.arange(r.kv_len, r.kv_len + q))
        input_ids = torch.cat(ids).to(self.device)
        positions = torch.cat(pos).to(self.device)
        linear = None
        if self.state_pool is not None:
            linear = self.state_pool.extend_context(
                [r.slot for r in reqs], q_lens, [r.kv_len for r in reqs]
            )
        hidden, taps, slot_mapping, last = self._extend(
            reqs, q_lens, input_ids, positions, linear=linear
        )
        if self.drafter is not None:
            self.write_draft_context(taps, positions, slot_mapping)
        vocab = self.target.config.vocab_size
        prompt_logprobs.compute(reqs, q_lens, hidden, self.target.logits, vocab)
        for r, q in zip(reqs, q_lens):
            r.kv_len += q
        return self.target.logits(hidden[last]).float()

    def _prefill_graphed(self, reqs: list[Req], passes) -> torch.Tensor:
        """The passes in order (a request's later piece after its earlier one); each request's
        logits from its last pass."""
        out: list[torch.Tensor | None] = [None] * len(reqs)
        for width, rows in passes:
            sub, qs = [reqs[i] for i, _ in rows], [q for _, q in rows]
            host = pack_pass(sub, qs, width)
            logits = self.graphs.extend.run(width, host, [r.kv_len + width for r in sub])
            # a copy (fp32 weights too): the next pass or prefill overwrites the static buffer
            logits = logits.to(torch.float32, copy=True)
            for k, ((i, q), r) in enumerate(zip(rows, sub)):
                r.kv_len += q
                out[i] = logits[k]
            if len(passes) == 1:  # one pass: every request, in order
                return logits
        return torch.stack(out)

    @torch.inference_mode()
    def propose(self, rnd: Round, block_size: int | None = None):
        """The drafter's forward on [root, MASK x (S-1)] blocks (eager) -> its proposal for the S-1
        drafted positions (`drafter.propose`: DFlash's marginals' logits [b, S-1, V]; DFlash2's
        MarkovDraft)."""
        S = block_size or self.cfg.block_size
        ids = torch.full(
            (rnd.batch, S), self.drafter.config.mask_token_id, dtype=torch.int64, device=self.device
        )
        ids[:, 0] = rnd.roots
        positions = rnd.lens[:, None] + torch.arange(S, device=self.device)
        dmeta = DraftAttentionMetadata(
            ctx_lens=rnd.kv_lens,
            ctx_lens_t=rnd.lens,
            block_table=rnd.rows,
            block_positions=positions,
            page_size=self.cfg.page_size,
        )
        hidden = self.draft_forward(ids, positions, dmeta)
        return self.drafter.propose(hidden[:, 1:], self.target.lm_head)

    @torch.inference_mode()
    def draft(
        self,
        rnd: Round,
        depth_limits: list[int] | None = None,
        budgets: list[int] | None = None,
        spec: tuple | None = None,
    ) -> Draft:
        """The round's tree: the drafter's block, its LM head and the tree build of `spec` (None:
        the decoder's, `set_tree_spec`), per-request `depth_limits` and DDTree `budgets` (cuts of the
        spec's best-first build) applied (None: no limit). One replay where the round is graphed."""
        spec = spec or self.tree_spec
        g = self.graphs
        if rnd.graphed and g.draft_graph is not None:
            logits, tree = g.draft_tree(rnd, depth_limits, budgets, spec)
            return Draft(tree, logits)
        proposal = self.propose(rnd)
        dev = self.device
        max_depth = None if depth_limits is None else torch.tensor(depth_limits, device=dev)
        cut = None if budgets is None or spec[0] == "DFLASH" else torch.tensor(budgets, device=dev)
        tree = self.drafter.build_tree(rnd.roots, proposal, spec, max_depth, cut)
        return Draft(tree, self.drafter.proposal_logits(proposal))

    @torch.inference_mode()
    def verify(self, rnd: Round, tree) -> Verify:
        """One target forward over every request's tree (n nodes at logical slots [L, L+n), RoPE
        positions L + depth, ancestor mask): logits [b, n, V] and taps [b, n, K*H]; from a graph
        also the greedy tokens and accept walk of the same replay."""
        b, n = tree.tokens.shape
        self._reserve(rnd, n)
        if rnd.graphed and n in self.graphs.verify_sets:
            rnd.verified_in_graph = True
            logits, taps, tokens, res = self.graphs.verify(rnd, tree)
            return Verify(
                logits.view(b, n, -1),
                taps.view(b, n, -1) if taps is not None else None,
                tokens,
                res,
            )
        linear = None
        if self.state_pool is not None:
            linear = self.state_pool.tree_context(rnd.slot_ids, tree)
        hidden, taps = self.target_forward(
            tree.tokens.flatten(),
            (rnd.lens[:, None] + tree.depths).flatten(),
            self.verify_metadata(rnd, tree.tree_mask, n),
            linear=linear,
        )
        logits = self.target.logits(hidden).float().view(b, n, -1)
        return Verify(logits, taps.view(b, n, -1) if taps is not None else None)

    def _reserve(self, rnd: Round, n: int) -> None:
        """Pages for n tree nodes past every request's context, the round's block-table rows
        re-gathered over them, and its width: what a verify writes into."""
        for r in rnd.reqs:
            self.bm.allocate(r, r.kv_len + n)
        rnd.rows = self.bm.block_table.index_select(0, rnd.slot_ids)  # the pages just allocated
        rnd.width = n

    @torch.inference_mode()
    def verify_packed(
        self,
        rnd: Round,
        tree,
        keep: torch.Tensor,
        num_rows: int,
        logit_reqs: torch.Tensor | None = None,
    ) -> Verify:
        """One target forward over only the kept nodes of every request's tree (a batch-wide
        budget, speculative/batch_budget.py): request i's kept nodes keep[i] (ancestor-closed,
        root kept) as its q_len rows, packed one request after another into `num_rows` flat rows
        (a host int >= keep.sum(); rows past the kept ones are padding and write a scratch slot).
        Local node l of request i sits at logical KV position L + l, as node l does in a dense
        verify, so the accept walk and the commit run unchanged on the compact tree
        (`rnd.packed.tree`). Returns the greedy tokens [b, W] in local order and the flat taps
        [T, K*H]. One graph replay where the round is graphed and a packed graph holds num_rows
        (`packed_rows`: T is then its rows, the padding rows more), else eager. The LM head runs
        in chunks of rows for the greedy tokens, its logits never all in memory; only the
        requests `logit_reqs` [s] (those that sample, ask for log-probs or are under a grammar)
        get their nodes' logits back, [s, W, V] in local order: no more than a dense verify of
        those requests at width W would hold. Dense targets: a hybrid's GDN state steps per
        node of a dense tree."""
        if self.state_pool is not None:
            raise ValueError("a packed verify needs a dense target (hybrid state is per node)")
        b, n = tree.tokens.shape
        self._reserve(rnd, n)
        graphed = self._packed_graph_rows(rnd, num_rows)  # the replay's rows, or None: eager
        lay = rnd.packed = pack_layout(tree, keep, rnd.lens, graphed or num_rows)
        page_rows = rnd.rows.index_select(0, lay.flat_req.clamp(min=0))
        slots = self.slots_of(page_rows, lay.kv_positions[:, None]).flatten()
        scratch = self.scratch_pages[0] * self.cfg.page_size
        slots = torch.where(lay.row_valid, slots, scratch)
        if self.check_writes:
            self.bm.check_writes(slots[lay.row_valid])
        # the Triton kernel reads each request's q_len from qo_indptr and only bounds from the
        # host; the torch reference loops over the host lengths (a read-back, free on the CPU)
        exact = self.backend.reads_host_q_lens(self.target.config.head_dim, self.device)
        q_lens = lay.q_lens.tolist() if exact else [n] * b
        kv_lens = [k + q for k, q in zip(rnd.kv_lens, q_lens)]
        if graphed is not None:
            q_host = q_lens if exact else None
            tokens, taps, hidden = self.graphs.verify_packed(rnd, lay, slots, q_host, kv_lens)
        else:
            meta = AttentionMetadata(
                q_lens=q_lens,
                kv_lens=kv_lens,
                qo_indptr=lay.qo_indptr,
                kv_lens_t=rnd.lens + lay.q_lens,
                block_table=rnd.rows,
                slot_mapping=slots,
                page_size=self.cfg.page_size,
                tree_mask=lay.tree.tree_mask,
            )
            hidden, taps = self.target_forward(lay.input_ids, lay.positions, meta)
            tokens = chunked_argmax(self.target, hidden)
        logits = None
        if logit_reqs is not None:  # padding local nodes read row 0: never walked
            rows = lay.local_row.index_select(0, logit_reqs).clamp(min=0)
            logits = self.target.logits(hidden.index_select(0, rows.flatten()))
            logits = logits.float().view(*rows.shape, -1)  # as the eager dense verify's
        return Verify(logits, taps, unpack(tokens, lay))

    def packed_rows(self, b: int) -> list[int]:
        """The row counts a packed verify of b requests replays in a graph (ascending; [] where
        it runs eagerly: no graphs, or none captured for packing)."""
        g = self.graphs
        return g.packed_rows(b) if g is not None and g.packed is not None else []

    def enable_packing(self) -> None:
        """A batch-wide budget's rounds will run: capture the packed verify's graphs."""
        if self.graphs is not None:
            self.graphs.enable_packing()

    def _packed_graph_rows(self, rnd: Round, num_rows: int) -> int | None:
        """The rows of the packed graph that holds num_rows for this round, or None (eager)."""
        if not rnd.graphed:
            return None
        return next((t for t in self.packed_rows(rnd.batch) if t >= num_rows), None)

    def verify_metadata(self, rnd: Round, tree_mask: torch.Tensor, n: int) -> AttentionMetadata:
        b = rnd.batch
        lpos = rnd.lens[:, None] + torch.arange(n, device=self.device)
        slot_mapping = self.slots_of(rnd.rows, lpos).flatten()
        if self.check_writes:
            self.bm.check_writes(slot_mapping)
        return AttentionMetadata(
            q_lens=[n] * b,
            kv_lens=[k + n for k in rnd.kv_lens],
            qo_indptr=torch.arange(0, (b + 1) * n, n, device=self.device),
            kv_lens_t=rnd.lens + n,
            block_table=rnd.rows,
            slot_mapping=slot_mapping,
            page_size=self.cfg.page_size,
            tree_mask=tree_mask,
        )

    @torch.inference_mode()
    def commit(
        self, rnd: Round, vo: Verify, path: torch.Tensor, accept_length: torch.Tensor
    ) -> None:
        """Move the accepted nodes' KV to logical positions L..L+k (contiguous, in path order) and
        write their drafter context (hybrid: the accepted state first). path [b, D+1] node indices
        (root first), accept_length [b] = k. Replayed on the verify graph's rows where the verify
        replayed; `advance` applies the accepted lengths once read back."""
        if rnd.verified_in_graph and self.graphs.commits(rnd.width):
            self.graphs.commit(rnd.width, path, accept_length)
            return
        if self.state_pool is not None:  # nothing for a one-node verify that stepped in place
            self.state_pool.commit(rnd.slot_ids, path, accept_length, nodes=rnd.width or None)
        tap_rows = None if rnd.packed is None else rnd.packed.local_row
        if rnd.width > 1 or vo.taps is not None:  # AR without a drafter: nothing to commit
            self.commit_kv(rnd.lens, rnd.rows, path, accept_length, vo.taps, tap_rows)

    def commit_kv(self, lens, rows, path, accept_length, taps, tap_rows=None) -> None:
        """The KV move and drafter-context write of `commit` (fixed shapes, no host reads:
        capturable). tap_rows [b, n]: a packed verify's flat row of each local node (taps are
        then its flat [T, K*H] rows)."""
        j = torch.arange(path.shape[1], device=self.device)
        jj = torch.minimum(j[None, :], accept_length[:, None])  # padding repeats the last real row
        src_node = path.gather(1, jj)
        dst_pos = lens[:, None] + jj
        src_slot = self.slots_of(rows, lens[:, None] + src_node).flatten()
        dst_slot = self.slots_of(rows, dst_pos).flatten()
        if self.check_writes:
            self.bm.check_writes(dst_slot)
        if path.shape[1] > 1:  # a one-node tree's root already sits at L: nothing moves
            self.kv.move(src_slot, dst_slot)
        if self.drafter is not None and taps is not None:
            if tap_rows is not None:
                flat = tap_rows.gather(1, src_node).clamp(min=0).flatten()
                feats = taps.index_select(0, flat).view(*src_node.shape, taps.shape[-1])
            else:
                feats = taps.gather(1, src_node[..., None].expand(-1, -1, taps.shape[-1]))
            self.write_draft_context(feats.flatten(0, 1), dst_pos.flatten(), dst_slot)

    def write_draft_context(
        self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        for layer, (k, v) in enumerate(self.drafter.context_kv(features, positions)):
            store_kv(self.draft_kv.layer(layer), slots, k, v)

    def advance(self, rnd: Round, committed: list[int]) -> None:
        """After a round's `commit`: request i has `committed[i]` more cached tokens (its root and
        accepted drafts); the pages its verify reserved past them go back. Ends the round."""
        for r, k in zip(rnd.reqs, committed):
            r.kv_len += k
            self.bm.trim(r, r.kv_len)

    def release(self, req: Req, keep_tokens: int | None = None) -> None:
        """Trim to `keep_tokens` cached tokens, or free everything (then it caches nothing; with the
        prefix cache its full pages stay cached for later requests)."""
        if keep_tokens is None:
            # A finish inside an accepted block (stop string or id, EOS, max_tokens) drops the
            # block's later tokens, whose KV the round already wrote: what the request commits is
            # its tokens, so the KV it hands the cache ends with them.
            req.kv_len = min(req.kv_len, req.seq_len)
            tokens = req.token_slice(0, req.kv_len) if self.bm.cache is not None else None
            self.bm.free(req, tokens, req.kv_len)
            req.kv_len = 0
        else:
            self.bm.trim(req, keep_tokens)
