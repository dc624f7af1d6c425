"""DFlash2's grouped dynamic causal convolution (`reference.py`: the semantics; `triton.py`: one
launch). `dynamic_conv` dispatches: the reference when DDTREE_REFERENCE=kernels, when
autograd needs a graph (training), without Triton, for layouts the kernel does not take, and on the
CPU unless both TRITON_INTERPRET=1 and DDTREE_FUSED_KERNELS_INTERPRET=1 (tests: the kernel under
Triton's interpreter); the kernel otherwise (`ddtree.kernels.fused.use_triton`'s rule)."""

from __future__ import annotations

import torch

from ddtree.kernels.availability import decorated_now
from ddtree.kernels.dynamic_conv.reference import dynamic_conv_reference
from ddtree.kernels.fused import use_triton

__all__ = ["dynamic_conv", "dynamic_conv_reference"]


def _triton():
    """The kernel module, decorated in the mode TRITON_INTERPRET asks for now."""
    from ddtree.kernels.dynamic_conv import triton as mod

    return decorated_now(mod)


def dynamic_conv(
    x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, group_size: int, block_size: int
) -> torch.Tensor:
    """y [..., L, H] from x [..., L, H] (whole blocks of `block_size` rows), dyn [..., L, k * G]
    (tap-major), base [k, H] (module docstring of `reference.py`)."""
    if (
        use_triton(x, dyn, base)
        and x.stride(-1) == 1
        and dyn.stride(-1) == 1
        and x.reshape(-1, x.shape[-1]).stride(-1) == 1
    ):
        return _triton().dynamic_conv(x, dyn, base, group_size, block_size)
    return dynamic_conv_reference(x, dyn, base, group_size, block_size)
