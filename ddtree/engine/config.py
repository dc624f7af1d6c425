"""The engine's configuration, derived once from resolved `ServerArgs`, and the sizing functions
that the engine (`engine/setup.py`) and the memory plan (`ddtree check-config`) share, so the plan's
numbers are the engine's. Torch-free: planning from config.json alone stays fast.

Derivation: `spec_config(args)` -> `SpecConfig`; `plan_pools(args, device_bytes, weight_bytes,
device)` -> `PoolPlan` (static pool = device bytes x --mem-fraction-static, minus weights, verify
buffers and the CUDA graph pool, split between the hybrid state pool and the KV pool); `runner_config(args, pools)` ->
`RunnerConfig`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ddtree.models.tp_layout import shard_drafter, shard_target
from ddtree.models.weight_bytes import dtype_bytes

# defaults and choices that flags, plans and pools share: defined here once
DEFAULT_CUDA_GRAPH_MAX_BS = 16
MAMBA_STRATEGIES = ("no_buffer", "extra_buffer")
# no_buffer by measurement (BENCHMARKS.md, hybrid rounds): its rounds are the faster ones with the
# chunk-form tree kernel, and it keeps no per-node recurrent state
DEFAULT_MAMBA_STRATEGY = "no_buffer"

CPU_KV_BUDGET_BYTES = 2 << 30  # the CPU path is for tests and small models: cap its KV pool
MIN_PAGES = 2  # the engine always gets a KV pool, even one no request fits in (the plan warns then)


def cuda_available() -> bool:
    """Imports torch only when a GPU driver node exists, so CPU-only planning stays fast."""
    if not any(
        os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd")
    ):
        return False
    import torch

    return torch.cuda.is_available()


def stash_width(max_verify_width: int) -> int:
    """Nodes per request the hybrid state pool's stash holds: none when every verify is one node
    (NONE servers: one-node verifies step the state in place, no stash written, no commit), else
    the verify width."""
    return 0 if max_verify_width == 1 else max_verify_width


def verify_width(algorithm: str, block_size: int, budget: int) -> int:
    """Tree nodes one request verifies per round, root included. It sizes everything a verify
    touches: the KV slots reserved past kv_len, the verify rows and CUDA-graph width, the per-node
    recurrent states. DDTREE: budget + 1 (every tree, a smaller per-request budget's too, is padded
    to exactly that); DFLASH: the block (root + block - 1 chain); NONE: the root alone. The
    drafter's own block of block_size rows is a separate buffer (`verify_buffer_bytes`)."""
    if algorithm == "DDTREE":
        return budget + 1
    return block_size if algorithm == "DFLASH" else 1


# the graphed short extend (engine/graphs/extend.py): widths (new tokens per request and pass; a
# graphed forward's cost grows slowly with its tokens, so three widths waste little against an exact
# fit), batch buckets, and the most passes one prefill batch takes before it runs eagerly (an eager
# extend's fixed launch cost outweighs several graphed passes; docs/design-numbers.md)
EXTEND_WIDTHS = (64, 128, 256)
EXTEND_BATCHES = (1, 2, 4)
EXTEND_MAX_PASSES = 4


def extend_widths(longest: int) -> tuple[int, ...]:
    """The extend graphs' widths: EXTEND_WIDTHS up to the first that holds `longest` (the most new
    tokens a prefill step gives one request: the prefill chunk, at most the context)."""
    out = []
    for w in EXTEND_WIDTHS:
        out.append(w)
        if w >= longest:
            break
    return tuple(out)


def budget_ladder(cap: int) -> tuple[int, ...]:
    """Budgets `--speculative-ddtree-budget auto` picks from: 0 (AR), powers of two from 8 below
    the cap, and the cap; each is one verify width (1 + budget) with its own CUDA graphs and its
    own draft graphs (the tree is built at the rung, not at the cap). The DFLASH chain is a rung
    beside them (`SpecConfig.chain_rung`): at high load its width-S verify beats a tree's."""
    out = {0, cap}
    b = 8
    while b < cap:
        out.add(b)
        b *= 2
    return tuple(sorted(out))


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str = "NONE"  # NONE | DFLASH | DDTREE
    block_size: int = 16  # drafted block incl. the root; depth limit = block_size - 1 (1 for NONE)
    budget: int = 64  # DDTREE nodes per round, root excluded (0 unless DDTREE)
    topk_cap: int = 64
    shadow_linear: bool = False
    # --speculative-ddtree-budget auto: `budget` is the cap, the policy picks each round's width
    adaptive: bool = False

    @property
    def verify_width(self) -> int:
        return verify_width(self.algorithm, self.block_size, self.budget)

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """The widths a round may verify at (graphs are captured for each): the ladder's with
        auto, else the one width."""
        if not self.adaptive:
            return (self.verify_width,)
        widths = {1 + b for b in budget_ladder(self.budget)}
        if self.chain_rung:
            widths.add(1 + self.chain_rung)
        return tuple(sorted(widths))

    @property
    def chain_rung(self) -> int:
        """With auto: the DFLASH chain's drafts (block_size - 1) when the chain is one of the
        policy's rungs (it fits the cap's verify width), else 0."""
        D = self.block_size - 1
        return D if self.adaptive and 0 < D <= self.budget else 0

    def tree_spec(self, budget: int | None = None, chain: bool = False) -> tuple:
        """The draft graphs' key of a round's tree: the DFLASH chain, or the DDTree build at
        `budget` (None: the server's)."""
        if chain or self.algorithm == "DFLASH":
            return tree_spec("DFLASH", 0, 0, False)
        b = self.budget if budget is None else budget
        return tree_spec(self.algorithm, b, self.topk_cap, self.shadow_linear)


def tree_spec(algorithm: str, budget: int, topk_cap: int, shadow_linear: bool) -> tuple:
    """(algorithm, budget, top-k cap, shadow-linear): one family of draft graphs. The cap is
    clamped to the budget (the build's K = min(cap, budget)): an auto rung of budget b and the
    fixed B=b server share one key."""
    if algorithm == "DFLASH":
        return ("DFLASH", 0, 0, False)
    return ("DDTREE", budget, min(topk_cap, budget), shadow_linear)


@dataclass(frozen=True)
class RunnerConfig:
    page_size: int = 16
    num_pages: int = 1024
    max_running_requests: int = 16
    max_context: int = 4096
    block_size: int = 16  # drafted block incl. the root; depth limit = block_size - 1
    max_verify_width: int = 65  # most tree nodes (root included) one request verifies at once
    verify_widths: tuple[int, ...] = ()  # widths with verify graphs (empty: max_verify_width)
    attention_backend: str = "torch"
    mamba_strategy: str = DEFAULT_MAMBA_STRATEGY
    mamba_ssm_dtype: str = "float32"
    enable_cuda_graph: bool = (
        False  # graphs for verify and draft (CUDA, triton backend, dense target)
    )
    cuda_graph_max_bs: int = (
        DEFAULT_CUDA_GRAPH_MAX_BS  # largest padded batch captured; bigger ones run eagerly
    )
    prefix_cache: bool = (
        False  # radix cache over full KV pages (--disable-radix-cache turns it off)
    )
    state_checkpoints: int = 0  # hybrid: recurrent-state checkpoint rows for cached prefixes
    # graphed short extends (with CUDA graphs; empty: every prefill eager)
    extend_widths: tuple[int, ...] = ()
    extend_max_bs: int = EXTEND_BATCHES[-1]  # largest extend batch bucket (<= cuda_graph_max_bs)


def spec_config(args) -> SpecConfig:
    """The speculative settings of resolved ServerArgs (resolution has filled every default it
    needs)."""
    algo = args.speculative_algorithm
    if algo == "NONE":
        return SpecConfig(algorithm="NONE", block_size=1, budget=0, topk_cap=0)
    ddtree = algo == "DDTREE"
    adaptive = ddtree and args.speculative_ddtree_budget == "auto"
    budget = args.speculative_ddtree_max_budget if adaptive else args.speculative_ddtree_budget
    return SpecConfig(
        algorithm=algo,
        block_size=args.speculative_dflash_block_size,
        budget=budget if ddtree else 0,
        adaptive=adaptive,
        topk_cap=args.speculative_ddtree_topk_cap if ddtree else 0,
        shadow_linear=ddtree and args.speculative_ddtree_shadow_linear,
    )


def prefill_chunk_tokens(args) -> int:
    """Prompt tokens one prefill step takes: --chunked-prefill-size, or a whole context when it is
    -1."""
    return args.context_length if args.chunked_prefill_size == -1 else args.chunked_prefill_size


def longest_prefill(args) -> int:
    """The most new tokens one prefill step gives a request (the scheduler's prefill budget)."""
    caps = (prefill_chunk_tokens(args), args.max_prefill_tokens, args.context_length)
    return min(c for c in caps if c is not None and c > 0)


def graphs_enabled(args, device: str) -> bool:
    return device == "cuda" and not args.disable_cuda_graph


def graph_max_bs(args) -> int:
    """The largest batch the CUDA graphs are captured at (the runner's rule, against the requested
    concurrency: the plan's cap on it only lowers the capture)."""
    return min(args.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, args.max_running_requests)


# ---- sizing shared by the engine and the memory plan
# ---------------------------------------------------
def kv_bytes_per_token(t, d, dtype) -> tuple[int, int]:
    """(target, drafter) K+V bytes per cached token. The drafter's context K/V of every layer
    (sliding ones included) sits at the target's token slots."""
    n = dtype_bytes(dtype)
    target = 2 * len(t.attention_layer_ids) * t.num_key_value_heads * t.head_dim * n
    drafter = (
        2 * d.num_hidden_layers * d.num_key_value_heads * d.head_dim * n if d is not None else 0
    )
    return target, drafter


def scratch_pages(width: int, page_size: int) -> int:
    """Pages past the block manager's range that padded CUDA-graph rows write into (one verify
    width)."""
    return -(-width // page_size)


def pages_per_request(max_context: int, width: int, page_size: int) -> int:
    """Block-table row length: a request at max context plus one verify width, and one page of
    slack."""
    return -(-(max_context + width) // page_size) + 1


def verify_buffer_bytes(t, d, width: int, block_size: int, act_dtype) -> int:
    """Per-request verify workspace: fp32 verify logits, fp32 draft logits and the tapped hidden
    states."""
    n = width * t.vocab_size * 4
    if d is not None:
        n += block_size * t.vocab_size * 4 + width * len(
            d.target_layer_ids
        ) * t.hidden_size * dtype_bytes(act_dtype)
    return n


# The CUDA graph pool (`CudaGraphRunner.pool_bytes`): every verify, draft, commit and extend graph
# allocates its intermediates from one shared pool, so it holds about the largest graph's peak plus a
# part the graphs do not share. Fit to the pool measured on an H100 (8B shape, bf16, block 16;
# docs/design-numbers.md): NONE at batch 256 is the extend graphs' peak (4 x 256 rows, ~48 x H bytes
# of activations a row; its 256 verify rows are less), DFLASH grows with the draft graph's LM-head
# logits (batch x block rows x V, ~2.8 B an element: the bf16 logits and temporaries), wide
# auto trees with the verify rows. The drafter's graphs keep ~450 MiB that DFLASH at batch 64 and 256
# agree on. Rounded up, the plan sits 3-25% over every measured pool.
GRAPH_POOL_FIXED_BYTES = 32 << 20
DRAFT_GRAPH_FIXED_BYTES = 448 << 20
DRAFT_LOGIT_BYTES = 3  # per draft row and vocabulary entry, at a 2-byte activation dtype
ROW_ACTIVATION_BYTES = 48  # per verify / extend row and hidden unit, at a 2-byte activation dtype
# rows x vocabulary entries of one LM-head chunk of a packed verify (engine/graphs/packed.py: its
# logits are never all in memory, only each row's argmax is kept); a packed verify graph (auto on
# a dense target) holds one chunk of 2-byte logits beside the widest verify's activations
LOGIT_CHUNK_ELEMS = 1 << 25
PACKED_CHUNK_BYTES = LOGIT_CHUNK_ELEMS * 2


def graph_pool_bytes(t, d, spec, max_bs: int, dtype, extend_tokens: int = 0) -> int:
    """The planned CUDA graph pool with graphs captured up to batch `max_bs`: the fixed parts plus
    the largest of the draft graph's logits (max_bs x block_size rows, none without a drafter), the
    widest verify (max_bs x the largest verify width rows; with packed graphs one LM-head chunk
    more, and their static hidden rows beside the pool) and the largest extend graph
    (`extend_tokens` rows); scaled by the activation dtype (fp32 serving doubles it)."""
    scale = dtype_bytes(dtype) / 2
    draft = max_bs * spec.block_size * t.vocab_size * DRAFT_LOGIT_BYTES if d is not None else 0
    rows = max_bs * max(spec.verify_widths)
    verify = rows * ROW_ACTIVATION_BYTES * t.hidden_size
    fixed = GRAPH_POOL_FIXED_BYTES + (DRAFT_GRAPH_FIXED_BYTES if d is not None else 0)
    if spec.adaptive and spec.algorithm == "DDTREE" and not t.is_hybrid:  # packed graphs too
        verify += PACKED_CHUNK_BYTES
        fixed += rows * t.hidden_size * dtype_bytes(dtype)  # their static hidden rows
    extend = extend_tokens * ROW_ACTIVATION_BYTES * t.hidden_size
    return int(fixed + scale * max(draft, verify, extend))


def planned_graph_bytes(args, device: str) -> int:
    """The memory plan's CUDA graph line for resolved ServerArgs (0 where no graph is captured)."""
    if not graphs_enabled(args, device):
        return 0
    max_bs = graph_max_bs(args)
    extend = min(EXTEND_BATCHES[-1], max_bs) * extend_widths(longest_prefill(args))[-1]
    t, d = args.target_config, args.drafter_config
    return graph_pool_bytes(t, d, args.spec, max_bs, args.dtype, extend)


@dataclass(frozen=True)
class GDNGeometry:
    num_layers: int
    hk: int
    dk: int
    hv: int
    dv: int
    kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    @classmethod
    def from_config(cls, cfg) -> "GDNGeometry":
        return cls(
            len(cfg.linear_layer_ids),
            cfg.linear_num_key_heads,
            cfg.linear_key_head_dim,
            cfg.linear_num_value_heads,
            cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim,
        )

    def state_parts(self, ssm_dtype, dtype) -> tuple[int, int]:
        """(conv window, delta-rule state) bytes of one request over all GDN layers. The conv window
        keeps the activation dtype and the SSM state --mamba-ssm-dtype, as in SGLang's Mamba pool.
        """
        conv = self.num_layers * self.conv_dim * max(self.kernel - 1, 0) * dtype_bytes(dtype)
        return conv, self.num_layers * self.hv * self.dk * self.dv * dtype_bytes(ssm_dtype)

    def state_bytes(self, ssm_dtype, dtype) -> int:
        """Persistent conv window + SSM state of one request over all GDN layers."""
        return sum(self.state_parts(ssm_dtype, dtype))

    def stash_bytes(self, width: int, strategy: str, ssm_dtype, dtype) -> int:
        """Per-node tree-verify stash of one request over all GDN layers (`width` nodes, none
        where `stash_width` says so): extra_buffer keeps a full state per node, no_buffer the
        node's GDN inputs (pre/post-conv q|k|v, fp32 gate, beta)."""
        width = stash_width(width)
        if strategy == "extra_buffer":
            per_node = self.state_bytes(ssm_dtype, dtype) // self.num_layers
        else:
            per_node = 2 * self.conv_dim * dtype_bytes(dtype) + self.hv * (4 + dtype_bytes(dtype))
        return self.num_layers * width * per_node


@dataclass(frozen=True)
class PoolPlan:
    """How the static pool is spent, per device. `num_pages` and `state_rows` are what the engine
    allocates."""

    static_bytes: int  # device bytes x --mem-fraction-static
    weight_bytes: int
    width: int  # verify width
    workspace_bytes: int  # verify buffers for max_running_requests
    kv_bytes_per_token: int
    state_bytes_per_request: int  # persistent conv + SSM state (0 for dense targets)
    spec_state_bytes_per_request: int  # tree-verify stash
    state_room_bytes: int  # what the static pool sets aside for recurrent state
    state_rows: int | None  # requests the state pool holds, its scratch row aside (None: dense)
    kv_room_bytes: int  # what the static pool leaves for KV
    kv_tokens: int  # KV slots handed out (= num_pages x page_size)
    num_pages: int
    max_running_requests: int  # --max-running-requests, capped at state_rows
    warnings: tuple[str, ...] = ()
    # the tensors the engine allocates (the KV pools with their scratch pages, the state pool's
    # rows with the scratch row, the checkpoints): what check-config prints and the server logs
    kv_pool_bytes: int = 0
    state_pool_bytes: int = 0
    kv_limit: str = "memory"  # what stops the KV pool where it is (check-config says it)
    # hybrid + prefix cache: recurrent-state checkpoints in the state pool's rows the running
    # requests leave (at most one per KV page)
    checkpoint_rows: int = 0
    checkpoint_bytes: int = 0
    # the warning that weights + verify buffers (+ CUDA graphs) fill the static pool
    overcommit: str | None = None
    graph_bytes: int = 0  # the CUDA graph pool at the largest captured batch (0: no graphs)

    def refusal(self) -> str | None:
        """Why no engine can start on this plan (one line naming the flags that fix it), or None:
        the weights, the verify buffers and the CUDA graphs exceed the static pool (the KV pool
        would get nothing, and the first capture or round runs out of memory), or the
        recurrent-state pool holds no request."""
        if self.weight_bytes + self.workspace_bytes + self.graph_bytes > self.static_bytes:
            return self.overcommit
        if self.max_running_requests < 1:
            return (
                f"the recurrent-state pool holds no request ({self.state_room_bytes} bytes); "
                "raise --mem-fraction-static or --mamba-full-memory-ratio, or lower "
                "--speculative-ddtree-budget"
            )
        return None


def device_memory_bytes(device: str = "auto") -> tuple[int, str]:
    """(bytes, name) of GPU 0, or of host RAM on the CPU."""
    if device != "cpu" and cuda_available():
        import torch

        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def rank_device_bytes(device_bytes: int, device: str, tp: int) -> int:
    """A rank's memory: its own GPU's, or on the CPU its share of the host RAM that every rank's
    process allocates from."""
    return device_bytes // tp if device == "cpu" else device_bytes


def plan_pools(args, device_bytes: int, weight_bytes: int, device: str) -> PoolPlan:
    """The pools of resolved ServerArgs on a device of `device_bytes` holding `weight_bytes` of
    weights (per device: under --tp-size one rank's shard; on the CPU the ranks share the host's
    RAM, so a rank plans against its 1/tp of it, `rank_device_bytes`). The KV pool gets what the
    state pool leaves, at most what max_running_requests requests at full context use (and
    CPU_KV_BUDGET_BYTES on the CPU, shared by the ranks); --max-total-tokens caps it. KV and state
    are those of one rank's local heads (`tp_layout.shard_target`: replicated KV heads count on
    every rank)."""
    t, d, tp = args.target_config, args.drafter_config, args.tp_size
    device_bytes = rank_device_bytes(device_bytes, device, tp)
    t_rank = shard_target(t, tp)
    d_rank = None if d is None else shard_drafter(d, tp)
    spec = args.spec
    width, n_req = spec.verify_width, args.max_running_requests
    static = int(device_bytes * args.mem_fraction_static)
    workspace = n_req * verify_buffer_bytes(t, d, width, spec.block_size, args.dtype)
    graphs = planned_graph_bytes(args, device)
    rest = static - weight_bytes - workspace - graphs
    warnings = []
    overcommit = None
    if rest <= 0:
        shared = (
            f" (on the CPU the {tp} ranks share the host's RAM: each plans with 1/{tp} of it; "
            "a smaller --tp-size leaves each more)"
            if device == "cpu" and tp > 1
            else ""
        )
        held = f"weights ({_gib(weight_bytes)}) and verify buffers ({_gib(workspace)})"
        lower = "--max-running-requests"
        if graphs:  # (only on a GPU: `shared` is empty)
            held = (
                f"weights ({_gib(weight_bytes)}), verify buffers ({_gib(workspace)}) and CUDA "
                f"graphs ({_gib(graphs)})"
            )
            lower += " or --cuda-graph-max-bs, pass --disable-cuda-graph"
        overcommit = (
            f"{held} exceed the static pool ({_gib(static)}){shared}; raise "
            f"--mem-fraction-static, lower {lower} or use a device with more memory"
        )
        warnings.append(overcommit)
    rest = max(rest, 0)
    state = spec_state = state_pool = 0
    rows = None
    if t.is_hybrid:
        geo = GDNGeometry.from_config(t_rank)
        state = geo.state_bytes(args.mamba_ssm_dtype, args.dtype)
        # the runner keeps a stash of `width` nodes (1 without speculation: the AR round's root)
        strategy = args.mamba_scheduler_strategy
        spec_state = geo.stash_bytes(width, strategy, args.mamba_ssm_dtype, args.dtype)
        per_request = state + spec_state
        r = args.mamba_full_memory_ratio
        pinned = args.max_mamba_cache_size
        # one row more than the requests': the scratch row padded CUDA-graph rows write; a pinned
        # pool also holds its requests' prefix-cache checkpoints (`_leave_checkpoint_rows`)
        keep = 0 if args.disable_radix_cache else state
        state_pool = (
            min((pinned + 1) * per_request + pinned * keep, rest)
            if pinned
            else int(rest * r / (1 + r))
        )
        rows = max(state_pool // per_request - 1, 0)
        if pinned:
            rows = min(rows, pinned)
        if rows < n_req:
            warnings.append(
                f"the state pool holds {rows} requests < --max-running-requests {n_req}; "
                "concurrency is capped there (raise --mamba-full-memory-ratio, lower "
                "--speculative-ddtree-budget or --max-running-requests, or use --mamba-ssm-dtype "
                "bfloat16)"
            )
    running = n_req if rows is None else max(min(n_req, rows), 0)
    cache_state = rows is not None and not args.disable_radix_cache and state > 0
    if cache_state:
        running, floor_warning = _leave_checkpoint_rows(running, state_pool, state, spec_state)
        warnings += floor_warning
    kv_room = rest - state_pool
    per_token = sum(kv_bytes_per_token(t_rank, d_rank, args.kv_cache_dtype))
    budget, limit = kv_room, "memory"
    if device == "cpu" and CPU_KV_BUDGET_BYTES // tp < kv_room:
        budget, limit = CPU_KV_BUDGET_BYTES // tp, f"the CPU's {_gib(CPU_KV_BUDGET_BYTES)} KV cap"
    # the scratch pages (padded CUDA-graph rows' KV writes) come out of the same bytes
    scratch = scratch_pages(width, args.page_size)
    pages = budget // per_token // args.page_size - scratch
    # each running request at full context plus one verify width, in whole pages: rounding the
    # sum down left a lone request at the context's end one page short of its last round (it was
    # preempted, could not be readmitted, and finished early with 'length')
    want = running * -(-(args.context_length + width) // args.page_size)
    if want < pages:
        pages, limit = want, f"{running} running requests at --context-length"
    if args.max_total_tokens is not None:  # the user's cap, rounded up to whole pages
        cap = -(-args.max_total_tokens // args.page_size)
        if cap < pages:
            pages, limit = cap, "--max-total-tokens"
    if pages < MIN_PAGES:
        pages, limit = MIN_PAGES, "the engine's minimum"
    ck_rows = 0
    if cache_state:
        # the rows left after the running requests' and the scratch row's
        ck_rows = max(min((state_pool - (running + 1) * (state + spec_state)) // state, pages), 0)
    state_alloc = 0 if rows is None else (running + 1) * (state + spec_state) + ck_rows * state
    return PoolPlan(
        static_bytes=static,
        weight_bytes=weight_bytes,
        width=width,
        workspace_bytes=workspace,
        kv_bytes_per_token=per_token,
        state_bytes_per_request=state,
        spec_state_bytes_per_request=spec_state,
        state_room_bytes=state_pool,
        state_rows=rows,
        kv_room_bytes=kv_room,
        kv_tokens=pages * args.page_size,
        num_pages=pages,
        max_running_requests=running,
        warnings=tuple(warnings),
        overcommit=overcommit,
        graph_bytes=graphs,
        checkpoint_rows=ck_rows,
        checkpoint_bytes=ck_rows * state,
        kv_pool_bytes=(pages + scratch) * args.page_size * per_token,
        state_pool_bytes=state_alloc,
        kv_limit=limit,
    )


def _leave_checkpoint_rows(
    running: int, state_pool: int, state: int, spec_state: int
) -> tuple[int, list[str]]:
    """Running requests a hybrid state pool holds while it keeps one recurrent-state checkpoint
    per running request for the prefix cache, and the warning when that caps them.

    A hybrid prefix hit needs a checkpoint at its end, and checkpoints live in the state pool
    beside the running requests' rows. Giving the running requests every row they can take left
    the checkpoints only the pool's remainder, often less than one row where the pool is short:
    under `auto` (a stash of max budget + 1 nodes per request, 4x DFLASH's) the 27B hybrid on one
    80 GiB GPU, where prompts repeated in turn then never found theirs (issue 54) while DFLASH's at
    the same memory did. One checkpoint per running request lets each leave its prefix behind (a
    conversation's next turn, a repeated prompt); SGLang keeps two per running request
    (MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO = 3 slots each)."""
    per_request = state + spec_state
    if state_pool - (running + 1) * per_request >= running * state:
        return running, []
    # (r + 1) x per_request (r requests and the scratch row) + r x state <= state_pool; one
    # request runs even without room for its checkpoint (the startup log then says none can hit)
    capped = min(running, max((state_pool - per_request) // (per_request + state), 1))
    if capped >= running:
        return running, []
    return capped, [
        f"the prefix cache keeps a recurrent-state checkpoint per running request: the state "
        f"pool holds {capped} requests with theirs (not {running}); concurrency is capped there "
        "(--disable-radix-cache gives every row to running requests, with no hybrid prefix "
        "hits; or raise --mamba-full-memory-ratio, lower --speculative-ddtree-max-budget / "
        "--speculative-ddtree-budget, or use --mamba-ssm-dtype bfloat16)"
    ]


def runner_config(args, pools: PoolPlan, device: str) -> RunnerConfig:
    spec = args.spec
    graphs = graphs_enabled(args, device)
    return RunnerConfig(
        page_size=args.page_size,
        num_pages=pools.num_pages,
        max_running_requests=pools.max_running_requests,
        max_context=args.context_length,
        block_size=spec.block_size,
        max_verify_width=spec.verify_width,
        verify_widths=spec.verify_widths,
        attention_backend=args.attention_backend,
        mamba_strategy=args.mamba_scheduler_strategy or DEFAULT_MAMBA_STRATEGY,
        mamba_ssm_dtype=args.mamba_ssm_dtype,
        enable_cuda_graph=graphs,
        cuda_graph_max_bs=args.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS,
        prefix_cache=not args.disable_radix_cache,
        state_checkpoints=pools.checkpoint_rows,
        extend_widths=extend_widths(longest_prefill(args)) if graphs else (),
    )
