"""Static memory plan from config.json geometry alone: weights, KV per token, per-request buffers and state.

The pools come from `ddtree.engine.config.plan_pools`, the function the engine sizes itself with; the
parameter counts from `ddtree.models.configs`, beside the configs they read. Per-device numbers are one
tensor-parallel rank's: the geometry `ddtree.models.tp_layout` gives a rank (the one the loader builds), so
replicated KV heads, norms, the padded vocab shard and the drafter's fc count in full on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ddtree.config.args import ServerArgs
from ddtree.config.resolve import resolve_server_args
from ddtree.engine.config import (
    GDNGeometry,
    device_memory_bytes,
    graph_max_bs,
    kv_bytes_per_token,
    plan_pools,
)
from ddtree.models.checkpoint import Fp8Layout
from ddtree.models.configs import (
    DrafterConfig,
    TargetConfig,
    drafter_param_count,
    target_param_count,
)
from ddtree.models.weight_bytes import (
    DTYPE_BYTES,
    rank_weight_bytes,
    served_fp8,
    weight_bytes,
)

__all__ = [
    "DTYPE_BYTES",
    "MemoryPlan",
    "memory_plan",
    "rank_weight_bytes",
    "recurrent_state_bytes",
    "served_fp8",
]


def target_kv_bytes_per_token(t: TargetConfig, dtype_bytes: int) -> int:
    return kv_bytes_per_token(t, None, dtype_bytes)[0]


def drafter_kv_bytes_per_token(d: DrafterConfig, dtype_bytes: int) -> int:
    """Context K/V of every drafter layer sits at the target's token slots (sliding layers included)."""
    return 2 * d.num_hidden_layers * d.num_key_value_heads * d.head_dim * dtype_bytes


def recurrent_state_bytes(t: TargetConfig, act_bytes: int, ssm_bytes: int) -> tuple[int, int]:
    """(conv window, delta-rule state) bytes of one request over all GDN layers."""
    return GDNGeometry.from_config(t).state_parts(ssm_bytes, act_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    device_name: str
    device_bytes: int
    static_bytes: int  # device_bytes * mem_fraction_static
    tp_size: int
    target_params: int
    drafter_params: int
    target_weight_bytes: int  # whole model, all ranks
    drafter_weight_bytes: int
    weight_bytes_per_device: int
    target_kv_bytes_per_token: int  # whole model (per device: kv_bytes_per_token_per_device)
    drafter_kv_bytes_per_token: int
    kv_bytes_per_token_per_device: int
    verify_width: int
    verify_buffer_bytes_per_request: int  # fp32 verify + draft logits, tapped hidden states
    max_running_requests: int
    workspace_bytes: int  # verify buffers for max_running_requests
    state_bytes_per_request: int  # persistent conv + SSM state, per device (0 for dense targets)
    spec_state_bytes_per_request: int  # extra_buffer per-node intermediate states, per device
    state_pool_bytes: int
    state_pool_requests: int | None  # None for dense targets
    kv_pool_bytes: int  # the KV tensors the engine allocates (target + drafter, scratch pages)
    kv_tokens: int  # = num_pages x page_size: what the engine hands out
    num_pages: int
    context_length: int
    requests_at_context: int
    warnings: tuple[str, ...] = ()
    state_checkpoints: int = 0  # hybrid prefix cache: recurrent-state checkpoint rows
    running_requests: int = 0  # what the pools hold (hybrid: beside their checkpoints)
    checkpoint_bytes: int = 0
    prefix_cache: bool = True
    shared_by_ranks: bool = False  # CPU tensor parallelism: the ranks split the host's RAM
    target_fp8: str = ""  # "": the model dtype; else how the FP8 layout stands
    drafter_fp8: str = ""
    kv_room_bytes: int = 0  # what the static pool left for KV
    state_room_bytes: int = 0  # what the static pool set aside for recurrent state
    kv_limit: str = "memory"  # what stops the KV pool where it is
    graph_bytes: int = 0  # the CUDA graph pool at the largest captured batch (0: no graphs)
    graph_max_bs: int = 0  # that batch (0: no graphs)
    graphs_off: str = ""  # why none are captured on a GPU ("": captured, or the CPU)

    @property
    def fits(self) -> bool:
        return self.kv_tokens > 0 and self.requests_at_context > 0

    def _kv_why(self) -> str:
        if self.kv_limit == "memory":
            return ""
        return f" (held by {self.kv_limit}; {_gib(self.kv_room_bytes)} free for KV)"

    def format(self) -> str:
        static = f"static pool {_gib(self.static_bytes)}"
        if self.shared_by_ranks:
            static += f" per rank (the {self.tp_size} ranks share it: 1/{self.tp_size} each)"
        rows = [
            ("device", f"{self.device_name}: {_gib(self.device_bytes)}, {static}"),
            (
                "target weights",
                f"{self.target_params / 1e9:.2f} B params, {self.target_weight_bytes / 1e9:.2f} GB"
                + (f" ({self.target_fp8})" if self.target_fp8 else ""),
            ),
            (
                "drafter weights",
                f"{self.drafter_params / 1e9:.2f} B params, {self.drafter_weight_bytes / 1e9:.2f} GB"
                + (f" ({self.drafter_fp8})" if self.drafter_fp8 else ""),
            ),
            ("weights per device", f"{_gib(self.weight_bytes_per_device)} (tp {self.tp_size})"),
            (
                "KV per token",
                f"target {_kib(self.target_kv_bytes_per_token)} + drafter "
                f"{_kib(self.drafter_kv_bytes_per_token)}; per device "
                f"{_kib(self.kv_bytes_per_token_per_device)}",
            ),
            (
                "verify buffers",
                f"width {self.verify_width}: {_gib(self.verify_buffer_bytes_per_request)}/request x "
                f"{self.max_running_requests} = {_gib(self.workspace_bytes)}",
            ),
        ]
        if self.graph_bytes:
            rows.append(
                ("CUDA graphs", f"pool at batch {self.graph_max_bs}: {_gib(self.graph_bytes)}")
            )
        elif self.graphs_off:
            rows.append(("CUDA graphs", f"none ({self.graphs_off})"))
        if self.state_pool_requests is not None:
            rows += [
                (
                    "recurrent state",
                    f"{_gib(self.state_bytes_per_request)}/request + speculative "
                    f"{_gib(self.spec_state_bytes_per_request)}/request",
                ),
                (
                    "state pool",
                    f"{_gib(self.state_pool_bytes)} -> {self.state_pool_requests} requests"
                    + (
                        f" ({self.running_requests} running beside their checkpoints)"
                        if self.prefix_cache and self.running_requests < self.state_pool_requests
                        else ""
                    )
                    + " (+ the scratch row and the checkpoints)",
                ),
                (
                    "state checkpoints",
                    f"{self.state_checkpoints} (prefix cache: a hybrid hit ends at one; at "
                    f"least one per running request) = {_gib(self.checkpoint_bytes)}"
                    if self.prefix_cache
                    else "none (--disable-radix-cache)",
                ),
            ]
        rows += [
            ("KV pool", f"{_gib(self.kv_pool_bytes)} -> {self.kv_tokens:,} tokens{self._kv_why()}"),
            ("requests at context", f"{self.requests_at_context} x {self.context_length:,} tokens"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = ["memory plan:"] + [f"  {k:<{width}}  {v}" for k, v in rows]
        return "\n".join(lines + [f"  warning: {w}" for w in self.warnings])


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def no_buffer_hint(args: ServerArgs, device_bytes: int, weights: int, pools, at_ctx: int):
    """A hybrid target under extra_buffer keeps a recurrent state per tree node; when that starves
    the pools (fewer requests than --max-running-requests, or not one at the context length) and
    no_buffer would serve more, the line that says so with both plans' numbers, else None."""
    t = args.target_config
    if not (t.is_hybrid and args.mamba_scheduler_strategy == "extra_buffer"):
        return None
    if pools.max_running_requests >= args.max_running_requests and at_ctx > 0:
        return None
    alt_args = dataclasses.replace(args, mamba_scheduler_strategy="no_buffer")
    alt = plan_pools(alt_args, device_bytes, weights, args.device)
    alt_at_ctx = min(alt.kv_tokens // args.context_length, alt.state_rows)
    if (alt.max_running_requests, alt_at_ctx, alt.kv_tokens) <= (
        pools.max_running_requests,
        at_ctx,
        pools.kv_tokens,
    ):
        return None
    return (
        f"--mamba-scheduler-strategy extra_buffer keeps a recurrent state for every tree node: "
        f"{_gib(pools.spec_state_bytes_per_request)} per request at verify width {pools.width}, "
        f"so the state pool holds {pools.state_rows} requests and the KV pool "
        f"{pools.kv_tokens:,} tokens ({at_ctx} requests at context); "
        "--mamba-scheduler-strategy no_buffer (replays the accepted path instead) needs "
        f"{_gib(alt.spec_state_bytes_per_request)} per request: {alt.state_rows} requests, "
        f"{alt.kv_tokens:,} KV tokens ({alt_at_ctx} requests at context)"
    )


def memory_plan(args: ServerArgs, device_bytes: int | None = None) -> MemoryPlan:
    """The engine's pools (`ddtree.engine.config.plan_pools`, the function the engine sizes itself
    with) for computed weight bytes, beside the weights, KV per token and requests at full context."""
    if args.target_config is None:
        args = resolve_server_args(args)
    t, d, tp = args.target_config, args.drafter_config, args.tp_size
    if device_bytes is None:
        device_bytes, name = device_memory_bytes(args.device)
    else:
        name = "given"
    fp8 = served_fp8(args)
    tw, dw = weight_bytes(t, d, args.dtype, fp8)
    weights = rank_weight_bytes(t, d, tp, args.dtype, fp8)
    pools = plan_pools(args, device_bytes, weights, args.device)
    tkv, dkv = kv_bytes_per_token(t, d, args.kv_cache_dtype)
    ctx = args.context_length
    at_ctx = pools.kv_tokens // ctx
    if pools.state_rows is not None:  # the requests the state pool holds beside their checkpoints
        at_ctx = min(at_ctx, pools.max_running_requests)
    warnings = list(pools.warnings)
    hint = no_buffer_hint(args, device_bytes, weights, pools, at_ctx)
    if hint is not None:
        warnings.insert(0, hint)
    rest = pools.static_bytes - weights - pools.workspace_bytes - pools.graph_bytes
    if at_ctx == 0 and rest > 0:
        room_fits = pools.kv_room_bytes // pools.kv_bytes_per_token >= ctx + pools.width
        fix = (
            "raise --max-total-tokens or lower --context-length"
            if pools.kv_limit == "--max-total-tokens" and room_fits
            else "lower --context-length or free memory"
        )
        warnings.append(
            f"not one request of --context-length {ctx} fits ({pools.kv_tokens:,} KV tokens); {fix}"
        )
    return MemoryPlan(
        device_name=name,
        device_bytes=device_bytes,
        static_bytes=pools.static_bytes,
        tp_size=tp,
        target_params=target_param_count(t),
        drafter_params=drafter_param_count(d) if d is not None else 0,
        target_weight_bytes=tw,
        drafter_weight_bytes=dw,
        weight_bytes_per_device=weights,
        target_kv_bytes_per_token=tkv,
        drafter_kv_bytes_per_token=dkv,
        kv_bytes_per_token_per_device=pools.kv_bytes_per_token,
        verify_width=pools.width,
        verify_buffer_bytes_per_request=pools.workspace_bytes // args.max_running_requests,
        max_running_requests=args.max_running_requests,
        workspace_bytes=pools.workspace_bytes,
        state_bytes_per_request=pools.state_bytes_per_request,
        spec_state_bytes_per_request=pools.spec_state_bytes_per_request,
        state_pool_bytes=pools.state_pool_bytes,
        state_pool_requests=pools.state_rows,
        kv_pool_bytes=pools.kv_pool_bytes,
        kv_room_bytes=pools.kv_room_bytes,
        state_room_bytes=pools.state_room_bytes,
        kv_limit=pools.kv_limit,
        graph_bytes=pools.graph_bytes,
        graph_max_bs=graph_max_bs(args) if pools.graph_bytes else 0,
        graphs_off=_graphs_off(args),
        kv_tokens=pools.kv_tokens,
        num_pages=pools.num_pages,
        context_length=ctx,
        requests_at_context=at_ctx,
        warnings=tuple(warnings),
        state_checkpoints=pools.checkpoint_rows,
        running_requests=pools.max_running_requests,
        checkpoint_bytes=pools.checkpoint_bytes,
        prefix_cache=not args.disable_radix_cache,
        shared_by_ranks=args.device == "cpu" and tp > 1,
        target_fp8=_fp8_label(fp8[0]),
        drafter_fp8=_fp8_label(fp8[1]),
    )


def _graphs_off(args: ServerArgs) -> str:
    """Why a GPU plan captures no CUDA graph ("" where it does, or on the CPU)."""
    if args.device != "cuda" or not args.disable_cuda_graph:
        return ""
    if args.attention_backend != "triton":
        return f"--attention-backend {args.attention_backend}"
    return "--disable-cuda-graph"


def _fp8_label(layout: Fp8Layout | None) -> str:
    if layout is None:
        return ""
    how = "quantized at load" if layout.at_load else "stored"
    return f"block FP8 {list(layout.block)}, {len(layout.shapes)} linears ({how})"


# ---- where --dp-size replicas run (SGLang's rule; the runtime half is server/dp/placement.py) ----
def replica_gpus(dp: int, tp: int, base: int = 0, step: int = 1) -> list[list[int]]:
    """GPU indices (among the visible ones) of each replica's ranks: replica i's rank r on
    base + (i * tp + r) * step."""
    return [[base + (i * tp + r) * step for r in range(tp)] for i in range(dp)]


def placement(args) -> list[list[int]] | None:
    """Each replica's GPU indices, or None on the CPU."""
    if args.device == "cpu":
        return None
    return replica_gpus(args.dp_size, args.tp_size, args.base_gpu_id, args.gpu_id_step)


def shared(gpus: list[list[int]] | None) -> bool:
    """Whether some replicas share a GPU (--gpu-id-step 0)."""
    if not gpus:
        return False
    flat = [g for ranks in gpus for g in ranks]
    return len(set(flat)) < len(flat)


def describe_placement(gpus: list[list[int]] | None, dp: int) -> list[str]:
    """One line per replica: its GPUs (or the CPU)."""
    if gpus is None:
        return [f"replica {i}: cpu" for i in range(dp)]
    return [f"replica {i}: GPU{'s' if len(g) > 1 else ''} {_span(g)}" for i, g in enumerate(gpus)]


def _span(ids: list[int]) -> str:
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))
