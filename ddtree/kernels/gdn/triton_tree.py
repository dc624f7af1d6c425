"""Tree gated delta rule as one Triton kernel: the GPU twin of `reference.tree_gated_delta_rule`.

Grid (b, Hv, cdiv(dv, BV)). Each program owns one value head and a [dk, BV] column tile of its recurrent
state and walks the request's n nodes in flat order: it loads the parent's post-state tile (the node-state
buffer, or initial_state for a root), l2-normalises the node's q/k rows (its key head under GQA), applies
the decay exp(g), the delta correction with beta, writes the node's post-state tile and its output.
Column tiles of the state are independent in the delta rule (k.S and q.S reduce over dk only), so no
program ever waits on another.

Requirement beyond the reference: parents[b, i] < i for every valid node (topological flat order; the
engine's trees are depth-sorted). Padding nodes (valid False; valid defaults to depths >= 0) read none of
their inputs, output zeros and leave a zero node state, like the reference. No host syncs: the wrapper
can be captured in a CUDA graph. DDTREE_REFERENCE=gdn routes every call to the reference.
"""

import torch
from torch import Tensor

from ddtree.kernels.gdn.backend import force_reference
from ddtree.kernels.gdn.reference import tree_gated_delta_rule_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    from ddtree.kernels.tree_attention.tuning import patch_interpreter_index

    if triton.knobs.runtime.interpret:
        patch_interpreter_index()

    # tl.sum / tl.zeros are @jit helpers the interpreter cannot call when triton was imported before
    # TRITON_INTERPRET was set; tl.reduce with the standard combine function is the same IR on GPU.
    @triton.jit
    def _node_inputs(
        j,
        n,
        node_base,
        valid_ptr,
        par_ptr,
        st_base,
        st_n,
        mk,
        mv,
        mtile,
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        pid_b,
        h,
        hk,
        rk,
        rv,
        sq_b,
        sq_n,
        sq_h,
        sk_b,
        sk_n,
        sk_h,
        sv_b,
        sv_n,
        sv_h,
        HV,
    ):
        # node j's inputs and its parent's post-state (not when the parent is node j - 1: that one
        # is still in registers, or not yet computed when prefetching); j >= n: nothing (ok False)
        row = node_base + j
        inb = j < n
        ok = (tl.load(valid_ptr + row, mask=inb, other=0) != 0) & inb
        par = tl.load(par_ptr + row, mask=inb, other=-1).to(tl.int64)
        has_par = ok & (par >= 0)
        S = tl.load(
            st_base + tl.maximum(par, 0) * st_n,
            mask=mtile & has_par & (par != j - 1),
            other=0.0,
        ).to(tl.float32)
        mk_ok = mk & ok
        q = tl.load(q_ptr + pid_b * sq_b + j * sq_n + hk * sq_h + rk, mask=mk_ok, other=0.0)
        k = tl.load(k_ptr + pid_b * sk_b + j * sk_n + hk * sk_h + rk, mask=mk_ok, other=0.0)
        v = tl.load(v_ptr + pid_b * sv_b + j * sv_n + h * sv_h + rv, mask=mv & ok, other=0.0)
        gb = row * HV + h
        g = tl.load(g_ptr + gb, mask=ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + gb, mask=ok, other=0.0).to(tl.float32)
        return ok, par, has_par, S, q.to(tl.float32), k.to(tl.float32), v.to(tl.float32), g, beta

    @triton.jit
    def _tree_gdn_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        par_ptr,
        valid_ptr,
        s0_ptr,
        s0_rows_ptr,
        states_ptr,
        st_rows_ptr,
        o_ptr,
        n,
        HV,
        DK,
        DV,
        GROUP,
        sq_b,
        sq_n,
        sq_h,
        sk_b,
        sk_n,
        sk_h,
        sv_b,
        sv_n,
        sv_h,
        so_b,
        so_n,
        so_h,
        s0_b,
        st_b,
        st_n,
        scale,
        BK: tl.constexpr,
        BV: tl.constexpr,
        L2NORM: tl.constexpr,
        S0_ROWS: tl.constexpr,
        ST_ROWS: tl.constexpr,
    ):
        pid_b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        pid_v = tl.program_id(2)
        hk = h // GROUP
        rk = tl.arange(0, BK)
        rv = pid_v * BV + tl.arange(0, BV)
        mk = rk < DK
        mv = rv < DV
        tile = rk[:, None] * DV + rv[None, :]  # offset inside one [dk, dv] state
        mtile = mk[:, None] & mv[None, :]
        state_sz = DK * DV
        s0_row = pid_b
        if S0_ROWS:
            s0_row = tl.load(s0_rows_ptr + pid_b).to(tl.int64)
        s0 = tl.load(s0_ptr + s0_row * s0_b + h * state_sz + tile, mask=mtile, other=0.0).to(
            tl.float32
        )
        st_row = pid_b
        if ST_ROWS:
            st_row = tl.load(st_rows_ptr + pid_b).to(tl.int64)
        st_base = (
            states_ptr + st_row * st_b + h * state_sz + tile
        )  # node i's tile at st_base + i * st_n
        node_base = pid_b * n  # row of [b, n] tensors
        S_prev = s0
        # node i + 1's loads (its parent's state included, unless the parent is node i) are
        # issued before node i's math, so their latency hides behind it: the walk is a chain of
        # dependent steps, latency-bound at small batch (the faster form on the H200: BENCHMARKS)
        nxt = _node_inputs(
            0, n, node_base, valid_ptr, par_ptr, st_base, st_n, mk, mv, mtile, q_ptr,
            k_ptr, v_ptr, g_ptr, beta_ptr, pid_b, h, hk, rk, rv, sq_b, sq_n, sq_h, sk_b,
            sk_n, sk_h, sv_b, sv_n, sv_h, HV,
        )  # fmt: skip
        for i in range(n):
            cur = nxt
            nxt = _node_inputs(
                i + 1, n, node_base, valid_ptr, par_ptr, st_base, st_n, mk, mv,
                mtile, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pid_b, h, hk, rk, rv,
                sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h, HV,
            )  # fmt: skip
            ok, par, has_par, S, q, k, v, g, beta = cur
            # parent's post-state: written earlier by this very program (parent < i); a parent
            # just before its child (chains) is still in registers and is not re-read
            chain = has_par & (par == i - 1)
            S = tl.where(chain, S_prev, tl.where(has_par, S, s0))
            if L2NORM:
                q = q * (1.0 / tl.sqrt(tl.reduce(q * q, 0, tl.standard._sum_combine) + 1e-6))
                k = k * (1.0 / tl.sqrt(tl.reduce(k * k, 0, tl.standard._sum_combine) + 1e-6))
            q = q * scale
            S = S * tl.exp(g)
            u = (v - tl.reduce(S * k[:, None], 0, tl.standard._sum_combine)) * beta
            S = S + k[:, None] * u[None, :]
            o = tl.reduce(S * q[:, None], 0, tl.standard._sum_combine)
            # padding nodes: zero output and zero state (the reference never writes them)
            o = tl.where(ok, o, 0.0)
            S = tl.where(ok, S, 0.0)
            S_prev = S
            tl.store(st_base + i * st_n, S.to(states_ptr.dtype.element_ty), mask=mtile)
            tl.store(
                o_ptr + pid_b * so_b + i * so_n + h * so_h + rv,
                o.to(o_ptr.dtype.element_ty),
                mask=mv,
            )
            tl.debug_barrier()  # this node's state is visible to all threads before a child reads it


def _last_unit(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _pick_bv(b: int, hv: int, dv: int) -> int:
    """Column tile width: 32 unless that leaves too few programs to fill an H200 (132 SMs) twice."""
    bv = min(32, triton.next_power_of_2(dv))
    while bv > 8 and b * hv * triton.cdiv(dv, bv) < 264:
        bv //= 2
    return bv


def _inner_contiguous(t: Tensor, name: str) -> None:
    if (
        t.stride(-1) != 1
        or t.stride(-2) != t.shape[-1]
        or t.stride(-3) != t.shape[-1] * t.shape[-2]
    ):
        raise ValueError(f"{name} must be contiguous over its last three dims [Hv, dk, dv]")


def tree_gated_delta_rule_triton(
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
    block_v: int | None = None,
    num_warps: int = 4,
) -> tuple[Tensor, Tensor | None]:
    """Same arguments and returns as `reference.tree_gated_delta_rule` (max_depth is unused here), plus:
    node_states: optional buffer the node post-states are written to (the kernel always needs one, since
      children read their parent's state): [b, n, Hv, dk, dv], or with state_rows [b] a pool [R, W >= n,
      Hv, dk, dv] of which request i writes row state_rows[i] (nodes 0..n-1). Any float dtype; children
      re-read their parent's state from it (unless it is the node just before), so anything but fp32
      rounds along the tree. Returned as is.
    initial_rows [b]: initial_state is a pool [R, Hv, dk, dv] and request i starts from row initial_rows[i].
    block_v / num_warps: tile overrides (studies/gpu_gdn_tree.py (b)).
    Requires parents[b, i] < i for valid nodes. No host syncs."""
    if triton is None or force_reference():
        return tree_gated_delta_rule_rows(
            q,
            k,
            v,
            g,
            beta,
            parents,
            depths,
            initial_state,
            return_node_states,
            valid,
            max_depth,
            use_qk_l2norm,
            scale,
            node_states,
            initial_rows,
            state_rows,
        )
    b, n, Hk, dk = k.shape
    Hv, dv = v.shape[-2], v.shape[-1]
    if Hv % Hk:
        raise ValueError(f"value heads {Hv} not a multiple of key heads {Hk}")
    q, k, v = _last_unit(q), _last_unit(k), _last_unit(v)
    g, beta = g.contiguous(), beta.contiguous()
    parents = parents.contiguous()
    valid = (depths >= 0) if valid is None else valid
    valid = valid.to(torch.int8).contiguous()
    s0 = initial_state if initial_rows is not None else initial_state.contiguous()
    _inner_contiguous(s0, "initial_state")
    if node_states is None:
        node_states = torch.empty(b, n, Hv, dk, dv, dtype=torch.float32, device=v.device)
    _inner_contiguous(node_states, "node_states")
    out = torch.empty(b, n, Hv, dv, dtype=q.dtype, device=v.device)
    if b and n:
        bv = block_v or _pick_bv(b, Hv, dv)
        grid = (b, Hv, triton.cdiv(dv, bv))
        s0_rows = (
            initial_rows if initial_rows is not None else parents
        )  # a dummy pointer when unused
        st_rows = state_rows if state_rows is not None else parents
        _tree_gdn_kernel[grid](
            q,
            k,
            v,
            g,
            beta,
            parents,
            valid,
            s0,
            s0_rows,
            node_states,
            st_rows,
            out,
            n,
            Hv,
            dk,
            dv,
            Hv // Hk,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            s0.stride(0),
            node_states.stride(0),
            node_states.stride(1),
            float(dk**-0.5 if scale is None else scale),
            BK=triton.next_power_of_2(dk),
            BV=bv,
            L2NORM=bool(use_qk_l2norm),
            S0_ROWS=initial_rows is not None,
            ST_ROWS=state_rows is not None,
            num_warps=num_warps,
        )
    return out, node_states if return_node_states else None
