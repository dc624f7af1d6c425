"""What every Triton kernel package asks before it launches: whether Triton imports here, whether a kernel
takes a tensor where it lives, and its kernel module decorated in the mode TRITON_INTERPRET asks for now
(the switch is read when a kernel is decorated, so a module decorated in the other mode is reloaded)."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from ddtree import envs


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "no triton": the reference works
        return False
    return True


def kernels_run_on(t: torch.Tensor) -> bool:
    """CUDA tensors; CPU ones only under TRITON_INTERPRET=1 and DDTREE_FUSED_KERNELS_INTERPRET=1 (the
    tests: several test modules set TRITON_INTERPRET for the whole pytest process, and every CPU model
    test would then crawl through the interpreter)."""
    return t.is_cuda or (envs.TRITON_INTERPRET.on() and envs.FUSED_KERNELS_INTERPRET.on())


def decorated_now(mod: ModuleType, *deps: ModuleType) -> ModuleType:
    """`mod` (its `_decorated_interpreted` records the mode at import), reloaded after the modules whose
    kernels it calls (`deps`) when any of them was decorated in the other mode."""
    want = envs.TRITON_INTERPRET.on()
    if any(m._decorated_interpreted != want for m in (*deps, mod)):
        for m in deps:
            importlib.reload(m)
        mod = importlib.reload(mod)
    return mod
