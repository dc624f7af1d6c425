"""Programmatic dependent launch (PDL, sm_90+) for our Triton kernels, and its switch.

A kernel launched with `launch_pdl=True` may be scheduled before the kernel ahead of it in the stream
has finished; its first statement is `gdc_wait()` (griddepcontrol.wait), which returns once that
grid has ended and its writes are visible, so every load and store of the kernel still follows the
one before it (and, transitively, everything earlier: each PDL kernel waits before it ends). What it
buys is the launch gap: a CUDA-graph replay of a hybrid 27B round is a thousand and more small
launches, each with a gap of idle GPU before it (docs/design-numbers.md). A kernel that calls
`gdc_launch_dependents()` lets its own dependent start even earlier (the split-KV merge:
tree_attention/merge.py). Captured graphs keep the programmatic edges. DDTREE_DISABLE=pdl launches
everything as ordinary kernels (the A/B).

Reading ahead of the wait: when the kernel ahead calls `gdc_launch_dependents()` only after its own
`gdc_wait()`, every kernel before that one has ended by the time the dependent is launched, so the
dependent may read their outputs before its own wait (never the outputs of the kernel right ahead,
and nothing may be written before the wait). The no_buffer tree verify's output kernel does this to
overlap its solve (kernels/gdn/tree_chunk_triton.py); studies/pdl_compile_report.py checks, in the
PTX, that every other kernel waits before any memory access and that one stores nothing early.
"""

from __future__ import annotations

import torch
import triton

from ddtree import envs

try:  # grid dependency control, Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
# no PDL with this Triton: kernels still reference the names under a constexpr False
except ImportError:
    HAVE_GDC = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


def pdl_ok(device: torch.device) -> bool:
    """Whether a kernel on `device` may launch as a programmatic dependent: sm_90+, not the
    interpreter, not DDTREE_DISABLE=pdl."""
    return (
        HAVE_GDC
        and device.type == "cuda"
        and not triton.knobs.runtime.interpret
        and not envs.DISABLE.has("pdl")
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def pdl_launch(device: torch.device) -> dict:
    """A kernel's launch keywords: its PDL constexpr (the `gdc_wait` first) and Triton's
    `launch_pdl`, both on where `pdl_ok`."""
    on = pdl_ok(device)
    return dict(PDL=on, launch_pdl=on)
