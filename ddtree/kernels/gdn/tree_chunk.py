"""Tree gated delta rule in chunk (WY / UT) form: per-node outputs without materialising per-node states.

The recurrence of `reference.tree_gated_delta_rule` (S [dk, dv], q/k l2-normalised, q scaled, fp32):
    S_i = e^{g_i} S_p(i) + k_i u_iᵀ,   u_i = β_i (v_i - (e^{g_i} S_p(i))ᵀ k_i),   o_i = S_iᵀ q_i
with S_p(i) the parent's post-state (the committed S0 for a root). Unrolled along i's root path, with
G_i = Σ g over ancestors-and-self of i (= (A + I) g, A[i, j] = 1 iff j is a strict ancestor of i):
    S_i = e^{G_i} S0 + Σ_{j ∈ anc(i) ∪ {i}} e^{G_i - G_j} k_j u_jᵀ
u_j depends only on j's own root path, so it is the same u_j for every descendant. Substituting into u_i:
    u_i + β_i Σ_{j ∈ anc(i)} e^{G_i - G_j} (k_i·k_j) u_j = β_i v_i - β_i e^{G_i} S0ᵀ k_i
i.e. (I + L) U = β V - β e^G K S0 with L = (diag(β) K Kᵀ) ⊙ Γ ⊙ A, Γ[i, j] = e^{G_i - G_j}. Nodes in
topological flat order (parents[i] < i) make A strictly lower-triangular: one unitriangular solve, as the
chunked (causal) algorithm with the causal mask replaced by the ancestor mask. Then
    o_i = e^{G_i} S0ᵀ q_i + Σ_{j ∈ anc(i) ∪ {i}} e^{G_i - G_j} (q_i·k_j) u_j   ((Q Kᵀ ⊙ Γ ⊙ (A + I)) U)
and the post-state of one node a (the last accepted) is S_a = e^{G_a} S0 + (K ⊙ Γ[a]ᵀ)ᵀ U: the commit
without per-node states. O(n²) work per (request, head), all batched matmuls, fixed shapes, no host syncs
(CUDA-graph capturable).

Requirement beyond the reference: parents[b, i] < i for every valid node (as the Triton kernel). Padding
nodes (valid False; valid defaults to depths >= 0) are nobody's ancestors; their inputs may be garbage,
their outputs are zero.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ddtree.kernels.gdn.reference import _prep


def tree_ancestor_mask(parents: Tensor, valid: Tensor, max_depth: int | None = None) -> Tensor:
    """[b, n, n] bool, M[b, i, j] = j is an ancestor of i or i itself (valid nodes only). Transitive closure
    of (I + parent edges) by repeated squaring: ceil(log2(max_depth)) batched matmuls, no host syncs.
    max_depth bounds the number of edges on any root path (n - 1 when None)."""
    n = parents.shape[1]
    idx = torch.arange(n, device=parents.device)
    edge = valid & (parents >= 0)
    R = (parents.long()[..., None] == idx) & edge[..., None]  # R[i, p] = p is i's parent
    R = (R | (torch.eye(n, dtype=torch.bool, device=parents.device) & valid[..., None])).float()
    depth = n - 1 if max_depth is None else min(max_depth, n - 1)
    for _ in range(math.ceil(math.log2(depth)) if depth > 1 else 0):  # R covers paths of 2^s edges
        R = ((R @ R) > 0).float()  # 0/1 inputs, integer sums <= n: exact in fp32 and tf32
    return R > 0


def tree_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    parents: Tensor,
    depths: Tensor,
    initial_state: Tensor,
    valid: Tensor | None = None,
    max_depth: int | None = None,
    initial_rows: Tensor | None = None,
    last: Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Same inputs as `reference.tree_gated_delta_rule` (q, k [b, n, Hk, dk]; v [b, n, Hv, dv]; g, beta
    [b, n, Hv]; initial_state [b, Hv, dk, dv], or a pool [R, ...] with initial_rows [b]), topological order.
    last [b] (optional): a node per request whose post-state is returned. mask [b, >= n, >= n]
    (optional): the round's ancestors-and-self mask (`DraftTree.tree_mask`), else built here.
    Returns (o [b, n, Hv, dv] in q's dtype, state of node last [b, Hv, dk, dv] fp32, or None)."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prep(q, k, v, g, beta, use_qk_l2norm, scale)
    if valid is None:
        valid = depths >= 0
    m = valid[..., None]
    q, k, v = (torch.where(m[..., None], t, 0).transpose(1, 2) for t in (q, k, v))  # [b, H, n, d]
    g, beta = (torch.where(m, t, 0).transpose(1, 2) for t in (g, beta))  # [b, H, n]
    S0 = (initial_state if initial_rows is None else initial_state[initial_rows.long()]).float()
    if mask is None:
        M = tree_ancestor_mask(parents, valid, max_depth)  # ancestors-and-self
    else:  # the tree's own (padding rows: self only): valid rows and columns
        n = valid.shape[1]
        M = mask[:, :n, :n].bool() & valid[:, :, None] & valid[:, None, :]
    G = torch.einsum("bij,bhj->bhi", M.float(), g)
    decay = torch.where(
        M[:, None], G[..., :, None] - G[..., None, :], float("-inf")
    ).exp()  # Γ ⊙ (A + I)
    eG = G.exp()[..., None]
    kS0 = k @ S0
    L = (
        (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    )  # the diagonal is ignored by the unitriangular solve
    U = torch.linalg.solve_triangular(
        L, beta[..., None] * (v - eG * kS0), upper=False, unitriangular=True
    )
    o = eG * (q @ S0) + ((q @ k.transpose(-1, -2)) * decay) @ U
    state = None
    if last is not None:
        rows = last.long().view(-1, 1, 1, 1).expand(-1, decay.shape[1], 1, decay.shape[-1])
        # [b, H, 1, n]: e^{G_a - G_j} on a's ancestors-and-self, 0 elsewhere
        w = decay.gather(2, rows)
        Ga = G.gather(2, last.long().view(-1, 1, 1).expand(-1, G.shape[1], 1))  # [b, H, 1]
        state = Ga.exp()[..., None] * S0 + (k * w.transpose(-1, -2)).transpose(-1, -2) @ U
    return o.transpose(1, 2).to(out_dtype).contiguous(), state
