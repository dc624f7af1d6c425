"""Qwen3.5 Gated DeltaNet token mixer (HF `Qwen3_5GatedDeltaNet` parameter layout and numerics).

The layer owns the projections and the gated output norm; where the recurrent state lives is decided by a
`LinearStateContext` (ddtree.engine.state_pool): the layer hands it the pre-conv inputs, gets the conv
outputs back, then hands it q/k/v/g/beta and gets the delta-rule outputs back. Without a context the layer
runs dense over [B, T] from a zero state (training, data generation, tests).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.configs import TargetConfig
from ddtree.kernels.gdn.dispatch import chunk_rule
from ddtree.kernels.gdn.fused import gated_rmsnorm, gdn_gating
from ddtree.models.parallel import RowParallelLinear, TPGroup


class LinearStateContext(Protocol):
    """Per-forward view of the recurrent-state pool; `j` is the ordinal of the GDN layer among GDN layers.
    Tensors are token-major over the forward's flat tokens: x [T, C]; q/k [T, Hk, dk]; v [T, Hv, dv];
    g/beta [T, Hv]."""

    def conv(
        self, j: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Causal depthwise conv + SiLU of pre-conv inputs x [T, C] (weight [C, K]) -> [T, C]."""
        ...

    def rule(self, j: int, q, k, v, g, beta) -> torch.Tensor:
        """Gated delta rule (q/k l2-normalised inside, default scale) -> o [T, Hv, dv]."""
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
    channels, z / a / b / A_log / dt_bias their rows, out_proj their columns (all-reduce after)."""

    def __init__(self, cfg: TargetConfig, tp: TPGroup | None = None):
        super().__init__()
        self.hk, self.dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.hv, self.dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        h = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.hv, bias=False)
        self.in_proj_a = nn.Linear(h, self.hv, bias=False)
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
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        # one fused launch on the GPU (kernels/gdn/fused.py); the reference elsewhere
        g, beta = gdn_gating(self.in_proj_a(x), self.in_proj_b(x), self.A_log, self.dt_bias)
        weight = self.conv1d.weight[:, 0, :]
        if linear is not None:
            q, k, v = self._split(linear.conv(j, mixed, weight, self.conv1d.bias))
            o = linear.rule(j, q, k, v, g, beta)
        else:
            batched = x.dim() == 3
            if not batched:
                mixed, g, beta = mixed[None], g[None], beta[None]
            q, k, v = self._split(dense_conv_silu(mixed, weight, self.conv1d.bias))
            o, _ = chunk_rule(q, k, v, g, beta)
            if not batched:
                o = o[0]
        o = self.norm(o, z.reshape(*z.shape[:-1], self.hv, self.dv))
        return self.out_proj(o.reshape(*o.shape[:-2], self.value_dim))
