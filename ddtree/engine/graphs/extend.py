"""The extend graph family: a short prefill (a few hundred new tokens, typically a new chat turn
over a cached prefix) as one CUDA-graph replay per pass instead of an eager, launch-bound forward.

Why a family of its own, not a verify of a forced-accept chain: the verify family computes the LM
head over all W rows (a [W, vocab] logits buffer per row: 78 MB at W = 256 on a 152k vocabulary),
runs the accept walk, and for hybrid targets writes a per-node state stash sized for the verify
width (extra_buffer: one full GDN state per node, ~150 MB per node on the 27B shape). An extend
needs none of it: the target forward with the causal mask, the drafter-context write, and the LM
head on each request's last real token, all in one replay.

Rows. A graph of width W and padded batch bs runs bs rows of W tokens. Row i of a pass extends a
request by q_i <= W tokens at positions kv_len .. kv_len + q_i - 1; its tokens past q_i are padding.
Padding tokens sit causally after the real ones, so no real token attends to them; their K/V and
drafter-context writes go to the runner's scratch pages (never a page of any request, so never a
shared cached page), and the block-table row read by the attention kernel is the request's own with
scratch pages appended for the columns past it. Padded rows (i >= the live batch) are whole padding
requests: scratch pages, the state pool's scratch row, a fresh (zero) state.

Hybrid (Gated DeltaNet) targets: the prefill rule runs on the committed state rows themselves, as
the eager extend does (`ExtendLinear`), so the width is not bound by the verify stash: no stash is
read or written. Padding tokens are made identities of the recurrence (k = v = 0, beta = 0,
log-decay g = 0: the chunk form's own padding), and the conv window kept is the one after the last
real token (gathered at q_i), so the state written back is the state after exactly q_i tokens.

Passes. `plan_passes` cuts a prefill batch into passes of at most the widest width per request and
the largest extend bucket of requests; more than `EXTEND_MAX_PASSES` passes run eagerly (a long
uncached prompt is compute-bound: eager is fine there).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time

import torch
import torch.nn.functional as F

from ddtree.attention.backend import AttentionMetadata
from ddtree.engine.config import EXTEND_BATCHES, EXTEND_MAX_PASSES
from ddtree.kernels.gdn.dispatch import chunk_rule
from ddtree.kernels.tree_attention.dispatch import MODES, AttentionShape

logger = logging.getLogger("ddtree")

# one pass: (width, [(request index in the prefill batch, new tokens of this pass)])
Pass = tuple[int, list[tuple[int, int]]]


def plan_passes(
    q_lens: list[int], widths: list[int], max_bs: int, max_passes: int = EXTEND_MAX_PASSES
) -> list[Pass] | None:
    """The graph passes of a prefill batch (request i extends by q_lens[i]), or None when it should
    run eagerly (no widths, or more than max_passes passes). Requests go in groups of max_bs; a
    group's pass takes up to the widest width of each request's remaining tokens, at the narrowest
    width that holds the longest of them."""
    if not widths or not q_lens or min(q_lens) <= 0:
        return None
    top, passes = widths[-1], []
    for lo in range(0, len(q_lens), max_bs):
        left = {i: q_lens[i] for i in range(lo, min(lo + max_bs, len(q_lens)))}
        while left:
            rows = [(i, min(n, top)) for i, n in left.items()]
            passes.append((widths[bisect.bisect_left(widths, max(q for _, q in rows))], rows))
            if len(passes) > max_passes:
                return None
            left = {i: n - q for (i, q), n in zip(rows, left.values()) if n > q}
    return passes


def pack_pass(reqs, q_lens: list[int], width: int) -> torch.Tensor:
    """Host [b, W + 3] int64: each row's next q tokens (0-padded to W), its block-table slot, its
    cached length and q; one host-to-device copy loads a pass."""
    out = torch.zeros(len(reqs), width + 3, dtype=torch.int64)
    for i, (r, q) in enumerate(zip(reqs, q_lens)):
        out[i, :q] = torch.tensor(r.token_slice(r.kv_len, r.kv_len + q), dtype=torch.int64)
        out[i, width:] = torch.tensor([r.slot, r.kv_len, q], dtype=torch.int64)
    return out


class ExtendGraphs:
    """The extend family of every width and their graphs (`GraphSet`s on the extend buckets): what
    `CudaGraphRunner.extend` is. `plan` cuts a prefill batch into passes (None: eager), `run`
    replays one pass and returns its rows' logits (a view of the static buffer: read it before
    the next pass)."""

    def __init__(self, owner, padding, widths, max_bs: int, graph_set):
        runner = owner.runner
        self.owner, self.widths = owner, sorted(widths)
        self.buckets = [b for b in EXTEND_BATCHES if b < max_bs] + [max_bs]
        widest = ExtendGraph(runner, padding, self.widths[-1], max_bs)
        self.graphs = {
            w: widest if w == widest.n else ExtendGraph(runner, padding, w, max_bs, share=widest)
            for w in self.widths
        }
        top = runner.cfg.max_context
        self.sets = {
            w: graph_set(owner, g.forward, g.attention_shape, top + w, w, self.buckets)
            for w, g in self.graphs.items()
        }
        self.enabled = True  # False: every prefill eager (`eager()`: the warm-up, the A/B)
        self.build_seconds = 0.0

    def build(self) -> None:
        t0 = time.perf_counter()
        for w in reversed(self.widths):  # widest first: the narrower reuse its pool memory
            self.sets[w].build(self.buckets)
        if self.owner.capture:
            torch.cuda.synchronize()
        self.build_seconds = time.perf_counter() - t0  # the start-up time the extend adds
        if self.owner.capture:
            logger.info(
                "CUDA graphs captured: %d extend (widths %s, batch sizes %s) in %.1f s.",
                sum(len(gs.graphs) for gs in self.sets.values()),
                "/".join(map(str, self.widths)),
                self.buckets,
                self.build_seconds,
            )

    def plan(self, q_lens: list[int]) -> list[Pass] | None:
        if not self.enabled:
            return None
        return plan_passes(q_lens, self.widths, self.buckets[-1])

    def run(self, width: int, host: torch.Tensor, host_kv_lens: list[int]) -> torch.Tensor:
        """One pass (`pack_pass`'s rows, their cached lengths + width): logits [b, V]."""
        g = self.graphs[width]
        b = g.load(host)
        self.sets[width].run(b, host_kv_lens)
        return g.logits[:b]

    @contextlib.contextmanager
    def eager(self):
        """Prefills inside run eagerly."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was


class ExtendGraph:
    """Static buffers (padding state), `load` and the captured `forward` of the extend at width
    n, for up to max_bs rows; `logits` [max_bs, V] (the LM head's dtype, outside the graph pool,
    shared with the wider widths' graphs) holds each row's last-real-token logits after a replay."""

    def __init__(self, runner, padding, n: int, max_bs: int, share: ExtendGraph | None = None):
        self.runner, self.n, self.max_bs = runner, n, max_bs
        dev, M, p = runner.device, max_bs, runner.cfg.page_size
        self.P = runner.bm.max_pages_per_req
        # columns past a block-table row (scratch): a row's padding tokens may reach W past it
        cols = self.P + -(-n // p) + 1
        scratch = padding.scratch
        self.pad_rows = scratch[torch.arange(cols, device=dev) % len(scratch)].expand(M, cols)
        self.pad_rows = self.pad_rows.clone(memory_format=torch.contiguous_format)
        self.pad_slots = padding.slots(n)[: M * n].clone()
        self.arange = torch.arange(n, device=dev)
        self.ids = torch.zeros(M * n, dtype=torch.int64, device=dev)
        self.pos = self.arange.repeat(M)
        self.slots = self.pad_slots.clone()
        self.rows = self.pad_rows.clone()
        self.kv_lens = torch.full((M,), n, dtype=torch.int64, device=dev)
        self.q = torch.ones(M, dtype=torch.int64, device=dev)  # real tokens per row
        self.indptr = torch.arange(0, (M + 1) * n, n, device=dev)
        self.hybrid = padding.state_row is not None
        self.pad_state_row = padding.state_row
        if self.hybrid:
            self.state_rows = torch.full((M,), padding.state_row, dtype=torch.int64, device=dev)
            self.fresh = torch.ones(M, dtype=torch.bool, device=dev)  # start from a zero state
            self.real = self.arange[None, :] < self.q[:, None]  # [M, n] real (not padding) tokens
        if share is not None:
            self.logits = share.logits[:M]
        else:
            head = runner.target.lm_head.weight
            vocab = runner.target.config.vocab_size  # the LM head may hold one TP shard
            self.logits = torch.zeros(M, vocab, dtype=head.dtype, device=dev)
        self.live = 0

    def attention_shape(self, bs: int, bound: int) -> AttentionShape:
        """The shape of every target attention call of `forward(bs, ., [bound] * bs)`."""
        t, k_pool = self.runner.target.config, self.runner.kv.layer(0)[0]
        return AttentionShape(
            bs,
            self.n,
            bound,
            t.num_attention_heads,
            t.num_key_value_heads,
            t.head_dim,
            self.runner.cfg.page_size,
            k_pool.dtype,
            MODES["causal"],
            False,
            k_pool.is_contiguous() and k_pool.data_ptr() % 16 == 0,
        )

    def pad(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) back to the padding state."""
        n = self.n
        self.slots[lo * n : hi * n].copy_(self.pad_slots[lo * n : hi * n])
        self.rows[lo:hi].copy_(self.pad_rows[lo:hi])
        self.pos[lo * n : hi * n].copy_(self.arange.repeat(hi - lo))
        self.ids[lo * n : hi * n].zero_()
        self.kv_lens[lo:hi].fill_(n)
        self.q[lo:hi].fill_(1)
        if self.hybrid:
            self.state_rows[lo:hi].fill_(self.pad_state_row)
            self.fresh[lo:hi].fill_(True)
            self.real[lo:hi].copy_(self.arange[None, :] < 1)

    def load(self, host: torch.Tensor) -> int:
        """One pass's rows (`pack_pass`'s host tensor); returns the live batch b."""
        n, b, runner = self.n, host.shape[0], self.runner
        dev = host.to(runner.device)
        if b < self.live:
            self.pad(b, self.live)
        self.live = b
        slot, start, q = dev[:, n], dev[:, n + 1], dev[:, n + 2]
        T = b * n
        self.ids[:T].copy_(dev[:, :n].flatten())
        lpos = start[:, None] + self.arange
        self.pos[:T].copy_(lpos.flatten())
        self.rows[:b, : self.P].copy_(runner.bm.block_table.index_select(0, slot))
        real = self.arange[None, :] < q[:, None]
        own = runner.slots_of(self.rows[:b], lpos)
        self.slots[:T].copy_(torch.where(real, own, self.pad_slots[:T].view(b, n)).flatten())
        if runner.check_writes:
            runner.bm.check_writes(self.slots[:T])
        torch.add(start, n, out=self.kv_lens[:b])
        self.q[:b].copy_(q)
        if self.hybrid:
            self.state_rows[:b].copy_(slot)
            self.fresh[:b].copy_(start == 0)
            self.real[:b].copy_(real)
        return b

    def forward(self, bs: int, backend, host_kv_lens: list[int]) -> tuple:
        """Target forward (causal) -> drafter-context write -> LM head on each row's last real
        token (into `logits`). Returns nothing graph-owned: what is read after a replay lives in
        static buffers."""
        n, T, runner = self.n, bs * self.n, self.runner
        meta = AttentionMetadata(
            q_lens=[n] * bs,
            kv_lens=host_kv_lens,
            qo_indptr=self.indptr[: bs + 1],
            kv_lens_t=self.kv_lens[:bs],
            block_table=self.rows[:bs],
            slot_mapping=self.slots[:T],
            page_size=runner.cfg.page_size,
        )
        linear = ExtendLinear(self, bs) if self.hybrid else None
        hidden, taps = runner.target_forward(
            self.ids[:T], self.pos[:T], meta, backend, linear=linear
        )
        if runner.drafter is not None and taps is not None:
            runner.write_draft_context(taps, self.pos[:T], self.slots[:T])
        last = self.indptr[:bs] + self.q[:bs] - 1
        self.logits[:bs].copy_(runner.target.logits(hidden.index_select(0, last)))
        return ()


class ExtendLinear:
    """The `LinearStateContext` of an extend replay: [bs, n] rows over the committed state rows
    (`ExtendGraph.state_rows`), the eager extend's math (`state_contexts.ExtendContext`: the reference
    conv, the chunk-form rule) batched, with padding tokens turned into state identities."""

    def __init__(self, g: ExtendGraph, bs: int):
        self.pool, self.bs, self.n = g.runner.state_pool, bs, g.n
        self.rows, self.fresh, self.real, self.q = (
            g.state_rows[:bs],
            g.fresh[:bs],
            g.real[:bs],
            g.q[:bs],
        )

    def _initial(self, t: torch.Tensor) -> torch.Tensor:
        return torch.where(self.fresh.view(-1, *[1] * (t.dim() - 1)), 0, t)

    def conv(self, j, x, weight, bias):
        K, C = weight.shape[1], x.shape[-1]
        state0 = self._initial(self.pool.conv[j, self.rows])  # [bs, C, K-1]
        # [bs, K-1+n, C]: the window before the row, then its tokens (causal_conv1d_prefill's)
        ext = torch.cat([state0.float().transpose(1, 2), x.view(self.bs, self.n, C).float()], 1)
        y = (ext.unfold(1, K, 1) * weight.float()).sum(-1)
        if bias is not None:
            y = y + bias.float()
        # the window after the last real token: inputs q-K+1 .. q-1 = ext rows q .. q+K-2
        idx = self.q[:, None] + torch.arange(K - 1, device=x.device)
        state = ext.gather(1, idx[..., None].expand(-1, -1, C))
        self.pool.conv[j, self.rows] = state.transpose(1, 2).to(self.pool.dtype)
        return F.silu(y).to(x.dtype).view(self.bs * self.n, C)

    def rule(self, j, q, k, v, gate):
        g, beta = gate.values()

        def rows(t):
            return t.view(self.bs, self.n, *t.shape[1:])

        real = self.real
        keep = real[..., None, None]
        k, v = torch.where(keep, rows(k), 0), torch.where(keep, rows(v), 0)
        g, beta = (
            torch.where(real[..., None], rows(g), 0),
            torch.where(real[..., None], rows(beta), 0),
        )
        S0 = self._initial(self.pool.ssm[j, self.rows])
        o, S = chunk_rule(rows(q), k, v, g, beta, S0)
        self.pool.ssm[j, self.rows] = S.to(self.pool.ssm_dtype)
        return o.flatten(0, 1)
