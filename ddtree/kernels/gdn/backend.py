"""Which Gated DeltaNet backend runs: flash-linear-attention (fla) and our Triton tree kernel on CUDA, the
PyTorch reference everywhere else. One switch, DDTREE_REFERENCE=gdn, forces the reference for every
GDN kernel (fla's and ours). `ran` counts the (op, backend) pairs taken, so a GPU check can print which
paths really ran.

One tree-verify path per `--mamba-scheduler-strategy` where our Triton kernels run
(`dispatch.tree_rule`): no_buffer (no per-node states) the chunk-form kernel
(`tree_chunk_triton`, trees up to 65 nodes), extra_buffer (and longer no_buffer trees) the Triton
recurrence (`triton_tree`); the reference everywhere else.

On the CPU our Triton kernels (tree rule, tree conv) run in Triton's interpreter when both
TRITON_INTERPRET=1 and DDTREE_FUSED_KERNELS_INTERPRET=1 (the fused kernels' switch: engine tests and
`ddtree.tools.studies.op_count` then run the GPU's kernel sequence on CPU tensors); fla stays CUDA-only.
"""

from __future__ import annotations

import collections
import functools

import torch

from ddtree import envs

ran: collections.Counter = collections.Counter()


def force_reference() -> bool:
    return envs.REFERENCE.has("gdn")


@functools.lru_cache(maxsize=None)
def fla_ops():
    """(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule) from fla, or None when it is missing or
    does not import (wrong torch / triton); fla_error() says why."""
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except Exception as e:  # noqa: BLE001 - any import failure means "no fla", the reference still works
        _errors["fla"] = f"{type(e).__name__}: {e}"
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


@functools.lru_cache(maxsize=None)
def triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        _errors["triton"] = f"{type(e).__name__}: {e}"
        return False
    return True


_errors: dict[str, str] = {}


def fla_error() -> str | None:
    fla_ops()
    return _errors.get("fla")


def use_fla(t: torch.Tensor) -> bool:
    return t.is_cuda and not force_reference() and fla_ops() is not None


def interpreted() -> bool:
    """Our Triton kernels take CPU tensors (in Triton's interpreter): see the module docstring."""
    return envs.TRITON_INTERPRET.on() and envs.FUSED_KERNELS_INTERPRET.on()


def use_triton(t: torch.Tensor) -> bool:
    return (t.is_cuda or interpreted()) and not force_reference() and triton_ok()


def commit_kernel(t: torch.Tensor) -> bool:
    """no_buffer's commit as the in-place replay kernel (kernels/gdn/commit_triton.py): where our
    Triton kernels run (the gathers + replay + index_put reference elsewhere)."""
    return use_triton(t)


def choose(op: str, fast: bool, name: str) -> bool:
    """Record which backend `op` takes (`name` when `fast`, else the reference) and return `fast`."""
    ran[(op, name if fast else "reference")] += 1
    return fast


def describe(device) -> dict[str, str]:
    """The backend each op would take on `device` now."""
    t = torch.empty(0, device=device)
    fla = "fla" if use_fla(t) else "reference"
    ours = "triton" if use_triton(t) else "reference"
    return {
        "prefill": fla,
        "decode": fla,
        "replay": fla,
        "tree": ours,
        "tree_no_states": "chunk" if use_triton(t) else "reference",
        "tree_conv": ours,
        "decode_step": ours,
        "commit": ours,
    }
