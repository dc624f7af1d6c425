"""Qwen3.5 Gated DeltaNet token mixer (HF `Qwen3_5GatedDeltaNet` parameter layout and numerics).

The layer owns the projections and the gated output norm; where the recurrent state lives is decided by a
`LinearStateContext` (ddtree.engine.memory.state_pool): the layer hands it the pre-conv inputs, gets the conv
outputs back, then hands it q/k/v/g/beta and gets the delta-rule outputs back. Without a context the layer
runs dense over [B, T] from a zero state (training, data generation, tests).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels.gdn.dispatch import chunk_rule
from ddtree.kernels.gdn.fused import GateInputs, gated_rmsnorm
from ddtree.models.configs import TargetConfig
from ddtree.models.layers import fuse_linears
from ddtree.models.parallel import RowParallelLinear, TPGroup

# HF's four input projections, in the row order of the one GEMM inference runs: q|k|v (conv input),
# z (output gate), b (beta), a (decay)
IN_PROJ_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


class LinearStateContext(Protocol):
    """Per-forward view of the recurrent-state pool; `j` is the ordinal of the GDN layer among GDN layers.
    Tensors are token-major over the forward's flat tokens: x [T, C]; q/k [T, Hk, dk]; v [T, Hv, dv];
    g/beta [T, Hv]."""

    def conv(
        self, j: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Causal depthwise conv + SiLU of pre-conv inputs x [T, C] (weight [C, K]) -> [T, C]."""
        ...

    def rule(self, j: int, q, k, v, gate: GateInputs) -> torch.Tensor:
        """Gated delta rule (q/k l2-normalised inside, default scale) -> o [T, Hv, dv]; the decay
        gate's g / beta [T, Hv] are `gate.values()` (or computed inside a kernel from its inputs:
        the one-token in-place rule)."""
        ...


class GatedRMSNorm(nn.Module):
    """RMSNorm over the value head dim, then times silu(z); plain (not 1 + w) weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # one fused launch on the GPU (kernels/gdn/fused.py); the reference elsewhere
        return gated_rmsnorm(x, z, self.weight, self.eps)


def dense_conv_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Causal depthwise conv from a zero state over [B, T, C] (fp32 math like the reference kernels)."""
    K = weight.shape[-1]
    y = F.conv1d(
        x.float().transpose(1, 2),
        weight.float()[:, None, :],
        None if bias is None else bias.float(),
        padding=K - 1,
        groups=x.shape[-1],
    )[..., : x.shape[1]]
    return F.silu(y).transpose(1, 2).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Under TP, `cfg` holds this rank's key / value heads: in_proj_qkv and the conv hold their
    channels, z / a / b / A_log / dt_bias their rows, out_proj their columns (all-reduce after).

    Inference runs the four input projections as one GEMM (a 27B AR step ran them as four, two of
    48 rows with split-K + reduce, in each of 48 layers): on the first forward without autograd the
    four weights move into one [sum of rows, hidden] tensor and become its row views
    (`fused_in_proj`), so names, checkpoints, TP slices and memory stay HF's. Training keeps the
    four GEMMs (the same numbers, and the same trained toy pairs, as before). The GEMM's outputs are
    read as strided slices: the conv, the gating and the gated norm take row strides (no copies)."""

    def __init__(self, cfg: TargetConfig, tp: TPGroup | None = None):
        super().__init__()
        self.hk, self.dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.hv, self.dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        h = cfg.hidden_size
        self.in_splits = (self.conv_dim, self.value_dim, self.hv, self.hv)
        for name, rows in zip(IN_PROJ_PARTS, self.in_splits):
            setattr(self, name, nn.Linear(h, rows, bias=False))
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            self.kernel,
            groups=self.conv_dim,
            padding=self.kernel - 1,
            bias=False,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(self.value_dim, h, tp=tp)
        self._fused: torch.Tensor | None = None

    def fused_in_proj(self) -> torch.Tensor:
        """The one [sum(in_splits), hidden] weight whose row views the four parts' weights are,
        (re)built when they are not (first use, or after `.to()` / `to_empty()` gave them storages
        of their own). Built in the first eager forward (capture_graph warms up before capturing)."""
        parts = [getattr(self, name).weight for name in IN_PROJ_PARTS]
        w = self._fused
        if w is None or not _row_views(w, parts):
            with torch.inference_mode(False), torch.no_grad():
                w = torch.cat([p.detach() for p in parts])
                off = 0
                for p in parts:
                    p.data = w[off : off + p.shape[0]]
                    off += p.shape[0]
            self._fused = w
        return w

    @staticmethod
    def parts() -> tuple[str, ...]:
        return IN_PROJ_PARTS

    def regroup_in_proj(self) -> None:
        """For block FP8 (`models/quant.py`): q|k|v|z become the rows of one linear, `in_proj_qkvz`
        (quantized), and b|a of another, `in_proj_ba` (few rows: Qwen's FP8 checkpoints keep them in
        the model dtype), each one GEMM; state-dict names stay HF's four (`fuse_linears`)."""
        if "in_proj_qkvz" in self._modules:
            return
        for fused, names in (
            ("in_proj_qkvz", IN_PROJ_PARTS[:2]),
            ("in_proj_ba", IN_PROJ_PARTS[2:]),
        ):
            parts = [getattr(self, n) for n in names]
            with torch.device("meta"):
                lin = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), False)
            lin.weight = nn.Parameter(
                torch.cat([p.weight.detach() for p in parts]), requires_grad=False
            )
            for n in names:
                delattr(self, n)
            setattr(self, fused, lin)
            fuse_linears(self, fused, tuple((n, p.out_features) for n, p in zip(names, parts)))
        self._fused = None

    def _in_proj(self, x: torch.Tensor):
        """(q|k|v pre-conv, z, b, a): one GEMM without autograd, HF's four with it; two when
        regrouped for FP8."""
        if "in_proj_qkvz" in self._modules:
            mixed, z = torch.split(self.in_proj_qkvz(x), self.in_splits[:2], dim=-1)
            b, a = torch.split(self.in_proj_ba(x), self.in_splits[2:], dim=-1)
            return mixed, z, b, a
        if torch.is_grad_enabled() and self.in_proj_qkv.weight.requires_grad:
            return tuple(getattr(self, name)(x) for name in IN_PROJ_PARTS)
        return torch.split(F.linear(x, self.fused_in_proj()), self.in_splits, dim=-1)

    def _split(self, y: torch.Tensor):
        shape = y.shape[:-1]
        q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(*shape, self.hk, self.dk),
            k.reshape(*shape, self.hk, self.dk),
            v.reshape(*shape, self.hv, self.dv),
        )

    def forward(self, x: torch.Tensor, j: int, linear: LinearStateContext | None) -> torch.Tensor:
        """x [T, H] flat tokens with a context, or [B, T, H] / [T, H] dense from a zero state without one."""
        mixed, z, b, a = self._in_proj(x)
        # g / beta where the rule needs them: one fused launch on the GPU (kernels/gdn/fused.py),
        # the reference elsewhere; the one-token in-place rule gates inside its kernel
        gate = GateInputs(a, b, self.A_log, self.dt_bias)
        weight = self.conv1d.weight[:, 0, :]
        if linear is not None:
            q, k, v = self._split(linear.conv(j, mixed, weight, self.conv1d.bias))
            o = linear.rule(j, q, k, v, gate)
        else:
            g, beta = gate.values()
            batched = x.dim() == 3
            if not batched:
                mixed, g, beta = mixed[None], g[None], beta[None]
            # contiguous: F.conv1d's CPU result depends on the input's layout, and the dense path
            # trains and feeds the toy drafters (the same numbers as the four-GEMM layer's)
            conv = dense_conv_silu(mixed.contiguous(), weight, self.conv1d.bias)
            q, k, v = self._split(conv)
            o, _ = chunk_rule(q, k, v, g, beta)
            if not batched:
                o = o[0]
        o = self.norm(o, z.reshape(*z.shape[:-1], self.hv, self.dv))
        return self.out_proj(o.reshape(*o.shape[:-2], self.value_dim))


def _row_views(w: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    """Whether `parts` are consecutive row blocks of w (the same storage, dtype and device)."""
    off = w.data_ptr()
    for p in parts:
        if p.dtype != w.dtype or p.device != w.device or p.data_ptr() != off:
            return False
        off += p.numel() * p.element_size()
    return True
