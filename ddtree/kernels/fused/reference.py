"""Plain PyTorch references of the fused layer kernels, op for op what HF Qwen3 / Qwen3.5 do (bit-exact with
transformers on every device): the oracle for `triton.py` and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False
) -> torch.Tensor:
    """Qwen3RMSNorm (`weight * normed.to(dtype)`), or with `offset` Qwen3.5's `(normed * (1 + weight)).to(dtype)`."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)


def add_rmsnorm_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual); the sum is rounded to x's dtype before the norm (as HF does).
    residual None: (rmsnorm(x), x)."""
    s = x if residual is None else x + residual
    return rmsnorm_reference(s, weight, eps, offset), s


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox (rotate_half) RoPE on the first cos.shape[-1] channels of x [..., T, H, D]; cos/sin [..., T, rd]."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def qk_norm_rope_reference(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    q_weight,
    k_weight,
    cos,
    sin,
    eps: float,
    offset: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-head RMSNorm then RoPE for q [..., T, Hq, D] and k [..., T, Hkv, D] (either may be None)."""
    outs = []
    for x, w in ((q, q_weight), (k, k_weight)):
        outs.append(
            None if x is None else rope_reference(rmsnorm_reference(x, w, eps, offset), cos, sin)
        )
    return outs[0], outs[1]


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] = [gate | up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gated attention's output gate: x * sigmoid(gate) (HF's rounding: sigmoid in the dtype)."""
    return x * torch.sigmoid(gate)
