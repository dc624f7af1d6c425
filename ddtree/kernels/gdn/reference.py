"""Gated DeltaNet (Qwen3.5 linear attention) in plain PyTorch: the oracle for GPU kernels and the CPU path.

Semantics follow transformers' Qwen3.5 GatedDeltaNet. Math is fp32; outputs come back in the input dtype.

Layouts (token-major, like the engine's activations):
  conv input x ........ [..., T, C]  (C = conv_dim = 2*Hk*dk + Hv*dv, the in_proj_qkv output, pre-conv)
  conv weight ......... [C, K]       (nn.Conv1d weight [C, 1, K] squeezed)
  conv state .......... [..., C, K-1] the last K-1 pre-conv inputs, oldest first (causal-conv1d / SGLang
                                      layout; transformers' cache keeps K columns, the first one unused)
  q, k ................ [b, T, Hk, dk]; v [b, T, Hv, dv]; g, beta [b, T, Hv]   (fla / transformers layout)
  recurrent state ..... [b, Hv, dk, dv], fp32
Trees: T becomes the n nodes of a request. parents [b, n] are request-local node indices, -1 for a node
that continues from the committed state (the root); depths [b, n] count from 0 at the root. Nodes may be in
any flat order. Padding nodes: parents = -1 and depths = -1 (or valid = False); their inputs may be garbage,
their outputs are zero and their states finite.
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def gdn_gating(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """(g, beta) from in_proj_a / in_proj_b outputs [..., Hv]: g = -exp(A_log)*softplus(a + dt_bias) (fp32,
    log decay <= 0), beta = sigmoid(b) (b's dtype)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def gated_rmsnorm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., D] over D (plain weight, not 1 + w), then times silu(z) (Qwen3.5's gated norm;
    HF's rounding: the normalised x in x's dtype, times the weight, times silu(z) in fp32)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(z.float())).to(dtype)


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _conv_silu(windows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """windows [..., C, K] (oldest first) -> silu(depthwise conv) [..., C], fp32."""
    y = (windows * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return F.silu(y)


def causal_conv1d_prefill(
    x: Tensor, weight: Tensor, conv_state: Tensor | None = None, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One sequence. x [T, C], conv_state [C, K-1] or None (zeros: sequence start).
    Returns (y [T, C] after SiLU, new conv_state [C, K-1]); T may be shorter than K-1, or 0."""
    K = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[1], K - 1)
    ext = torch.cat([conv_state.float().t(), x.float()], 0)  # [K-1+T, C]
    y = _conv_silu(ext.unfold(0, K, 1), weight, bias) if x.shape[0] else x.new_zeros(x.shape)
    return y.to(x.dtype), ext[ext.shape[0] - (K - 1) :].t().contiguous().to(conv_state.dtype)


def causal_conv1d_varlen(
    x: Tensor,
    weight: Tensor,
    cu_seqlens: Tensor,
    conv_states: Tensor | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Packed sequences. x [T_total, C], cu_seqlens [N+1], conv_states [N, C, K-1] or None.
    Returns (y [T_total, C], new conv_states [N, C, K-1])."""
    ys, states = [], []
    bounds = cu_seqlens.tolist()
    for i in range(len(bounds) - 1):
        y, s = causal_conv1d_prefill(
            x[bounds[i] : bounds[i + 1]],
            weight,
            None if conv_states is None else conv_states[i],
            bias,
        )
        ys.append(y)
        states.append(s)
    return torch.cat(ys, 0), torch.stack(states, 0)


def causal_conv1d_step(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Decode: one token per request. x [b, C], conv_state [b, C, K-1].
    Returns (y [b, C], new conv_state [b, C, K-1]); conv_state is not modified."""
    win = torch.cat([conv_state.float(), x.float().unsqueeze(-1)], -1)
    return _conv_silu(win, weight, bias).to(x.dtype), win[..., 1:].to(conv_state.dtype)


def _prep(q, k, v, g, beta, use_qk_l2norm: bool, scale: float | None):
    """GQA-expand key heads to value heads (each key head serves Hv/Hk consecutive value heads), fp32,
    l2-normalise q and k, scale q."""
    Hk, Hv = k.shape[-2], v.shape[-2]
    if Hk != Hv:
        q = q.repeat_interleave(Hv // Hk, dim=-2)
        k = k.repeat_interleave(Hv // Hk, dim=-2)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def _delta_step(
    S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor]:
    """One token. S [..., dk, dv], q/k [..., dk], v [..., dv], g/beta [...] -> (o [..., dv], S')."""
    S = S * g.exp()[..., None, None]
    u = (v - torch.einsum("...kv,...k->...v", S, k)) * beta[..., None]
    S = S + k[..., :, None] * u[..., None, :]
    return torch.einsum("...kv,...k->...v", S, q), S


def _init_state(initial_state, b, H, dk, dv, like):
    if initial_state is None:
        return like.new_zeros(b, H, dk, dv)
    return initial_state.float()


def _recurrent(q, k, v, g, beta, S):
    """Prepped [b, T, H, *] fp32 inputs -> (o [b, T, H, dv], final S)."""
    out = v.new_empty(v.shape)
    for t in range(q.shape[1]):
        out[:, t], S = _delta_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
    return out, S


def _chunked(q, k, v, g, beta, S, chunk_size: int):
    """Prepped [b, T, H, *] fp32 inputs -> (o [b, T, H, dv], final S). Within a chunk with cumulative log
    decay c, the delta-rule corrections U solve (I + A) U = beta*V - beta*e^c K S0 with
    A[t, s] = beta_t e^(c_t - c_s) k_t.k_s (s < t), so every chunk costs matmuls plus one triangular solve."""
    b, T, H, _ = k.shape
    if T == 0:  # an empty segment of a packed batch leaves its state unchanged
        return v.new_zeros(v.shape), S
    pad = (-T) % chunk_size  # padded tokens have k = g = beta = 0: an identity update of the state

    def chunks(t):
        t = t.transpose(1, 2)
        t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 4 else F.pad(t, (0, pad))
        return t.reshape(b, H, -1, chunk_size, *t.shape[3:])

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    c = g.cumsum(-1)
    idx = torch.arange(chunk_size, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay  # the diagonal is ignored by the unitriangular solve
    W = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    Kd = torch.linalg.solve_triangular(A, kb * c.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]
    out = torch.empty_like(W)
    for i in range(q.shape[2]):
        U = W[:, :, i] - Kd[:, :, i] @ S
        out[:, :, i] = q_dec[:, :, i] @ S + attn[:, :, i] @ U
        S = S * c[:, :, i, -1].exp()[..., None, None] + k_to_end[:, :, i].transpose(-1, -2) @ U
    return out.reshape(b, H, -1, out.shape[-1])[:, :, :T].transpose(1, 2), S


def _run_rule(core, q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm, scale):
    out_dtype = q.dtype
    q, k, v, g, beta = _prep(q, k, v, g, beta, use_qk_l2norm, scale)
    b, _, H, dk = k.shape
    if cu_seqlens is None:
        out, S = core(q, k, v, g, beta, _init_state(initial_state, b, H, dk, v.shape[-1], v))
        return out.to(out_dtype), S
    if b != 1:
        raise ValueError("cu_seqlens requires a packed batch of size 1")
    bounds = cu_seqlens.tolist()
    S0 = _init_state(initial_state, len(bounds) - 1, H, dk, v.shape[-1], v)
    outs, states = [], []
    for i in range(len(bounds) - 1):
        seg = slice(bounds[i], bounds[i + 1])
        o, S = core(q[:, seg], k[:, seg], v[:, seg], g[:, seg], beta[:, seg], S0[i : i + 1])
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 1).to(out_dtype), torch.cat(states, 0)


def gated_delta_rule_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule (the oracle). q, k [b, T, Hk, dk]; v [b, T, Hv, dv]; g, beta
    [b, T, Hv]; initial_state [b, Hv, dk, dv] or None (zeros). scale defaults to dk**-0.5.
    With cu_seqlens [N+1], b must be 1 and initial_state is [N, Hv, dk, dv].
    Returns (o [b, T, Hv, dv] in q's dtype, final_state [b or N, Hv, dk, dv] fp32)."""
    return _run_rule(_recurrent, q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm, scale)


def gated_delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked form of gated_delta_rule_recurrent (prefill); same arguments and returns."""

    def core(*args):
        return _chunked(*args, chunk_size=chunk_size)

    return _run_rule(core, q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm, scale)


def tree_causal_conv1d(
    x: Tensor,
    parents: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    valid: Tensor | None = None,
    return_node_states: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Causal conv over a tree: a node's window is the K-1 inputs before it on its root->node chain, reaching
    into the committed conv_state for shallow nodes. x [b, n, C], parents [b, n], conv_state [b, C, K-1].
    Returns (y [b, n, C], node_states [b, n, C, K-1] or None): node_states[i] is the conv state to commit
    if node i is the last accepted node."""
    b, n, C = x.shape
    K = weight.shape[1]
    if valid is not None:
        x = torch.where(valid[..., None], x, 0)
    # ext holds the K-1 committed inputs, then the nodes (node i at K-1+i); prev maps an ext slot to the
    # slot of the input before it on the chain. Slot 0's prev (-1) is never followed within K-1 hops.
    ext = torch.cat([conv_state.float().transpose(1, 2), x.float()], 1)
    state_prev = torch.arange(-1, K - 2, device=x.device).expand(b, K - 1)
    node_prev = torch.where(parents >= 0, parents + (K - 1), K - 2)
    prev = torch.cat([state_prev, node_prev.long()], 1)
    slots = [torch.arange(K - 1, K - 1 + n, device=x.device).expand(b, n)]
    for _ in range(K - 1):
        slots.insert(0, prev.gather(1, slots[0].clamp(min=0)))
    idx = torch.stack(slots, -1).reshape(b, n * K, 1).expand(b, n * K, C)
    win = ext.gather(1, idx).reshape(b, n, K, C).transpose(2, 3)  # [b, n, C, K]
    y = _conv_silu(win, weight, bias)
    if valid is not None:
        y = torch.where(valid[..., None], y, 0)
    states = win[..., 1:].to(conv_state.dtype) if return_node_states else None
    return y.to(x.dtype), states


def root_causal_conv1d(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """`tree_causal_conv1d` of one-node trees (AR rounds), without the ancestor gathers: x [b, C] roots,
    conv_state [b, C, K-1]. The window is laid out as there ([K, C] rows, viewed [C, K]) so the fp32
    sum runs over the same strides. Returns (y [b, C], node state [b, C, K-1])."""
    ext = torch.cat([conv_state.float().transpose(1, 2), x.float()[:, None]], 1)  # [b, K, C]
    win = ext.transpose(1, 2)  # [b, C, K]
    return _conv_silu(win, weight, bias).to(x.dtype), win[..., 1:].to(conv_state.dtype)


def tree_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    parents: Tensor,
    depths: Tensor,
    initial_state: Tensor,
    return_node_states: bool = False,
    valid: Tensor | None = None,
    max_depth: int | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Gated delta rule over a tree: node i's state is the update of its parent's post-state (initial_state
    for parent -1) by node i's inputs; its output reads its own post-state. Depth by depth, all nodes of a
    depth at once. q, k [b, n, Hk, dk]; v [b, n, Hv, dv]; g, beta [b, n, Hv]; initial_state [b, Hv, dk, dv].
    valid defaults to depths >= 0. Returns (o [b, n, Hv, dv] in q's dtype,
    node_states [b, n, Hv, dk, dv] fp32 (post-states) or None)."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prep(q, k, v, g, beta, use_qk_l2norm, scale)
    if valid is None:
        valid = depths >= 0
    m = valid[..., None]
    q, k, v = (torch.where(m[..., None], t, 0) for t in (q, k, v))
    g, beta = (torch.where(m, t, 0) for t in (g, beta))
    b, n, H, dk = k.shape
    S0 = initial_state.float()
    states = k.new_zeros(b, n, H, dk, v.shape[-1])
    out = torch.zeros_like(v)
    if max_depth is None:
        max_depth = int(torch.where(valid, depths, 0).max()) if n else -1
    for d in range(max_depth + 1):
        bi, ni = torch.nonzero(valid & (depths == d), as_tuple=True)
        p = parents[bi, ni].long()
        pre = torch.where((p < 0)[:, None, None, None], S0[bi], states[bi, p.clamp(min=0)])
        out[bi, ni], states[bi, ni] = _delta_step(
            pre, q[bi, ni], k[bi, ni], v[bi, ni], g[bi, ni], beta[bi, ni]
        )
    return out.to(out_dtype), states if return_node_states else None


def tree_gated_delta_rule_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    parents: Tensor,
    depths: Tensor,
    initial_state: Tensor,
    return_node_states: bool = False,
    valid: Tensor | None = None,
    max_depth: int | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    node_states: Tensor | None = None,
    initial_rows: Tensor | None = None,
    state_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """tree_gated_delta_rule with the buffer arguments of the Triton wrapper: initial_rows [b] picks each
    request's row of an initial_state pool [R, Hv, dk, dv]; node_states [b, n, ...] (or, with state_rows [b],
    a pool [R, W >= n, ...]) receives the node post-states, cast to its dtype, and is what is returned."""
    S0 = initial_state if initial_rows is None else initial_state[initial_rows.long()]
    keep = return_node_states or node_states is not None
    o, st = tree_gated_delta_rule(
        q, k, v, g, beta, parents, depths, S0, keep, valid, max_depth, use_qk_l2norm, scale
    )
    if node_states is not None:
        n = st.shape[1]
        if state_rows is None:
            node_states[:, :n] = st.to(node_states.dtype)
        else:
            node_states[state_rows.long(), :n] = st.to(node_states.dtype)
        st = node_states
    return o, st if return_node_states else None


def gather_node_state(node_states: Tensor, node_idx: Tensor) -> Tensor:
    """Commit by copy: node_states [b, n, ...] (recurrent or conv), node_idx [b] -> node_states[i, node_idx[i]]."""
    return node_states[
        torch.arange(node_states.shape[0], device=node_states.device), node_idx.long()
    ]


def _path_gather(t: Tensor, path: Tensor) -> Tensor:
    rows = torch.arange(t.shape[0], device=t.device)[:, None]
    return t[rows, path.clamp(min=0).long()]


def replay_path(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    path: Tensor,
    initial_state: Tensor,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Commit by replay: run the accepted chain from the pre-tree state. q..beta are the per-node inputs given
    to tree_gated_delta_rule ([b, n, ...]); path [b, L] lists accepted node indices root first, padded with
    -1 at the end; initial_state [b, Hv, dk, dv]. Returns the committed state [b, Hv, dk, dv] fp32."""
    q, k, v, g, beta = path_inputs(q, k, v, g, beta, path)
    return gated_delta_rule_chunked(
        q, k, v, g, beta, initial_state, chunk_size, use_qk_l2norm=use_qk_l2norm, scale=scale
    )[1]


def path_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, path: Tensor):
    """The accepted chain's inputs [b, L, ...] for any sequence kernel; padded steps get k = g = beta = 0,
    which passes the state through unchanged."""
    keep = path >= 0
    q, k, v, g, beta = (_path_gather(t, path) for t in (q, k, v, g, beta))
    k = torch.where(keep[..., None, None], k, 0)
    g, beta = (torch.where(keep[..., None], t, 0) for t in (g, beta))
    return q, k, v, g, beta


def replay_conv_path(x: Tensor, path: Tensor, conv_state: Tensor) -> Tensor:
    """Conv state after the accepted chain: x [b, n, C] per-node pre-conv inputs, path [b, L] as in
    replay_path, conv_state [b, C, K-1] pre-tree. Returns [b, C, K-1]."""
    Km1 = conv_state.shape[-1]
    ext = torch.cat([conv_state.transpose(1, 2), _path_gather(x, path).to(conv_state.dtype)], 1)
    # the last K-1 real inputs sit at ext[start : start+K-1]
    start = (path >= 0).sum(1, keepdim=True)
    idx = (start + torch.arange(Km1, device=x.device))[..., None].expand(-1, -1, x.shape[-1])
    return ext.gather(1, idx).transpose(1, 2).contiguous()
