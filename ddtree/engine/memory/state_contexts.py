"""The per-forward views of the hybrid state pool (`HybridStatePool`, state_pool.py) the GDN layers
run through (`models/gated_deltanet.LinearStateContext`): `ExtendContext` (prefill: the committed rows
read and written back) and `TreeContext` (tree verify: the committed rows read, the per-node stash
written; a one-node verify, `HybridStatePool.in_place`: the committed rows stepped in place)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ddtree.kernels.gdn import causal_conv1d_step, causal_conv1d_varlen
from ddtree.kernels.gdn.dispatch import chunk_rule, decode_step, recurrent_rule, tree_rule
from ddtree.kernels.gdn.tree_conv import conv as tree_conv


class StateRows(Protocol):
    """What the contexts read of the pool (`HybridStatePool`): its per-layer tensors and policy."""

    device: torch.device
    dtype: torch.dtype  # conv windows and stashed inputs
    ssm_dtype: torch.dtype
    stash_dtype: torch.dtype
    strategy: str  # "extra_buffer" or "no_buffer" (MAMBA_STRATEGIES)
    conv: Tensor  # [layers, rows, ...]
    ssm: Tensor  # [layers, rows, ...]
    stash: dict[str, Tensor]  # per-node stash buffers by name

    def in_place(self, nodes: int) -> bool: ...


class ExtendContext:
    """Prefill / chunked prefill: packed sequences, state read from and written back to the pool rows."""

    def __init__(
        self, pool: StateRows, slots: Tensor, q_lens: list[int], kv_lens_before: list[int]
    ):
        self.pool, self.slots = pool, slots
        dev = pool.device
        self.cu_seqlens = torch.tensor([0, *q_lens], dtype=torch.int64).cumsum(0).to(dev)
        self.fresh = torch.tensor([kv == 0 for kv in kv_lens_before], dtype=torch.bool).to(dev)
        # one token per request: the step kernels, no varlen
        self.decode = all(n == 1 for n in q_lens)

    def _initial(self, t: Tensor) -> Tensor:
        return torch.where(self.fresh.view(-1, *[1] * (t.dim() - 1)), 0, t)

    def conv(self, j, x, weight, bias):
        x = x.contiguous()  # a slice of the fused in_proj output; the varlen conv wants rows
        state0 = self._initial(self.pool.conv[j, self.slots])
        if self.decode:
            y, state = causal_conv1d_step(x, state0, weight, bias)
        else:
            y, state = causal_conv1d_varlen(x, weight, self.cu_seqlens, state0, bias)
        self.pool.conv[j, self.slots] = state.to(self.pool.dtype)
        return y

    def rule(self, j, q, k, v, gate):
        g, beta = gate.values()
        S0 = self._initial(self.pool.ssm[j, self.slots])
        if self.decode:  # [b, 1, ...]: b sequences of one token
            o, S = recurrent_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], S0)
            o = o[:, 0]
        else:  # [1, T, ...]: packed sequences
            o, S = chunk_rule(
                q[None], k[None], v[None], g[None], beta[None], S0, cu_seqlens=self.cu_seqlens
            )
            o = o[0]
        self.pool.ssm[j, self.slots] = S.to(self.pool.ssm_dtype)
        return o


class TreeContext:
    """Tree verify over b requests x n nodes (flat request-major tokens): every node continues from its
    parent's state; the committed rows are only read, the per-node stash is written. One-node trees
    with `pool.in_place(1)`: the roots step the committed rows in place (conv window and rule
    state, read and written once) and nothing is stashed; the round's commit skips the GDN state."""

    def __init__(self, pool: StateRows, slots: Tensor, tree):
        self.pool, self.slots = pool, slots
        self.b, self.n = tree.tokens.shape
        self.parents, self.depths, self.valid = tree.parents, tree.depths, tree.valid
        # the round's ancestor mask, built once by the tree build: no layer rebuilds it
        self.tree_mask = tree.tree_mask
        self.max_depth = tree.depth_bound
        self.extra = pool.strategy == "extra_buffer"
        self.in_place = pool.in_place(self.n)

    def _stash(self, name: str, j: int, t: Tensor) -> None:
        self.pool.stash[name][j, self.slots, : self.n] = t.to(self.pool.stash[name].dtype)

    def conv(self, j, x, weight, bias):
        xb = x.view(self.b, self.n, -1)
        if self.in_place:  # the roots' windows straight into the committed rows
            y, _ = tree_conv(
                xb, self.parents, self.pool.conv[j], weight, bias, self.valid,
                state_rows=self.slots, in_place=True,
            )  # fmt: skip
            return y.view(self.b, -1)
        # the conv along ancestor chains: one Triton launch on CUDA (AR's one-node trees too, so
        # every round shares its numerics), the reference elsewhere (kernels/gdn/tree_conv.py)
        # the committed rows are read and the node windows written through the slot index (no
        # gather / scatter launches on CUDA)
        y, _ = tree_conv(
            xb,
            self.parents,
            self.pool.conv[j],
            weight,
            bias,
            self.valid,
            return_node_states=self.extra,
            state_rows=self.slots,
            node_states=self.pool.stash["node_conv"][j] if self.extra else None,
            # no_buffer: the replay's inputs written by the kernel into the stash rows
            stash=None
            if self.extra
            else (self.pool.stash["node_x"][j], self.pool.stash["node_y"][j]),
        )
        return y.view(self.b * self.n, -1)

    def rule(self, j, q, k, v, gate):
        if self.in_place:  # one token per request: [b, ...] rows, the state stepped in place
            return decode_step(q, k, v, gate, self.pool.ssm[j], self.slots)
        qb, kb, vb = (t.view(self.b, self.n, *t.shape[1:]) for t in (q, k, v))
        # an fp32 stash takes the node states in place (the kernel re-reads parents from it); a
        # --mamba-ssm-dtype stash goes through an fp32 scratch, so the tree itself never runs on
        # rounded states
        direct = self.extra and self.pool.stash_dtype == torch.float32
        # no_buffer: g and beta go to the replay's stash rows inside the chunk kernel, which also
        # gates (the layer's raw gate: no gating launch)
        stash = None
        if not self.extra:
            stash = (self.pool.stash["node_g"][j], self.pool.stash["node_beta"][j], self.slots)
        o, node_states = tree_rule(
            qb,
            kb,
            vb,
            None,
            None,
            self.parents,
            self.depths,
            self.pool.ssm[j],
            return_node_states=self.extra and not direct,
            valid=self.valid,
            max_depth=self.max_depth,
            initial_rows=self.slots,
            node_states=self.pool.stash["node_ssm"][j] if direct else None,
            state_rows=self.slots if direct else None,
            tree_mask=self.tree_mask,
            stash=stash,
            gate=gate,
        )
        if self.extra and not direct:
            self._stash("node_ssm", j, node_states)
        return o.view(self.b * self.n, *o.shape[2:])
