"""Causal depthwise conv along each tree node's ancestor chain, as one Triton launch: the GPU twin of
`reference.tree_causal_conv1d` (which builds the windows with K-1 rounds of gathers, ~20 PyTorch
kernels per GDN layer).

Grid (b * n, cdiv(C, BLOCK)). A program walks node i's chain K-1 hops up (parent, then the committed
conv_state's columns, newest first), multiplies each input by its tap and sums in fp32, adds the bias
and applies SiLU; with `return_node_states` it also writes the node's window minus its oldest input
(the conv state to commit if node i is the last accepted one). Padding nodes (valid False) output
zeros and see their own input as zero, as the reference. No host syncs: capturable.

Every tree verify and every AR round on CUDA goes through here (`conv`), so AR and speculative rounds
share one conv numerics; the CPU keeps the reference (`root_causal_conv1d` for one-node trees).

With `state_rows` the committed conv states and the node-state stash are the state pool's own rows
(request i reads conv_state[state_rows[i]] and writes node_states[state_rows[i], :n]): no gather of
the committed rows before the kernel and no scatter of the node states after it (two launches and a
copy of the stash per GDN layer).

`in_place` (one-node trees: AR rounds, auto's width-1 rounds): the new window goes straight into
the committed row conv_state[state_rows[i]] (no stash): the round's commit then leaves the conv
state alone. A program owns distinct channels of one request's row, and the thread that reads a
committed column is the one that overwrites it (same channel index, same layout; `block` >= the
threads of a program, so no element is held by two threads), after reading it and before reading
the next older one: race-free in place. Padded CUDA-graph rows all point at the pool's scratch
row: their programs race there, on contents nobody reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.kernels.gdn import reference
from ddtree.kernels.gdn.backend import choose, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    from ddtree.kernels.pdl import gdc_wait, pdl_launch
    from ddtree.kernels.tree_attention.tuning import patch_interpreter_index

    if triton.knobs.runtime.interpret:
        patch_interpreter_index()

    @triton.jit
    def _tree_conv_kernel(
        x_ptr,
        par_ptr,
        valid_ptr,
        cs_ptr,
        rows_ptr,
        w_ptr,
        bias_ptr,
        y_ptr,
        st_ptr,
        xs_ptr,
        ys_ptr,
        n,
        C,
        sx_b,
        sx_n,
        scs_b,
        scs_c,
        sst_b,
        sst_n,
        sxs_b,
        sxs_n,
        K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        STATES: tl.constexpr,
        ROWS: tl.constexpr,
        STASH: tl.constexpr,
        IN_PLACE: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            gdc_wait()  # before any memory access: the kernel ahead has ended (kernels/pdl.py)
        pid = tl.program_id(0)
        bi = (pid // n).to(tl.int64)
        i = pid % n
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mc = c < C
        ok = tl.load(valid_ptr + bi * n + i) != 0
        row = bi  # the request's row of conv_state and node_states (the pool's with ROWS)
        if ROWS:
            row = tl.load(rows_ptr + bi).to(tl.int64)
        # slot s of the chain: s >= K-1 is node s-(K-1); s < K-1 is the committed column s
        s = i + (K - 1)
        v = tl.load(x_ptr + bi * sx_b + i * sx_n + c, mask=mc & ok, other=0.0)
        st_base = st_ptr + row * sst_b + i * sst_n + c * (K - 1)  # node i's [C, K-1] window
        acc = v.to(tl.float32) * tl.load(w_ptr + c * K + (K - 1), mask=mc, other=0.0).to(tl.float32)
        if STATES:
            tl.store(st_base + (K - 2), v.to(st_ptr.dtype.element_ty), mask=mc)
        newer = v.to(tl.float32)  # IN_PLACE: the input one position newer than the column read
        for t in tl.static_range(1, K):
            node = s - (K - 1)
            is_node = node >= 0
            par = tl.load(par_ptr + bi * n + tl.maximum(node, 0), mask=is_node, other=-1)
            s = tl.where(is_node, tl.where(par >= 0, par + (K - 1), K - 2), s - 1)
            node = s - (K - 1)
            is_node = node >= 0
            vx = tl.load(
                x_ptr + bi * sx_b + tl.maximum(node, 0) * sx_n + c, mask=mc & is_node, other=0.0
            )
            vs = tl.load(
                cs_ptr + row * scs_b + c * scs_c + tl.maximum(s, 0),
                mask=mc & (node < 0) & (s >= 0),
                other=0.0,
            )
            v = tl.where(is_node, vx.to(tl.float32), vs.to(tl.float32))
            pos = K - 1 - t  # window position (0: oldest)
            if IN_PLACE:  # one node: s = pos, the committed column just read takes the newer input
                # (the same thread loads column pos, then stores it, then reads pos - 1)
                cs_col = cs_ptr + row * scs_b + c * scs_c + pos
                tl.store(cs_col, newer.to(cs_ptr.dtype.element_ty), mask=mc)
                newer = v
            acc += v * tl.load(w_ptr + c * K + pos, mask=mc, other=0.0).to(tl.float32)
            if STATES and pos >= 1:
                tl.store(st_base + (pos - 1), v.to(st_ptr.dtype.element_ty), mask=mc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=mc, other=0.0).to(tl.float32)
        y = acc / (1.0 + tl.exp(-acc))
        y = tl.where(ok, y, 0.0)
        tl.store(y_ptr + (bi * n + i) * C + c, y.to(y_ptr.dtype.element_ty), mask=mc)
        if STASH:  # no_buffer's replay inputs: the node's own input and its output, in its row
            xs = row * sxs_b + i * sxs_n + c
            x_own = tl.load(x_ptr + bi * sx_b + i * sx_n + c, mask=mc & ok, other=0.0)
            tl.store(xs_ptr + xs, x_own.to(xs_ptr.dtype.element_ty), mask=mc)
            tl.store(ys_ptr + xs, y.to(ys_ptr.dtype.element_ty), mask=mc)


def tree_causal_conv1d_triton(
    x: Tensor,
    parents: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    valid: Tensor | None = None,
    return_node_states: bool = False,
    block: int = 512,
    state_rows: Tensor | None = None,
    node_states: Tensor | None = None,
    stash: tuple[Tensor, Tensor] | None = None,
    in_place: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Same arguments and returns as `reference.tree_causal_conv1d`, plus (see the module docstring)
    state_rows [b]: conv_state is a pool [R, C, K-1] and node_states (given) a stash [R, W >= n, C,
    K-1], both addressed by row. stash (with state_rows): (node_x, node_y) [R, W >= n, C] (one
    layout) receive each node's input and output in its row (padding nodes: zeros). in_place (n ==
    1, with state_rows, no node states or stash): each row's window becomes the one after its root
    (a padding root shifts in a zero). Requires parents[b, i] < i for valid nodes' chains
    (depth-sorted trees)."""
    b, n, C = x.shape
    K = weight.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    if in_place:
        _check_in_place(n, state_rows, return_node_states or node_states is not None or stash)
        if block < 128:  # the launch's 4 warps hold each channel once (see the module docstring)
            raise ValueError(f"in place needs block >= 128 (got {block})")
        if conv_state.stride(-1) != 1:
            raise ValueError("in place: conv_state must have a unit last stride")
    cs = conv_state if conv_state.stride(-1) == 1 else conv_state.contiguous()
    valid = torch.ones(b, n, dtype=torch.bool, device=x.device) if valid is None else valid
    valid = (
        valid.contiguous().view(torch.int8) if valid.dtype == torch.bool else valid.to(torch.int8)
    )
    y = torch.empty(b, n, C, dtype=x.dtype, device=x.device)
    if node_states is None and return_node_states:
        node_states = torch.empty(b, n, C, K - 1, dtype=conv_state.dtype, device=x.device)
    if node_states is None:  # nothing written: a dummy pointer
        node_states = cs
    elif node_states.stride(-1) != 1 or node_states.stride(-2) != K - 1:
        raise ValueError("node_states must be contiguous over its last two dims [C, K-1]")
    if stash is not None:
        if state_rows is None:
            raise ValueError("stash rows are addressed by state_rows")
        xs, ys = stash
        if xs.stride() != ys.stride() or xs.stride(-1) != 1:
            raise ValueError("stash tensors must share one layout, unit stride over C")
    else:
        xs = ys = y  # dummy pointers when unused
    if b and n:
        _tree_conv_kernel[(b * n, triton.cdiv(C, block))](
            x,
            parents.contiguous(),
            valid,
            cs,
            state_rows if state_rows is not None else parents,  # a dummy pointer when unused
            weight.contiguous(),
            bias if bias is not None else weight,
            y,
            node_states,
            xs,
            ys,
            n,
            C,
            x.stride(0),
            x.stride(1),
            cs.stride(0),
            cs.stride(1),
            node_states.stride(0),
            node_states.stride(1),
            xs.stride(0),
            xs.stride(1),
            K=K,
            HAS_BIAS=bias is not None,
            STATES=bool(return_node_states),
            ROWS=state_rows is not None,
            STASH=stash is not None,
            IN_PLACE=in_place,
            BLOCK=block,
            num_warps=4,
            **pdl_launch(x.device),
        )
    return y, node_states if return_node_states else None


def _check_in_place(n: int, state_rows, stashed) -> None:
    if n != 1 or state_rows is None or stashed:
        raise ValueError(
            "the in-place conv takes one-node trees on the pool's rows (state_rows), no node "
            "states or stash"
        )


def conv(
    x: Tensor,
    parents: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    valid: Tensor | None = None,
    return_node_states: bool = False,
    state_rows: Tensor | None = None,
    node_states: Tensor | None = None,
    stash: tuple[Tensor, Tensor] | None = None,
    in_place: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The tree conv the engine runs: this kernel on CUDA (every width, one-node trees too), the
    reference elsewhere (`root_causal_conv1d` for one node: the same numbers without the gathers).
    With state_rows the pool's rows are read and node_states' rows written (the kernel in place, the
    reference by gather and scatter); the returned node states are then node_states itself. stash
    (node_x, node_y) [R, W, C] with state_rows: each node's input and output (padding: zeros) also
    land in its row (no_buffer's replay inputs; in the kernel, no index_put). in_place (one node,
    state_rows): the committed rows become the windows after the roots (see the module docstring);
    the reference gathers, steps and writes them back."""
    if triton is not None and choose("tree_conv", use_triton(x), "triton"):
        return tree_causal_conv1d_triton(
            x,
            parents,
            conv_state,
            weight,
            bias,
            valid,
            return_node_states,
            state_rows=state_rows,
            node_states=node_states,
            stash=stash,
            in_place=in_place,
        )
    if in_place:
        _check_in_place(
            x.shape[1], state_rows, return_node_states or node_states is not None or stash
        )
        x0 = x[:, 0] if valid is None else torch.where(valid[:, :1], x[:, 0], 0)
        y, st = reference.root_causal_conv1d(x0, conv_state[state_rows], weight, bias)
        if valid is not None:
            y = torch.where(valid[:, :1], y, 0)
        conv_state[state_rows] = st
        return y[:, None], None
    y, st = _conv_reference(
        x, parents, conv_state, weight, bias, valid, return_node_states, state_rows
    )
    if stash is not None:
        n = x.shape[1]
        xs = x if valid is None else torch.where(valid[..., None], x, 0)
        stash[0][state_rows, :n] = xs.to(stash[0].dtype)
        stash[1][state_rows, :n] = y.to(stash[1].dtype)
    if not return_node_states:
        return y, None
    if node_states is None:
        return y, st
    if state_rows is None:
        node_states[:, : x.shape[1]] = st.to(node_states.dtype)
    else:
        node_states[state_rows, : x.shape[1]] = st.to(node_states.dtype)
    return y, node_states


def _conv_reference(x, parents, conv_state, weight, bias, valid, return_node_states, state_rows):
    cs = conv_state if state_rows is None else conv_state[state_rows]
    if x.shape[1] == 1:
        y, st = reference.root_causal_conv1d(x[:, 0], cs, weight, bias)
        if valid is not None:
            y = torch.where(valid[:, :1], y, 0)
        y, st = y[:, None], st[:, None]
    else:
        y, st = reference.tree_causal_conv1d(
            x, parents, cs, weight, bias, valid, return_node_states
        )
    return y, st
