"""Fused decoder-layer kernels: residual add + RMSNorm, per-head q/k RMSNorm + RoPE, SiLU-and-mul, the
gated attention's sigmoid output gate.

`reference.py` is plain PyTorch with HF numerics (bit-exact with transformers); `triton.py` holds the kernels.
The functions here dispatch: the reference when DDTREE_REFERENCE=kernels, when autograd needs a graph
(training), when Triton is missing, or for layouts the kernels do not take; on the CPU unless both
TRITON_INTERPRET=1 and DDTREE_FUSED_KERNELS_INTERPRET=1 (tests: the kernels under Triton's interpreter; the
second switch because several test modules set TRITON_INTERPRET for the whole pytest process, and every CPU
model test would then crawl through the interpreter); the Triton kernel otherwise.
"""

from __future__ import annotations

import torch

from ddtree import envs
from ddtree.kernels.availability import kernels_run_on
from ddtree.kernels.fused.reference import (
    add_rmsnorm_reference,
    qk_norm_rope_reference,
    rmsnorm_reference,
    sigmoid_gate_reference,
    silu_mul_reference,
)

INTERPRET_ENV = envs.FUSED_KERNELS_INTERPRET.name

__all__ = [
    "add_rmsnorm",
    "qk_norm_rope",
    "rmsnorm",
    "sigmoid_gate",
    "silu_mul",
    "use_triton",
]

_kernels = None
_kernels_interpreted = False


def _triton(interpreted: bool = False):
    """The kernel module (False without Triton); reloaded when the CPU interpreter is wanted and the module was
    decorated without it (TRITON_INTERPRET is read when a kernel is decorated)."""
    global _kernels, _kernels_interpreted
    if _kernels is None or (interpreted and _kernels and not _kernels_interpreted):
        try:
            import importlib

            from ddtree.kernels.fused import triton as mod

            if interpreted and getattr(mod, "_decorated_interpreted", None) is False:
                mod = importlib.reload(mod)
        except ImportError:
            mod = False
        _kernels = mod
        _kernels_interpreted = bool(mod) and bool(getattr(mod, "_decorated_interpreted", False))
    return _kernels


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Whether the Triton kernels take these tensors (device, env switches, autograd), not their layout."""
    ts = [t for t in tensors if t is not None]
    if envs.REFERENCE.has("kernels"):
        return False
    if not kernels_run_on(ts[0]):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return bool(_triton(interpreted=not ts[0].is_cuda))


def _unit_last(*tensors) -> bool:
    return all(t is None or t.stride(-1) == 1 or t.shape[-1] == 1 for t in tensors)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual) in one kernel; residual None -> (rmsnorm(x), x)."""
    if (
        use_triton(x, residual, weight)
        and _unit_last(x, residual)
        and weight.is_contiguous()
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
    ):
        return _triton().add_rmsnorm(x, residual, weight, eps, offset)
    return add_rmsnorm_reference(x, residual, weight, eps, offset)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False
) -> torch.Tensor:
    if use_triton(x, weight) and _unit_last(x) and weight.is_contiguous():
        return _triton().add_rmsnorm(x, None, weight, eps, offset)[0]
    return rmsnorm_reference(x, weight, eps, offset)


def qk_norm_rope(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    offset: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-head RMSNorm, then rotate_half RoPE on the first cos.shape[-1] channels, for q [..., T, Hq, D] and
    k [..., T, Hkv, D] (either may be None) in one launch; returns new tensors."""
    ref = k if k is not None else q
    d, rd = ref.shape[-1], cos.shape[-1]
    ok = (
        use_triton(q, k, q_weight, k_weight, cos, sin)
        and d >= 16
        and d & (d - 1) == 0
        and rd % 2 == 0
        and rd <= d
        and _unit_last(q, k, cos, sin)
        and cos.shape == sin.shape
        and cos.stride() == sin.stride()
        and all(
            x is None
            or (x.shape[:-2] == cos.shape[:-1] and x.shape[-1] == d and x.dtype == cos.dtype)
            for x in (q, k)
        )
        and all(
            w is None or (w.is_contiguous() and (offset or w.dtype == ref.dtype))
            for w in (q_weight, k_weight)
        )
    )
    if ok:
        return _triton().qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, offset)
    return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps, offset)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] = [gate | up]."""
    if use_triton(gate_up) and _unit_last(gate_up) and gate_up.shape[-1] % 2 == 0:
        return _triton().silu_mul(gate_up)
    return silu_mul_reference(gate_up)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) for x, gate [..., H, D] (gate at any strides: a slice of the q projection)
    in one launch; the result is contiguous."""
    if (
        use_triton(x, gate)
        and x.dim() >= 2
        and x.shape == gate.shape
        and x.dtype == gate.dtype
        and _unit_last(x, gate)
    ):
        H, D = x.shape[-2:]
        x3, g3 = x.reshape(-1, H, D), gate.reshape(-1, H, D)
        if x3.stride(-1) == 1 and g3.stride(-1) == 1:
            return _triton().sigmoid_gate(x3, g3).view(x.shape)
    # contiguous: the CPU's elementwise kernels round differently on strided inputs
    return sigmoid_gate_reference(x, gate.contiguous())
