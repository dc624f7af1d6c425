"""DeepGEMM's SM90 block-FP8 GEMM (`deep_gemm.fp8_gemm_nt`, 1x128 activation and 128x128 weight
scales), the library SGLang and vLLM verify with: an optional dependency (the `gpu` extra).

It reads the activations as `triton.group_quant` writes them for cuBLAS (rows padded to 4, scales
MN-major: its TMA-aligned layout) and the checkpoint's weight and scales as they are. Its kernels
are compiled at run time (nvcc) per weight shape and per tile config, which its heuristics pick
per row count: `warm_up` runs every row count a forward may meet before any request (and before
any graph capture needs one), so no request compiles. The compiled cubins persist in its cache
(DG_JIT_CACHE_DIR, default ~/.deep_gemm): a restart loads them.

bf16 / fp16 outputs only (its SM90 kernel writes no float32): float32 callers, where speculation
must equal AR token for token, stay on the Triton GEMM (kernels/fp8's `choose`).
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger("ddtree")

BLOCK = 128  # the only block shape its SM90 kernel takes: 128x128 weights, 1x128 activations
OUT_DTYPES = (torch.bfloat16,)


@functools.lru_cache(maxsize=None)
def module():
    """The imported `deep_gemm`, or None (logged once, with why): not installed, or its extension
    built against another torch (an undefined symbol at load)."""
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - any import failure means: serve without it
        logger.info(
            "FP8: DeepGEMM unavailable (%s: %s); the Triton / cuBLAS GEMMs serve "
            "(pip install -e '.[gpu]' brings it).",
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        return None
    return deep_gemm


@functools.lru_cache(maxsize=None)
def available(device_index: int) -> bool:
    """DeepGEMM imports and the device is a Hopper (sm_90: the kernel this module calls)."""
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    return module() is not None


def takes(w: torch.Tensor, group_n: int, group_k: int, out_dtype: torch.dtype) -> bool:
    """Whether the library runs this weight: 128x128 blocks, K a whole number of blocks, an output
    width its TMA store takes (N % 64: every Qwen projection), a bf16 output, a Hopper with it."""
    N, K = w.shape
    return (
        w.is_cuda
        and group_n == BLOCK
        and group_k == BLOCK
        and K % BLOCK == 0
        and N % 64 == 0
        and out_dtype in OUT_DTYPES
        and available(w.device.index or 0)
    )


def gemm(
    q: torch.Tensor,
    s: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    m: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """q [rows >= m, K] float8_e4m3fn with s [rows, K / 128] float32 MN-major (`group_quant(...,
    rows=ceil4(m), column_major=True)`); w [N, K], w_scale [N / 128, K / 128] -> [m, N]."""
    d = torch.empty(m, w.shape[0], dtype=out_dtype, device=q.device)
    module().fp8_gemm_nt((q[:m], s[:m]), (w, w_scale), d, recipe=(1, BLOCK, BLOCK))
    return d
