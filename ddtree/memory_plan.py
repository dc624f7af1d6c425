"""Static memory plan from config.json geometry alone: weights, KV per token, per-request buffers and state.

Parameter counts follow transformers' Qwen3 / Qwen3.5 modeling code exactly (text model only: vision tower and
MTP weights are never loaded by the engine). Per-device numbers divide sharded tensors by --tp-size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ddtree.configs import DrafterConfig, TargetConfig
from ddtree.server_args import ServerArgs, cuda_available, resolve_server_args

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _attention_params(hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, gated_q: bool) -> int:
    q_out = heads * head_dim * (2 if gated_q else 1)
    kv_out = kv_heads * head_dim
    n = hidden * q_out + 2 * hidden * kv_out + heads * head_dim * hidden
    if bias:
        n += q_out + 2 * kv_out + hidden
    return n + 2 * head_dim  # q_norm, k_norm


def _gdn_params(t: TargetConfig) -> int:
    key_dim = t.linear_num_key_heads * t.linear_key_head_dim
    value_dim = t.linear_num_value_heads * t.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    h, hv = t.hidden_size, t.linear_num_value_heads
    # in_proj_qkv + in_proj_z + in_proj_b + in_proj_a (Qwen3-Next fuses them as qkvz/ba: same count)
    proj = h * conv_dim + h * value_dim + 2 * h * hv
    return proj + conv_dim * t.linear_conv_kernel_dim + 2 * hv + t.linear_value_head_dim + value_dim * h


def _mlp_params(t: TargetConfig, layer: int) -> int:
    text = t.raw.get("text_config") or t.raw
    experts = int(text.get("num_experts", 0) or 0)
    sparse_step = int(text.get("decoder_sparse_step", 1) or 1)
    dense = layer in (text.get("mlp_only_layers") or ()) or (layer + 1) % sparse_step != 0
    if experts == 0 or dense:
        return 3 * t.hidden_size * t.intermediate_size
    moe_inter = int(text.get("moe_intermediate_size", t.intermediate_size))
    shared = int(text.get("shared_expert_intermediate_size", 0) or 0)
    n = experts * 3 * t.hidden_size * moe_inter + t.hidden_size * experts
    return n + (3 * t.hidden_size * shared + t.hidden_size if shared else 0)


def target_param_count(t: TargetConfig) -> int:
    h = t.hidden_size
    n = t.vocab_size * h * (1 if t.tie_word_embeddings else 2) + h
    attn = _attention_params(h, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.attention_bias,
                             t.attn_output_gate)
    linear = set(t.linear_layer_ids)
    for i in range(t.num_hidden_layers):
        n += (_gdn_params(t) if i in linear else attn) + _mlp_params(t, i) + 2 * h
    return n


def drafter_param_count(d: DrafterConfig) -> int:
    """fc + hidden_norm + layers + norm; the drafter borrows the target's embedding and lm_head."""
    h = d.hidden_size
    taps = len(d.target_layer_ids)
    layer = _attention_params(h, d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.attention_bias, False)
    layer += 3 * h * d.intermediate_size + 2 * h
    return taps * h * h + h + d.num_hidden_layers * layer + h


def target_kv_bytes_per_token(t: TargetConfig, dtype_bytes: int) -> int:
    return 2 * len(t.attention_layer_ids) * t.num_key_value_heads * t.head_dim * dtype_bytes


def drafter_kv_bytes_per_token(d: DrafterConfig, dtype_bytes: int) -> int:
    """Context K/V of every drafter layer sits at the target's token slots (sliding layers included)."""
    return 2 * d.num_hidden_layers * d.num_key_value_heads * d.head_dim * dtype_bytes


def recurrent_state_bytes(t: TargetConfig, act_bytes: int, ssm_bytes: int) -> tuple[int, int]:
    """(conv window, delta-rule state) bytes of one request over all GDN layers. The conv window keeps the
    activation dtype and the SSM state uses --mamba-ssm-dtype, as in SGLang's Mamba pool."""
    conv_dim = 2 * t.linear_num_key_heads * t.linear_key_head_dim + t.linear_num_value_heads * t.linear_value_head_dim
    n = len(t.linear_layer_ids)
    conv = n * conv_dim * max(t.linear_conv_kernel_dim - 1, 0) * act_bytes
    ssm = n * t.linear_num_value_heads * t.linear_key_head_dim * t.linear_value_head_dim * ssm_bytes
    return conv, ssm


def device_memory_bytes(device: str = "auto") -> tuple[int, str]:
    if device != "cpu" and cuda_available():
        import torch

        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"


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
    target_kv_bytes_per_token: int  # whole model; per device divide by tp_size
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
    kv_pool_bytes: int
    kv_tokens: int
    context_length: int
    requests_at_context: int
    warnings: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.kv_tokens > 0 and self.requests_at_context > 0

    def format(self) -> str:
        rows = [
            ("device", f"{self.device_name}: {_gib(self.device_bytes)}, static pool {_gib(self.static_bytes)}"),
            ("target weights", f"{self.target_params / 1e9:.2f} B params, {self.target_weight_bytes / 1e9:.2f} GB"),
            ("drafter weights", f"{self.drafter_params / 1e9:.2f} B params, {self.drafter_weight_bytes / 1e9:.2f} GB"),
            ("weights per device", f"{_gib(self.weight_bytes_per_device)} (tp {self.tp_size})"),
            ("KV per token", f"target {_kib(self.target_kv_bytes_per_token)} + drafter "
                             f"{_kib(self.drafter_kv_bytes_per_token)}; per device "
                             f"{_kib(self.kv_bytes_per_token_per_device)}"),
            ("verify buffers", f"width {self.verify_width}: {_gib(self.verify_buffer_bytes_per_request)}/request x "
                               f"{self.max_running_requests} = {_gib(self.workspace_bytes)}"),
        ]
        if self.state_pool_requests is not None:
            rows += [
                ("recurrent state", f"{_gib(self.state_bytes_per_request)}/request + speculative "
                                    f"{_gib(self.spec_state_bytes_per_request)}/request"),
                ("state pool", f"{_gib(self.state_pool_bytes)} -> {self.state_pool_requests} requests"),
            ]
        rows += [
            ("KV pool", f"{_gib(self.kv_pool_bytes)} -> {self.kv_tokens:,} tokens"),
            ("requests at context", f"{self.requests_at_context} x {self.context_length:,} tokens"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = ["memory plan:"] + [f"  {k:<{width}}  {v}" for k, v in rows]
        return "\n".join(lines + [f"  warning: {w}" for w in self.warnings])


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def memory_plan(args: ServerArgs, device_bytes: int | None = None) -> MemoryPlan:
    if args.target_config is None:
        args = resolve_server_args(args)
    t, d = args.target_config, args.drafter_config
    tp = args.tp_size
    if device_bytes is None:
        device_bytes, name = device_memory_bytes(args.device)
    else:
        name = "given"
    act = DTYPE_BYTES[args.dtype]
    kv_dtype = DTYPE_BYTES[args.kv_cache_dtype if args.kv_cache_dtype != "auto" else args.dtype]
    static = int(device_bytes * args.mem_fraction_static)
    tw = target_param_count(t) * act
    dw = drafter_param_count(d) * act if d is not None else 0
    weights = -(-(tw + dw) // tp)
    tkv = target_kv_bytes_per_token(t, kv_dtype)
    dkv = drafter_kv_bytes_per_token(d, kv_dtype) if d is not None else 0
    kv_per_token = (tkv + dkv) // tp
    width = args.verify_width
    verify = width * t.vocab_size * 4
    if d is not None:
        block = args.speculative_dflash_block_size or d.block_size
        verify += block * t.vocab_size * 4 + width * len(d.target_layer_ids) * t.hidden_size * act
    n_req = args.max_running_requests or 1
    workspace = n_req * verify
    rest = static - weights - workspace
    warnings = []
    if rest <= 0:
        warnings.append(f"weights ({_gib(weights)}) and verify buffers ({_gib(workspace)}) exceed the static pool "
                        f"({_gib(static)}); raise --mem-fraction-static, lower --max-running-requests or use a "
                        "larger --tp-size")
    rest = max(rest, 0)
    state = spec_state = state_pool = 0
    state_requests = None
    if t.is_hybrid:
        conv, ssm = recurrent_state_bytes(t, act, DTYPE_BYTES[args.mamba_ssm_dtype])
        state = (conv + ssm) // tp
        spec_state = 0
        if args.is_speculative and args.mamba_scheduler_strategy == "extra_buffer":
            spec_state = width * state  # a full conv + delta-rule state per verified node
        elif args.is_speculative:  # no_buffer: per-node GDN inputs, replayed along the accepted path
            conv_dim = 2 * t.linear_num_key_heads * t.linear_key_head_dim + t.linear_num_value_heads * \
                t.linear_value_head_dim
            per_node = 2 * conv_dim * act + t.linear_num_value_heads * (4 + act)
            spec_state = width * len(t.linear_layer_ids) * per_node // tp
        per_request = state + spec_state
        r = args.mamba_full_memory_ratio
        state_pool = min(args.max_mamba_cache_size * per_request, rest) if args.max_mamba_cache_size else \
            int(rest * r / (1 + r))
        state_requests = state_pool // per_request
        if state_requests < n_req:
            warnings.append(f"the state pool holds {state_requests} requests < --max-running-requests {n_req}; "
                            "concurrency is capped there (raise --mamba-full-memory-ratio, lower "
                            "--speculative-ddtree-budget or --max-running-requests, or use --mamba-ssm-dtype "
                            "bfloat16)")
    kv_pool = rest - state_pool
    kv_tokens = kv_pool // kv_per_token // args.page_size * args.page_size if kv_per_token else 0
    if args.max_total_tokens is not None:
        kv_tokens = min(kv_tokens, args.max_total_tokens)
    ctx = args.context_length or t.max_position_embeddings
    at_ctx = kv_tokens // ctx
    if state_requests is not None:
        at_ctx = min(at_ctx, state_requests)
    if at_ctx == 0 and rest > 0:
        warnings.append(f"not one request of --context-length {ctx} fits ({kv_tokens:,} KV tokens); lower "
                        "--context-length or free memory")
    return MemoryPlan(
        device_name=name, device_bytes=device_bytes, static_bytes=static, tp_size=tp,
        target_params=tw // act, drafter_params=dw // act, target_weight_bytes=tw, drafter_weight_bytes=dw,
        weight_bytes_per_device=weights, target_kv_bytes_per_token=tkv, drafter_kv_bytes_per_token=dkv,
        kv_bytes_per_token_per_device=kv_per_token, verify_width=width, verify_buffer_bytes_per_request=verify,
        max_running_requests=n_req, workspace_bytes=workspace, state_bytes_per_request=state,
        spec_state_bytes_per_request=spec_state, state_pool_bytes=state_pool, state_pool_requests=state_requests,
        kv_pool_bytes=kv_pool, kv_tokens=kv_tokens, context_length=ctx, requests_at_context=at_ctx,
        warnings=tuple(warnings),
    )
