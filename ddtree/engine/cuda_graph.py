"""CUDA graphs for the two forwards of every round, the target verify (width n = max_verify_width) and the
drafter block (width S = block_size): padded batch buckets, graphs keyed by (padded batch, KV split count), their
capture into one memory pool, and the replay. The static buffers, their padding state and the forwards captured
here are `GraphBuffers` (ddtree/engine/graph_buffers.py).

KV splits. The Triton kernel is capturable because its launch shape depends only on host ints (batch, max
q_len, num_splits), so the split count is fixed per graph, and no single count is right for all contexts: the
count that fills the GPU at a long context (tens of splits for a small batch) makes a short-context round pay
for mostly-empty programs, their partial writes and the combine; one split leaves a long context to a few dozen
programs on 132 SMs. So the live max kv_len picks a bucket (<= 1k, 4k, 16k, max context) and each
(bs, bucket) uses the kernel's own choice (`choose_num_splits`) at the bucket's upper bound, probed with one
eager call. That choice depends on the context only through its cap (>= 4 KV tiles per split for decode rows,
>= 6 for tree / chain rows), so it grows with the bucket (never decreasing) and then saturates: graphs are
keyed by (bs, launch plan = split count and whether the Hopper kernel runs: the two paths choose their split
counts differently, so an equal count alone does not mean the same launches) and buckets with equal plans share
one. A live context gets its bucket top's count: never fewer splits than eager would pick, and the surplus is
bounded by the bucket's width (4x in the middle buckets).
An empty split (its tile range lies past the request's context) runs no loop iteration and stores lse = -inf;
the combine gives it weight 0. Every real or padded row sees at least itself in some split, so no row is
all -inf and the result equals the unsplit one up to rounding.

Capture order: verify (largest batch first), commit, then the draft graphs, all in one memory pool. A graph-owned
output may share memory with an intermediate of a graph captured earlier, so whatever is read after another
graph's replay lives in static buffers outside the pool: the draft tree and logits (read by verify, the eager
walk, the override), the verify logits and taps (read by sampling and the commit). Verify's own outputs (tokens,
accept result) are read before the next verify and are only overwritten by graphs captured before them (whose
replays never come between). All static outputs are valid until the next replay: read them within the round.
"""

from __future__ import annotations

import bisect
import logging

import torch

from ddtree.engine.graph_buffers import GraphBuffers

logger = logging.getLogger("ddtree")

CTX_BOUNDS = (1024, 4096, 16384)


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (and max_bs itself)."""
    out = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 8)) + [max_bs]
    return sorted(set(out))


def ctx_bounds(top: int) -> list[int]:
    return sorted({c for c in CTX_BOUNDS if c < top} | {top})


def make_graph_runner(runner) -> CudaGraphRunner | None:
    """The capturing graph runner, or None (with the reason logged once) when this setup must stay eager."""
    from ddtree.attention.triton_backend import TritonAttentionBackend

    why = None
    if runner.device.type != "cuda":
        why = f"the device is {runner.device.type}"
    elif not isinstance(runner.backend, TritonAttentionBackend):
        why = f"--attention-backend {runner.cfg.attention_backend} is not capturable (use triton)"
    elif runner.backend.force_reference:
        why = "the triton backend is forced to the torch reference"
    elif runner.state_pool is not None:
        why = "hybrid (Gated DeltaNet) targets are not captured yet"
    elif not _kernel_head_dim(runner.target.config.head_dim):
        why = f"the target head dim {runner.target.config.head_dim} runs the torch reference"
    if why:
        logger.info("CUDA graphs are off: %s; verify and draft run eagerly.", why)
        return None
    g = CudaGraphRunner(runner, capture=True)
    g.build()
    return g


def capture_graph(fn, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, outputs) of fn() captured into `pool`, after two warm-up calls on a side stream (Triton compiles
    the variant, cuBLAS picks its kernels)."""
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
    if any(d.config.layer_window(i) is not None for i in range(d.config.num_hidden_layers)):
        # sliding-window layers use the torch reference: a host loop over ctx_lens with per-request gathers
        # whose shapes are the live context lengths, baked in at capture
        return "the drafter has sliding-window layers (torch reference attention: data-dependent shapes)"
    if not _kernel_head_dim(d.config.head_dim):
        return f"the drafter head dim {d.config.head_dim} runs the torch reference"
    return None


class _GraphSet:
    """One forward at a fixed width: graphs keyed by (padded batch, launch plan), chosen per (bs, ctx bucket).
    `forward(bs, backend, host_kv_lens)` runs on the static buffers and returns a tuple of tensors; host lengths
    are compared with the context buckets, and a padded row's host length is `pad_len`."""

    def __init__(self, owner: CudaGraphRunner, forward, top: int, pad_len: int):
        self.owner, self.forward, self.pad_len = owner, forward, pad_len
        self.bounds = ctx_bounds(top)
        self.splits: dict[tuple[int, int], tuple | None] = {}  # (bs, bound) -> launch plan
        self.graphs: dict[tuple[int, tuple | None], tuple] = {}  # (bs, plan) -> (graph or None, outputs, backend)

    def build(self, buckets: list[int]) -> None:
        for bs in sorted(buckets, reverse=True):
            for bound in self.bounds:
                s = self.splits[(bs, bound)] = self._probe(bs, bound)
                if (bs, s) not in self.graphs:
                    self.graphs[(bs, s)] = self._capture(bs, s, bound)

    def _probe(self, bs: int, bound: int) -> tuple | None:
        """The kernel's own launch plan for bs rows of length <= bound: (split count, whether the Hopper kernel
        runs), None where the torch reference runs. Buckets share a graph only when both agree."""
        from ddtree.attention.triton_backend import TritonAttentionBackend
        from ddtree.kernels.tree_attention.tuning import last_launch

        backend = self.owner.backend(None)
        if not isinstance(backend, TritonAttentionBackend):
            return None
        last_launch.clear()
        self.forward(bs, backend, [bound] * bs)
        return last_launch.get("num_splits"), bool(last_launch.get("hopper"))

    def _capture(self, bs: int, plan: tuple | None, bound: int) -> tuple:
        backend = self.owner.backend(plan[0] if plan else None)
        if not self.owner.capture:
            return None, None, backend
        host = [bound] * bs  # host lengths only size the grid, and the split count is fixed
        graph, out = capture_graph(lambda: self.forward(bs, backend, host), self.owner.pool)
        return graph, out, backend

    def fits(self, b: int, host_max: int) -> bool:
        return b <= self.owner.buckets[-1] and host_max <= self.bounds[-1]

    def run(self, b: int, host_kv_lens: list[int]) -> tuple:
        """Replay (without capture: run) the graph for b live rows of host lengths `host_kv_lens`."""
        bs = self.owner.buckets[bisect.bisect_left(self.owner.buckets, b)]
        bound = self.bounds[bisect.bisect_left(self.bounds, max(host_kv_lens))]
        graph, out, backend = self.graphs[(bs, self.splits[(bs, bound)])]
        if graph is None:  # the same padded static-shape path; the reference reads the live host lengths
            return self.forward(bs, backend, host_kv_lens + [self.pad_len] * (bs - b))
        graph.replay()
        return out


class CudaGraphRunner(GraphBuffers):
    """Graphs over the static buffers (`GraphBuffers`) for `ModelRunner.verify` / `ModelRunner.draft`.
    capture=False runs the same padded static-shape path eagerly (the CPU tests of everything but the capture
    itself)."""

    def __init__(self, runner, capture: bool = True, max_bs: int | None = None):
        self.runner, self.capture = runner, capture
        cfg = runner.cfg
        max_bs = min(max_bs or cfg.cuda_graph_max_bs, cfg.max_running_requests)
        self.buckets = batch_buckets(max_bs)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._backends: dict = {}
        self._init_verify(max_bs)
        self.verify_set = _GraphSet(self, self._verify_forward, cfg.max_context + self.n, self.n)
        # commit (KV move + drafter context write) on the verify buffers: graphs keyed by padded batch only
        self.commit_graphs: dict[int, object] = {}

        self.draft_set = None  # the plain drafter block (hidden out), captured on first use
        self.draft_sets: dict[tuple, _GraphSet] = {}  # tree spec -> fused drafter block + LM head + tree build
        self.tree_bufs: dict[tuple, tuple] = {}  # tree spec -> static DraftTree fields [M, ...]
        self.tree_spec: tuple | None = None
        self._built = False
        why_eager = _draft_capturable(runner)
        self.drafts = why_eager is None
        if self.drafts:
            self._init_draft(max_bs)
        elif runner.drafter is not None:
            logger.info("CUDA graphs: the drafter forward runs eagerly: %s.", why_eager)

    def backend(self, splits: int | None):
        """An attention backend with a fixed split count (the runner's own backend when it is not Triton)."""
        from ddtree.attention.triton_backend import TritonAttentionBackend

        if not isinstance(self.runner.backend, TritonAttentionBackend):
            return self.runner.backend
        if splits not in self._backends:
            self._backends[splits] = TritonAttentionBackend(num_splits=splits)
        return self._backends[splits]

    @torch.inference_mode()
    def build(self) -> None:
        self.verify_set.build(self.buckets)
        if self.accept_depth is not None:
            for bs in sorted(self.buckets, reverse=True):
                self.commit_graphs[bs] = self._capture_plain(lambda bs=bs: self._commit_forward(bs))
        self._built = True
        if self.tree_spec is not None:
            self._draft_set(self.tree_spec)
        if self.capture:
            torch.cuda.synchronize()
            logger.info("CUDA graphs captured: %d verify (batch sizes %s; verify width %d, LM head + argmax%s "
                        "inside).", len(self.verify_set.graphs), self.buckets, self.n,
                        " + accept walk" if self.accept_depth else "")

    def _capture_plain(self, fn):
        """A graph of fn() (no outputs used), or None without capture."""
        return capture_graph(fn, self.pool)[0] if self.capture else None

    @torch.inference_mode()
    def _draft_set(self, spec: tuple | None) -> _GraphSet:
        """The draft graphs for a tree spec (None: the plain block), built (captured) on first use."""
        if spec is None:
            if self.draft_set is None:
                self.draft_set = _GraphSet(self, self._draft_forward, self.runner.cfg.max_context, 0)
                self.draft_set.build(self.buckets)
            return self.draft_set
        gs = self.draft_sets.get(spec)
        if gs is None:
            self._init_tree(spec)
            gs = self.draft_sets[spec] = _GraphSet(self, lambda bs, backend, host: self._draft_tree_forward(
                spec, bs, backend, host), self.runner.cfg.max_context, 0)
            gs.build(self.buckets)
            if self.capture:
                torch.cuda.synchronize()
                logger.info("CUDA graphs captured: %d draft (block %d -> LM head -> %s).", len(gs.graphs), self.S,
                            "chain" if spec[0] == "DFLASH" else f"tree B={spec[1]} top-k {spec[2]}"
                            f"{' shadow-linear' if spec[3] else ''}")
        return gs

    def set_tree_spec(self, algorithm: str, budget: int, topk_cap: int, shadow_linear: bool) -> None:
        """The decoder's tree: its draft graphs run drafter -> tree in one replay (captured here, once per spec)."""
        if not self.drafts or algorithm not in ("DFLASH", "DDTREE"):
            return
        spec = ("DFLASH", 0, 0, False) if algorithm == "DFLASH" else ("DDTREE", budget, topk_cap, shadow_linear)
        self.tree_spec = spec
        if self._built:
            self._draft_set(spec)
