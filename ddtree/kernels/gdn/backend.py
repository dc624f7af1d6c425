"""Which Gated DeltaNet backend runs: flash-linear-attention (fla) and our Triton tree kernel on CUDA, the
PyTorch reference everywhere else. One switch, DDTREE_FORCE_REFERENCE_GDN=1, forces the reference for every
GDN kernel (fla's and ours). `ran` counts the (op, backend) pairs taken, so a GPU check can print which
paths really ran.

A tree verify that keeps no per-node states (no_buffer) runs the chunk form where
DDTREE_GDN_TREE_CHUNK allows it: "auto" (default) on CUDA, "1" everywhere (CPU tests), "torch"
everywhere as the PyTorch form, "0" never; DDTREE_FORCE_REFERENCE_GDN=1 still wins. The chunk form
is the Triton kernel wherever our Triton kernels run and the tree fits its block (<= 65 nodes), the
PyTorch form (`tree_chunk`, its reference) else; DDTREE_GDN_TREE_CHUNK_FORM picks the kernel's
launches: split (default: `tree_chunk_split_triton`, the solve once per head, then the outputs)
or one (`tree_chunk_triton`, both per column tile).

On the CPU our Triton kernels (tree rule, tree conv) run in Triton's interpreter when both
TRITON_INTERPRET=1 and DDTREE_FUSED_KERNELS_INTERPRET=1 (the fused kernels' switch: engine tests and
`ddtree.tools.studies.op_count` then run the GPU's kernel sequence on CPU tensors); fla stays CUDA-only.
"""

from __future__ import annotations

import collections
import functools

import torch

from ddtree import envs

FORCE_ENV = envs.FORCE_REFERENCE_GDN.name
TREE_CHUNK_ENV = envs.GDN_TREE_CHUNK.name
ran: collections.Counter = collections.Counter()


def force_reference() -> bool:
    return envs.FORCE_REFERENCE_GDN.on()


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


TREE_CHUNK_MODES = ("auto", "1", "torch", "0")


def tree_chunk_mode() -> str:
    """DDTREE_GDN_TREE_CHUNK, checked: a bad value raises naming the variable and its values."""
    mode = envs.GDN_TREE_CHUNK.get().strip().lower() or "auto"
    if mode not in TREE_CHUNK_MODES:
        raise ValueError(f"{TREE_CHUNK_ENV}={mode!r}: use one of {TREE_CHUNK_MODES}")
    return mode


def use_tree_chunk(t: torch.Tensor) -> bool:
    """The chunk-form tree rule for a verify that needs no node states (see the module docstring)."""
    mode = tree_chunk_mode()
    if force_reference() or mode == "0":
        return False
    return mode in ("1", "torch") or t.is_cuda


def tree_chunk_kernel(t: torch.Tensor, n: int) -> bool:
    """Whether the chunk form runs as the Triton kernel (else the PyTorch form) for n nodes."""
    if tree_chunk_mode() == "torch" or not use_triton(t):
        return False
    from ddtree.kernels.gdn.tree_chunk_triton import supported

    return supported(n)


def commit_kernel_flag() -> bool:
    """DDTREE_GDN_COMMIT_KERNEL (default 1)."""
    return envs.GDN_COMMIT_KERNEL.binary()  # checked: a bad value raises naming it


def decode_in_place_flag() -> bool:
    """DDTREE_GDN_DECODE_KERNEL (default 1). On: one-node rounds step the committed rows in place
    (`dispatch.decode_step`, the in-place tree conv)."""
    return envs.GDN_DECODE_KERNEL.binary()


def commit_kernel(t: torch.Tensor) -> bool:
    """no_buffer's commit as the in-place replay kernel: the switch on, where our kernels run."""
    return commit_kernel_flag() and use_triton(t)


_CHUNK_BV = (16, 32, 64, 128)
_CHUNK_PRECISIONS = ("auto", "tf32x3", "tf32", "ieee")
_CHUNK_FORMS = ("split", "one")


def tree_chunk_form() -> str:
    """DDTREE_GDN_TREE_CHUNK_FORM, checked: split (tree_chunk_split_triton) or one."""
    form = envs.GDN_TREE_CHUNK_FORM.get().strip().lower() or "split"
    if form not in _CHUNK_FORMS:
        raise ValueError(f"{envs.GDN_TREE_CHUNK_FORM.name}={form!r}: use one of {_CHUNK_FORMS}")
    return form


def tree_chunk_options() -> dict:
    """The chunk-form tree kernel's launch switches (DDTREE_GDN_TREE_CHUNK_BV / _PRECISION) as its
    wrapper's keywords; a bad value raises naming the variable and the values it takes."""
    bv = envs.GDN_TREE_CHUNK_BV.get().strip().lower()
    prec = envs.GDN_TREE_CHUNK_PRECISION.get().strip().lower() or "auto"
    if bv not in ("", "auto") and (not bv.isdigit() or int(bv) not in _CHUNK_BV):
        raise ValueError(f"{envs.GDN_TREE_CHUNK_BV.name}={bv!r}: use auto or one of {_CHUNK_BV}")
    if prec not in _CHUNK_PRECISIONS:
        raise ValueError(
            f"{envs.GDN_TREE_CHUNK_PRECISION.name}={prec!r}: use one of {_CHUNK_PRECISIONS}"
        )
    return dict(block_v=int(bv) if bv not in ("", "auto") else None, precision=prec)


def check_switches() -> None:
    """Every GDN switch's value, checked at startup (before weights load): raises naming it."""
    tree_chunk_mode()
    tree_chunk_form()
    commit_kernel_flag()
    decode_in_place_flag()
    tree_chunk_options()
    tree_kernel_options()


_BV = (4, 8, 16, 32, 64, 128)
_WARPS = (1, 2, 4, 8)


def tree_kernel_options() -> dict:
    """The tree GDN kernel's launch switches (DDTREE_GDN_TREE_BV / _WARPS / _PREFETCH) as the Triton
    wrapper's keywords; a bad value raises naming the variable and the values it takes."""
    bv, warps = envs.GDN_TREE_BV.get().strip().lower(), envs.GDN_TREE_WARPS.get().strip()
    if bv not in ("", "auto") and (not bv.isdigit() or int(bv) not in _BV):
        raise ValueError(f"{envs.GDN_TREE_BV.name}={bv!r}: use auto or one of {_BV}")
    if not warps.isdigit() or int(warps) not in _WARPS:
        raise ValueError(f"{envs.GDN_TREE_WARPS.name}={warps!r}: use one of {_WARPS}")
    return dict(
        block_v=int(bv) if bv not in ("", "auto") else None,
        num_warps=int(warps),
        prefetch=envs.GDN_TREE_PREFETCH.on(),
    )


def choose(op: str, fast: bool, name: str) -> bool:
    """Record which backend `op` takes (`name` when `fast`, else the reference) and return `fast`."""
    ran[(op, name if fast else "reference")] += 1
    return fast


def describe(device) -> dict[str, str]:
    """The backend each op would take on `device` now."""
    t = torch.empty(0, device=device)
    fla = "fla" if use_fla(t) else "reference"
    return {
        "prefill": fla,
        "decode": fla,
        "replay": fla,
        "tree": "triton" if use_triton(t) else "reference",
        "tree_no_states": (
            ("chunk" if tree_chunk_kernel(t, 2) else "chunk_torch")
            if use_tree_chunk(t)
            else ("triton" if use_triton(t) else "reference")
        ),
        "tree_conv": "triton" if use_triton(t) else "reference",
        "decode_step": "triton" if use_triton(t) else "reference",
        "commit": "triton" if commit_kernel(t) else ("fla" if use_fla(t) else "reference"),
    }
