"""The DDTree tree build's node selection as one Triton launch (`triton.py`; sorting network and
sort keys in `bitonic.py`). The reference is the PyTorch `ddtree.speculative.tree.select_nodes`,
which the kernel equals bit for bit (indices and fp32 scores).

`select_nodes` here is what the engine hands `build_tree(select=...)` (speculative/ imports no
kernels, so the choice is the engine's): the kernel on CUDA where Triton imports, for budgets up
to `MAX_BUDGET` and D * budget up to `MAX_PREFIXES`; the reference when
DDTREE_REFERENCE=tree_build, for larger trees, and on the CPU unless both
TRITON_INTERPRET=1 and DDTREE_FUSED_KERNELS_INTERPRET=1 (tests: the kernel in Triton's
interpreter, as the fused and GDN kernels).
"""

from __future__ import annotations

import torch

from ddtree import envs
from ddtree.kernels.availability import decorated_now, kernels_run_on, triton_importable
from ddtree.speculative.tree import TreeNodes
from ddtree.speculative.tree import select_nodes as select_nodes_reference

# Sizes one program holds in registers: the per-depth candidates (~B ln B, 2048 at B = 256) and
# the final D * B prefixes (4096 at B = 256, D = 15), int64 keys sorted by a bitonic network.
# Larger trees keep the PyTorch form.
MAX_BUDGET = 256
MAX_PREFIXES = 4096

__all__ = ["select_nodes", "supported", "use_kernel"]


def _triton():
    """The kernel module, decorated in the mode TRITON_INTERPRET asks for now (it is read when a
    kernel is decorated: the module and its sorting network are reloaded when it changed)."""
    from ddtree.kernels.tree_build import bitonic
    from ddtree.kernels.tree_build import triton as mod

    return decorated_now(mod, bitonic)


def supported(budget: int, depths: int) -> bool:
    return 1 <= budget <= MAX_BUDGET and depths >= 1 and depths * budget <= MAX_PREFIXES


def use_kernel(t: torch.Tensor, budget: int, depths: int) -> bool:
    """Whether the kernel builds this tree (device, switches, size; module docstring)."""
    if envs.REFERENCE.has("tree_build") or not supported(budget, depths):
        return False
    return kernels_run_on(t) and triton_importable()


def select_nodes(
    root_tokens: torch.Tensor,
    logp: torch.Tensor,
    ids: torch.Tensor,
    budget: int,
    shadow_linear: bool,
    limit: torch.Tensor,
    budgets: torch.Tensor | None = None,
) -> TreeNodes:
    """`ddtree.speculative.tree.SelectNodes`: the kernel where `use_kernel`, else the reference."""
    b, D, _ = logp.shape
    if b and use_kernel(logp, budget, D):
        return _triton().select_nodes_triton(
            root_tokens, logp, ids, budget, shadow_linear, limit, budgets
        )
    return select_nodes_reference(root_tokens, logp, ids, budget, shadow_linear, limit, budgets)
