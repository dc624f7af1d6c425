"""CUDA graphs for the forwards of every round, one family each: the target verify (width n =
max_verify_width, + the greedy accept walk), the commit, and the drafter block -> tree (width S =
block_size); the packed verify of a batch-wide budget's rounds (auto on a dense target: rows
= batch + E, engine/graphs/packed.py); and the short prefill extend (widths
`RunnerConfig.extend_widths`, its own batch buckets). Each family (buffers.py: `VerifyGraph`,
`CommitGraph`; draft.py: `DraftGraph`; packed.py: `PackedVerifyGraph`; extend.py:
`ExtendGraph`) owns its static buffers and how a round's data is loaded into them;
here are the padded batch buckets, the graphs per (padded batch, launch plan), their capture into
one memory pool, the replay, and `CudaGraphRunner`, the face `ModelRunner` sees.

KV splits. The Triton kernel is capturable because its launch shape depends only on host ints
(batch, max q_len, num_splits), so the split count is fixed per graph, and no single count is right
for all contexts: the count that fills the GPU at a long context (tens of splits for a small batch)
makes a short-context round pay for mostly-empty programs, their partial writes and the combine; one
split leaves a long context to a few dozen programs on 132 SMs. So the live max kv_len picks a
bucket (<= 1k, 4k, 16k, max context) and each (bs, bucket) uses the kernel's own choice
(`choose_num_splits`) at the bucket's upper bound: the attention backend's `launch_plan` for the
family's attention shape there, asked after one eager call (which compiles the variant). That choice
depends on the context only through its cap (>= 4 KV tiles per split for decode rows, >= 6 for tree
/ chain rows), so it grows with the bucket (never decreasing) and then saturates: graphs are keyed
by (bs, `LaunchPlan.capture_key` = split count and whether the Hopper kernel runs: the two paths
choose their split counts differently, so an equal count alone does not mean the same launches) and
buckets with equal plans share one. A live context gets its bucket top's count: never fewer splits
than eager would pick, and the surplus is bounded by the bucket's width (4x in the middle buckets).
An empty split (its tile range lies past the request's context) runs no loop iteration and stores
lse = -inf; the combine gives it weight 0. Every real or padded row sees at least itself in some
split, so no row is all -inf and the result equals the unsplit one up to rounding.

Capture order: verify (largest batch first), commit, extend, packed verify, then the draft graphs,
all in one memory pool. A packed round commits eagerly (on the packed layout's flat taps).
A graph-owned output may share memory with an intermediate of a graph captured earlier, so whatever
is read after another graph's replay lives in static buffers outside the pool: the draft tree and
logits (read by verify, the eager walk, the override), the verify logits and taps (read by sampling
and the commit). Verify's own outputs (tokens, accept result) are read before the next verify and
are only overwritten by graphs captured before them (whose replays never come between). All static
outputs are valid until the next replay: read them within the round.
"""

from __future__ import annotations

import bisect
import logging

import torch

from ddtree.engine.config import tree_spec
from ddtree.engine.graphs.buffers import CommitGraph, Padding, VerifyGraph
from ddtree.engine.graphs.draft import DraftGraph
from ddtree.engine.graphs.extend import ExtendGraphs
from ddtree.engine.graphs.packed import PackedVerifyGraph, packed_extras
from ddtree.speculative.tree import DraftTree

logger = logging.getLogger("ddtree")

CTX_BOUNDS = (1024, 4096, 16384)


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (and max_bs itself)."""
    out = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 8)) + [max_bs]
    return sorted(set(out))


def ctx_bounds(top: int) -> list[int]:
    return sorted({c for c in CTX_BOUNDS if c < top} | {top})


def make_graph_runner(runner) -> CudaGraphRunner | None:
    """The capturing graph runner, or None (with the reason logged once) when this setup must stay
    eager."""
    why = None
    if runner.device.type != "cuda":
        why = f"the device is {runner.device.type}"
    else:  # the backend says whether a kernel (capturable) or the reference runs the verify shape
        shape = VerifyGraph.shape_of(runner, 1, runner.cfg.max_verify_width, runner.cfg.max_context)
        plan = runner.backend.launch_plan(shape, runner.device, num_splits=1)
        if plan.kernel == "reference":
            why = f"the attention runs the torch reference ({plan.fallback})"
    if why:
        logger.info("CUDA graphs are off: %s; verify and draft run eagerly.", why)
        return None
    g = CudaGraphRunner(runner, capture=True)
    g.build()
    return g


def attach_uncaptured(engine, **kw) -> CudaGraphRunner:
    """The engine's graph path with capture off (CPU tests, bench dry runs, launch counts): a
    `CudaGraphRunner(capture=False, **kw)` on its runner, told the decoder's tree spec (as
    SpecDecoder does), built."""
    runner, spec = engine.runner, engine.spec
    runner.graphs = CudaGraphRunner(runner, capture=False, **kw)
    runner.set_tree_spec(spec.algorithm, spec.budget, spec.topk_cap, spec.shadow_linear)
    if engine.decoder.budgets.packing:  # as SpecDecoder enables it
        runner.graphs.enable_packing()
    runner.graphs.build()
    return runner.graphs


def capture_graph(fn, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, outputs) of fn() captured into `pool`, after two warm-up calls on a side stream
    (Triton compiles the variant, cuBLAS picks its kernels)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def _kernel_head_dim(d: int) -> bool:
    return d >= 16 and d & (d - 1) == 0


def _draft_capturable(runner) -> str | None:
    """Why the drafter block cannot be captured, or None."""
    d = runner.drafter
    if d is None:
        return "no drafter"
    # sliding-window layers run the kernel too (the window is masked in it): no refusal for them
    if not _kernel_head_dim(d.config.head_dim):
        return f"the drafter head dim {d.config.head_dim} runs the torch reference"
    return None


class GraphSet:
    """One family's forward at a fixed width: graphs keyed by (padded batch, plan key), chosen per
    (bs, ctx bucket). `forward(bs, backend, host_kv_lens)` runs on the family's static buffers and
    returns a tuple of tensors; `shape(bs, bound)` is its attention calls' shape. Host lengths are
    compared with the context buckets; a padded row's host length is `pad_len`. buckets: the
    family's padded batches (None: the owner's)."""

    def __init__(
        self, owner: CudaGraphRunner, forward, shape, top: int, pad_len: int, buckets=None
    ):
        self.owner, self.forward, self.shape, self.pad_len = owner, forward, shape, pad_len
        self.buckets = buckets or owner.buckets
        self.bounds = ctx_bounds(top)
        self.plans: dict[tuple[int, int], tuple] = {}  # (bs, bound) -> LaunchPlan.capture_key
        # (bs, key) -> (graph or None, outputs, backend)
        self.graphs: dict[tuple[int, tuple], tuple] = {}

    def build(self, buckets: list[int]) -> None:
        for bs in sorted(buckets, reverse=True):
            for bound in self.bounds:
                key = self.plans[(bs, bound)] = self.probe(bs, bound)
                if (bs, key) not in self.graphs:
                    self.graphs[(bs, key)] = self._capture(bs, key, bound)
                self.owner.tick()

    def probe(self, bs: int, bound: int) -> tuple:
        """The backend's launch plan for bs rows of length <= bound, as its capture key. One
        eager call first compiles the kernel variant whose resident-program count picks the split
        count."""
        backend = self.owner.runner.backend
        self.forward(bs, backend, [bound] * bs)
        return backend.launch_plan(self.shape(bs, bound), self.owner.runner.device).capture_key

    def _capture(self, bs: int, key: tuple, bound: int) -> tuple:
        backend = self.owner.runner.backend.with_splits(key[0])
        if not self.owner.capture:
            return None, None, backend
        host = [bound] * bs  # host lengths only size the grid, and the split count is fixed
        graph, out = capture_graph(lambda: self.forward(bs, backend, host), self.owner.pool)
        return graph, out, backend

    def fits(self, b: int, host_max: int) -> bool:
        return b <= self.buckets[-1] and host_max <= self.bounds[-1]

    def run(self, b: int, host_kv_lens: list[int]) -> tuple:
        """Replay (without capture: run) the graph for b live rows of host lengths
        `host_kv_lens`."""
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        bound = self.bounds[bisect.bisect_left(self.bounds, max(host_kv_lens))]
        graph, out, backend = self.graphs[(bs, self.plans[(bs, bound)])]
        # the same padded static-shape path; the reference reads the live host lengths
        if graph is None:
            return self.forward(bs, backend, host_kv_lens + [self.pad_len] * (bs - b))
        graph.replay()
        return out


class CudaGraphRunner:
    """The graph families for `ModelRunner.draft` / `verify` / `commit` and the prefill extend,
    and their graphs. A round (engine/round/data.py) replays all of its phases or none (`covers`); the
    commit replays on the rows its verify loaded. capture=False runs the same padded static-shape
    path eagerly (the CPU tests of everything but the capture itself)."""

    def __init__(self, runner, capture: bool = True, max_bs: int | None = None, extend_widths=None):
        """extend_widths: the extend graphs' widths (None: `RunnerConfig.extend_widths`)."""
        self.runner, self.capture = runner, capture
        cfg = runner.cfg
        max_bs = min(max_bs or cfg.cuda_graph_max_bs, cfg.max_running_requests)
        self.buckets = batch_buckets(max_bs)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        padding = self.padding = Padding(runner, max_bs)
        # one verify family per width (widest first: the narrower ones share its logits / taps)
        self.widths = sorted(set(cfg.verify_widths or (cfg.max_verify_width,)), reverse=True)
        self.verify_graph = v = VerifyGraph(runner, padding)
        self.verify_graphs = {
            w: v if w == v.n else VerifyGraph(runner, padding, w, share=v) for w in self.widths
        }
        self.verify_sets = {
            w: GraphSet(self, g.forward, g.attention_shape, cfg.max_context + g.n, g.n)
            for w, g in self.verify_graphs.items()
        }
        self.verify_set = self.verify_sets[v.n]
        # commit (KV move + drafter context write) on each width's verify buffers: graphs keyed
        # by padded batch only (hybrid targets: the state commit too; none at width 1, whose verify
        # steps the state in place)
        self.commit_families = {
            w: CommitGraph(g)
            for w, g in self.verify_graphs.items()
            if g.accept_depth is not None or g.hybrid
        }
        self.commit_graph = self.commit_families.get(v.n)
        self.commit_graphs: dict[tuple[int, int], object] = {}  # (width, bs) -> graph
        # the short prefill extends (engine/graphs/extend.py), None without extend widths
        widths = cfg.extend_widths if extend_widths is None else extend_widths
        self.extend: ExtendGraphs | None = None
        if widths:
            ext_bs = min(cfg.extend_max_bs, max_bs)
            self.extend = ExtendGraphs(self, padding, widths, ext_bs, GraphSet)

        # the packed verify (a batch-wide budget's round, engine/graphs/packed.py): a graph set
        # per (padded batch bs, rows T = bs + E), E in `packed_extras` (`enable_packing`)
        self.packed: PackedVerifyGraph | None = None
        self.packed_buckets: list[int] = []
        self.packed_sets: dict[tuple[int, int], GraphSet] = {}

        self.draft_graph: DraftGraph | None = None
        # tree spec -> fused drafter block + LM head + tree build
        self.draft_sets: dict[tuple, GraphSet] = {}
        self.tree_spec: tuple | None = None
        self.extra_specs: tuple[tuple, ...] = ()  # auto: the other rungs' specs
        self._built = False
        self._bar = None  # start-up progress while build() captures (a first start compiles)
        why_eager = _draft_capturable(runner)
        if why_eager is None:
            self.draft_graph = DraftGraph(runner, padding)
        elif runner.drafter is not None:
            logger.info("CUDA graphs: the drafter forward runs eagerly: %s.", why_eager)

    def pool_bytes(self) -> int:
        """Device bytes the graph pool holds: the captured graphs' intermediate activations (their
        static inputs and outputs are allocated outside it). 0 without capture."""
        if self.pool is None:
            return 0
        pool = tuple(self.pool)
        segments = torch.cuda.memory._snapshot()["segments"]
        return sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == pool)

    def bucket(self, b: int) -> int:
        """The padded batch of b live rows."""
        return self.buckets[bisect.bisect_left(self.buckets, b)]

    def tick(self) -> None:
        """One graph of build() done (the progress bar on stderr while capturing)."""
        if self._bar is not None:
            self._bar.update()

    @torch.inference_mode()
    def build(self) -> None:
        if self.capture:  # minutes on a fresh machine (every kernel variant compiles): show it
            from tqdm import tqdm

            self._bar = tqdm(desc="CUDA graphs", unit="graph", mininterval=2.0)
        try:
            self._build()
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def _build(self) -> None:
        for w in self.widths:
            self.verify_sets[w].build(self.buckets)
        for w, cg in self.commit_families.items():
            for bs in sorted(self.buckets, reverse=True):
                fn = lambda bs=bs, cg=cg: cg.forward(bs)  # noqa: E731
                graph = capture_graph(fn, self.pool)[0] if self.capture else None
                self.commit_graphs[(w, bs)] = graph
                self.tick()
        if self.extend is not None:
            try:
                self.extend.build()
            except RuntimeError as e:  # e.g. a GDN kernel that cannot be captured: stay eager
                # (tests/gpu/test_extend_graph_gpu.py fails on it; TP ranks must agree: raise)
                if not self.capture or torch.distributed.is_initialized():
                    raise
                logger.warning(
                    "CUDA graphs: the extend failed to capture (%s); prefill is eager.", e
                )
                self.extend = None
        self._built = True
        self._build_packed()
        if self.tree_spec is not None:
            self._draft_set(self.tree_spec)
            for spec in self.extra_specs:
                self._draft_set(spec)
        if self.capture:
            torch.cuda.synchronize()
            logger.info(
                "CUDA graphs captured: %d verify (batch sizes %s; verify widths %s, "
                "LM head + argmax%s inside).",
                sum(len(gs.graphs) for gs in self.verify_sets.values()),
                self.buckets,
                "/".join(str(w) for w in sorted(self.widths)),
                " + accept walk" if self.commit_graph else "",
            )

    @torch.inference_mode()
    def _draft_set(self, spec: tuple) -> GraphSet:
        """The draft graphs for a tree spec, built (captured) on first use."""
        d, top = self.draft_graph, self.runner.cfg.max_context
        gs = self.draft_sets.get(spec)
        if gs is None:
            d.add_tree(spec)
            gs = self.draft_sets[spec] = GraphSet(
                self,
                lambda bs, backend, host: d.tree_forward(spec, bs, backend, host),
                d.attention_shape,
                top,
                0,
            )
            gs.build(self.buckets)
            if self.capture:
                torch.cuda.synchronize()
                logger.info(
                    "CUDA graphs captured: %d draft (block %d -> LM head -> %s).",
                    len(gs.graphs),
                    d.S,
                    "chain"
                    if spec[0] == "DFLASH"
                    else f"tree B={spec[1]} top-k {spec[2]}{' shadow-linear' if spec[3] else ''}",
                )
        return gs

    def set_tree_spec(
        self, algorithm: str, budget: int, topk_cap: int, shadow_linear: bool
    ) -> None:
        """The decoder's tree: its draft graphs run drafter -> tree in one replay (captured here,
        once per spec)."""
        if self.draft_graph is None or algorithm not in ("DFLASH", "DDTREE"):
            return
        self.tree_spec = tree_spec(algorithm, budget, topk_cap, shadow_linear)
        if self._built:
            self._draft_set(self.tree_spec)

    def add_tree_specs(self, specs) -> None:
        """More tree specs a round may draft with (`--speculative-ddtree-budget auto`: one per
        rung, so a round builds at its own rung): captured now when the graphs are built, else
        with them; a spec not announced is captured on first use."""
        self.extra_specs = tuple(dict.fromkeys((*self.extra_specs, *specs)))
        if self._built and self.draft_graph is not None:
            for spec in specs:
                self._draft_set(spec)

    # ---- packed verify
    # ------------------------------------------------------------------------------------------
    def enable_packing(self) -> None:
        """Capture the packed verify's graphs (now when the graphs are built, else with them): a
        dense target's auto rounds may pack (`BudgetPlanner.enable_packing`)."""
        if self.packed is not None or self.verify_graph.hybrid:
            return
        pg = self.packed = PackedVerifyGraph(self.runner, self.padding, self.verify_graph)
        top = self.runner.cfg.max_context + pg.n
        # powers of two (and the largest batch): a padding request owns no rows, so a coarser
        # batch bucket costs only a few empty attention programs, and half the graphs
        self.packed_buckets = sorted(
            {min(1 << (b - 1).bit_length(), self.buckets[-1]) for b in self.buckets}
        )
        self._packed_rows = {
            bs: [bs + e for e in packed_extras(bs, pg.n)] for bs in self.packed_buckets
        }
        for bs, rows in self._packed_rows.items():
            for T in rows:
                fwd = lambda bs, backend, host, T=T: pg.forward(bs, T, backend, host)  # noqa: E731
                self.packed_sets[(bs, T)] = GraphSet(
                    self, fwd, pg.attention_shape, top, 0, buckets=[bs]
                )
        if self._built:
            self._build_packed()

    @torch.inference_mode()
    def _build_packed(self) -> None:
        try:
            for (bs, _), gs in sorted(self.packed_sets.items(), reverse=True):
                if not gs.graphs:
                    gs.build([bs])
        except RuntimeError as e:  # packed rounds then run eagerly (the planner rates them so)
            # (tests/gpu/test_budget_gpu.py fails on it; TP ranks must agree: raise)
            if not self.capture or torch.distributed.is_initialized():
                raise
            logger.warning("CUDA graphs: the packed verify failed to capture (%s); eager.", e)
            self.packed_sets.clear()
            return
        if self.capture and self.packed_sets:
            torch.cuda.synchronize()
            logger.info(
                "CUDA graphs captured: %d packed verify (%d row counts over batch sizes %s).",
                sum(len(gs.graphs) for gs in self.packed_sets.values()),
                len(self.packed_sets),
                self.packed_buckets,
            )

    def packed_rows(self, b: int) -> list[int]:
        """The row counts a packed verify of b requests replays (ascending): its padded batch's
        packed graphs'; [] when none is captured."""
        if b > self.buckets[-1] or not self.packed_sets:
            return []
        return self._packed_rows[self._packed_bucket(b)]

    def _packed_bucket(self, b: int) -> int:
        return self.packed_buckets[bisect.bisect_left(self.packed_buckets, b)]

    def verify_packed(self, rnd, lay, slots, host_q_lens, host_kv_lens):
        """One replay of the packed verify over `lay` (T = slots' rows, one of `packed_rows`):
        (greedy token of every row [T], taps [T, K*H] or None, final hidden rows [T, H]).
        host_q_lens: exact per-request lengths for a backend that reads them (None: bounds)."""
        pg, T = self.packed, slots.shape[0]
        b = pg.load(rnd, lay, slots)
        bs = self._packed_bucket(b)
        pg.host_q_lens = None if host_q_lens is None else host_q_lens + [0] * (bs - b)
        try:
            out = self.packed_sets[(bs, T)].run(b, host_kv_lens)
        finally:
            pg.host_q_lens = None  # this replay's only (a probe spreads its own rows)
        taps = pg.taps[:T] if pg.taps is not None else None
        return out[0][:T], taps, pg.hidden[:T]

    def covers(self, b: int, max_kv_len: int) -> bool:
        """A round of b requests whose longest has max_kv_len cached tokens replays the graphs."""
        return b <= self.buckets[-1] and max_kv_len <= self.runner.cfg.max_context

    # ---- verify
    # ------------------------------------------------------------------------------------------
    def verify(self, rnd, tree):
        """rnd: the Round (rows gathered after allocation); tree: n nodes, one of the captured
        widths. Returns (logits [b*n, V] in the LM head's dtype, taps [b*n, K*H] or None, greedy
        tokens [b, n], the greedy accept walk or None when the tree's depth bound is not the
        captured one)."""
        n = tree.num_nodes
        v = self.verify_graphs[n]
        b = v.load(rnd, tree)
        out = self.verify_sets[n].run(b, [k + v.n for k in rnd.kv_lens])
        return v.outputs(out, b, tree.depth_bound)

    def pad_rows(self) -> None:
        """Every verify and commit row back to the padding state: a replay then writes only the
        scratch pages and the state pool's scratch row (the budget profile replays outside any
        round, and a one-node verify steps its rows' GDN state in place)."""
        for fam in (*self.verify_graphs.values(), *self.commit_families.values()):
            fam.pad(0, fam.live)
            fam.live = 0

    # ---- commit
    # ------------------------------------------------------------------------------------------
    def commits(self, width: int) -> bool:
        """Whether a commit graph follows the verify of this width (none where the one-node verify
        of a dense target has nothing to commit in a graph)."""
        return width in self.commit_families

    def commit(self, width: int, path: torch.Tensor, accept_length: torch.Tensor) -> None:
        """`ModelRunner.commit_kv` on the rows the round's verify replay loaded (width: its
        width); padded rows commit nothing (their moves stay in the scratch pages)."""
        cg = self.commit_families[width]
        bs = self.bucket(cg.load(path, accept_length))
        graph = self.commit_graphs.get((width, bs))
        if graph is None:
            cg.forward(bs)
        else:
            graph.replay()

    # ---- draft
    # -------------------------------------------------------------------------------------------
    def draft_tree(
        self,
        rnd,
        depth_limits: list[int] | None,
        budgets: list[int] | None = None,
        spec: tuple | None = None,
    ) -> tuple[torch.Tensor, DraftTree]:
        """One replay from the round's roots to its tree. spec: the tree spec to build (None: the
        decoder's); depth_limits: per-request depth limits (None: all D); budgets: per-request
        DDTree budgets <= the spec's (None: all of it), cut inside the graph from the spec's
        best-first build. Returns (drafter logits [b, D, V], the tree at the spec's width)."""
        spec = spec or self.tree_spec
        gs = self._draft_set(spec)
        b = self.draft_graph.load(rnd, rnd.roots, depth_limits, budgets, spec)
        gs.run(b, list(rnd.kv_lens))
        return self.draft_graph.tree(spec, b)
