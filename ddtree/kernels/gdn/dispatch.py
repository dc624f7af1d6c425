"""Gated DeltaNet ops as the engine calls them: fla / our Triton tree kernel on CUDA, the reference elsewhere
or under DDTREE_REFERENCE=gdn (backend.py). Layouts are the reference's, which are fla's:
token-major q, k [b, T, Hk, dk], v [b, T, Hv, dv], g (log decay, fp32) and beta [b, T, Hv], recurrent states
[N, Hv, dk, dv] fp32 (fla's default [N, HV, K, V], state_v_first=False: no transposes). Under GQA value
head h reads key head h // (Hv / Hk) in both (fla's GVA), so k is never expanded. q/k are l2-normalised
inside and scaled by dk**-0.5, as Qwen3.5 calls fla.

fla's functions take beta after g, gk, gv: everything past v is passed by keyword.
"""

from __future__ import annotations

from torch import Tensor

from ddtree.kernels.gdn.backend import choose, fla_ops, use_fla, use_triton
from ddtree.kernels.gdn.reference import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    replay_path,
    tree_gated_delta_rule_rows,
)
from ddtree.kernels.gdn.tree_chunk import tree_ancestor_mask
from ddtree.kernels.gdn.tree_chunk_triton import supported


def _fla_args(g: Tensor, beta: Tensor, initial_state: Tensor | None) -> dict:
    """fla's chunk and fused-recurrent ops alike: fp32 gates and state, the final state out, q/k
    L2-normalised in the kernel (the reference's `use_qk_l2norm`)."""
    state = None if initial_state is None else initial_state.float().contiguous()
    return dict(
        g=g.float(),
        beta=beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )


def chunk_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Prefill / chunked prefill: `reference.gated_delta_rule_chunked` (o, final state fp32)."""
    if choose("prefill", use_fla(v), "fla"):
        chunk = fla_ops()[0]
        return chunk(q, k, v, **_fla_args(g, beta, initial_state), cu_seqlens=cu_seqlens)
    return gated_delta_rule_chunked(q, k, v, g, beta, initial_state, cu_seqlens=cu_seqlens)


def recurrent_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    op: str = "decode",
) -> tuple[Tensor, Tensor]:
    """Token by token ([b, T, ...], short T: decode, replay): `reference.gated_delta_rule_recurrent`."""
    if choose(op, use_fla(v), "fla"):
        fused = fla_ops()[1]
        return fused(q, k, v, **_fla_args(g, beta, initial_state))
    return gated_delta_rule_recurrent(q, k, v, g, beta, initial_state)


def decode_step(q: Tensor, k: Tensor, v: Tensor, gate, ssm: Tensor, rows: Tensor) -> Tensor:
    """One token per request, in place on the pool's rows: ssm [R, Hv, dk, dv] rows `rows` [b]
    step by q, k [b, Hk, dk], v [b, Hv, dv] and the gate (the layer's `fused.GateInputs`, or
    anything whose values() are g, beta [b, Hv]); returns o [b, Hv, dv]. `decode_triton` where our
    Triton kernels run (one launch, GateInputs gated inside); elsewhere the gate's values and
    `reference.gated_delta_rule_recurrent` for T = 1 on the gathered rows, written back in the
    pool's dtype (the same control flow on every device)."""
    if choose("decode_step", use_triton(v), "triton"):
        from ddtree.kernels.gdn.decode_triton import gated_delta_decode_triton

        raw = gate.inputs() if hasattr(gate, "inputs") else gate.values()
        return gated_delta_decode_triton(q, k, v, tuple(raw), ssm, rows)
    g, beta = gate.values()
    steps = (t[:, None] for t in (q, k, v, g, beta))  # [b, T = 1, ...]
    o, S = gated_delta_rule_recurrent(*steps, ssm[rows])
    ssm[rows] = S.to(ssm.dtype)
    return o[:, 0]


def replay(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, path: Tensor, initial_state: Tensor
) -> Tensor:
    """Commit by replay, the reference commit's rule (`HybridStatePool.commit` where the commit
    kernel does not run): `reference.replay_path` (path [b, L], -1 padded; returns the state fp32)."""
    choose("replay", False, "fla")
    return replay_path(q, k, v, g, beta, path, initial_state)


def tree_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    parents: Tensor,
    depths: Tensor,
    initial_state: Tensor,
    return_node_states: bool = False,
    valid: Tensor | None = None,
    max_depth: int | None = None,
    node_states: Tensor | None = None,
    initial_rows: Tensor | None = None,
    state_rows: Tensor | None = None,
    tree_mask: Tensor | None = None,
    stash: tuple[Tensor, Tensor, Tensor] | None = None,
    gate=None,
) -> tuple[Tensor, Tensor | None]:
    """Tree verify: `reference.tree_gated_delta_rule_rows` (the Triton wrapper's arguments). One path
    per strategy where our Triton kernels run: without node states (no_buffer: return_node_states
    False, no node_states buffer) the chunk-form kernel (`tree_chunk_triton`, <= 65 nodes: it
    writes no per-node states at all); with them (extra_buffer), or a longer tree, the Triton
    recurrence (`triton_tree`). tree_mask [b, >= n, >= n]: the round's ancestors-and-self mask
    (built per call when None). stash (node_g, node_beta, rows): g and beta written into those
    stash rows (no_buffer's replay inputs; inside the chunk kernel). gate: the layer's raw decay
    gate (`fused.GateInputs`) in place of g / beta (None): the chunk kernel gates inside, the other
    paths take `gate.values()`."""
    ours = use_triton(v)
    no_states = not return_node_states and node_states is None
    if ours and no_states and supported(v.shape[1]):
        choose("tree", True, "chunk")
        from ddtree.kernels.gdn.tree_chunk_triton import tree_chunk_triton

        if tree_mask is None:
            tree_mask = tree_ancestor_mask(parents, depths >= 0 if valid is None else valid)
        # the raw gate where the caller has it (`fused.GateInputs`), else its values
        raw = gate.inputs() if hasattr(gate, "inputs") else None
        if gate is not None and raw is None:
            g, beta = (t.view(*v.shape[:2], -1) for t in gate.values())
        o = tree_chunk_triton(
            q, k, v, g, beta, depths, initial_state, tree_mask, valid, initial_rows, stash, raw
        )
        return o, None
    if gate is not None:
        g, beta = (t.view(*v.shape[:2], -1) for t in gate.values())
    _write_stash(stash, g, beta)
    args = (q, k, v, g, beta, parents, depths, initial_state, return_node_states, valid, max_depth)
    bufs = dict(node_states=node_states, initial_rows=initial_rows, state_rows=state_rows)
    if choose("tree", ours, "triton"):
        from ddtree.kernels.gdn.triton_tree import tree_gated_delta_rule_triton

        return tree_gated_delta_rule_triton(*args, **bufs)
    return tree_gated_delta_rule_rows(*args, **bufs)


def _write_stash(stash, g: Tensor, beta: Tensor) -> None:
    if stash is not None:
        node_g, node_beta, rows = stash
        n = g.shape[1]
        node_g[rows, :n] = g.to(node_g.dtype)
        node_beta[rows, :n] = beta.to(node_beta.dtype)
