"""Loading Triton kernel modules for tests: on a machine without a GPU they run in Triton's CPU interpreter."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# Tests that run the engine's CPU tensors through Triton's interpreter: on a CUDA machine the kernels
# compile for the GPU instead (and the dispatcher sends CPU tensors to the reference), so they test
# nothing there; tests/gpu covers the device paths.
cpu_interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-interpreter test; tests/gpu covers CUDA"
)


def load_kernel_module(name: str):
    """Import `name` (skipping the test module when triton is missing). TRITON_INTERPRET must be set before a
    kernel module is decorated, so a module imported earlier in this process is reloaded."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    was_loaded = name in sys.modules
    module = importlib.import_module(name)
    if was_loaded and not torch.cuda.is_available():
        module = importlib.reload(module)
    return module


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
