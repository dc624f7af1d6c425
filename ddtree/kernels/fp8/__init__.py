"""Block-FP8 linears: y = x @ dequant(W)^T with W float8_e4m3fn and its block scales, x quantized per
token in groups of bk columns at run time (`reference.py` holds the math).

`linear` picks the implementation per call (`choose`):
- `triton`: the group-quant kernel, then the Triton GEMM on fp8 activations;
- `cublas`: the group-quant kernel, then `torch._scaled_mm`'s block-scaled GEMM (cuBLASLt, CUDA >=
  12.9: 1x128 activation and 128x128 weight scales; bk = bn = 128 only);
- `deepgemm`: the group-quant kernel, then DeepGEMM's SM90 block-scaled GEMM (`deepgemm.py`; the
  optional library of the `gpu` extra; bk = bn = 128, bf16 outputs);
The measured table (`table.py`, `gemm_table.json`): per weight shape and row class
(1-16, 17-128, 129+ rows) the backends fastest first, the first that runs here taken; float32
activations (`exact`) take the Triton GEMM at every row count. The reference on the CPU (or the
kernels under Triton's interpreter with TRITON_INTERPRET=1 and DDTREE_FUSED_KERNELS_INTERPRET=1,
as the fused layer kernels) and with DDTREE_REFERENCE=fp8 (or kernels): the PyTorch reference
(dequantize, float32 matmul).
"""

from __future__ import annotations

import functools
import logging

import torch

from ddtree import envs
from ddtree.kernels.fp8 import deepgemm as DG
from ddtree.kernels.fp8 import reference as R
from ddtree.kernels.fp8 import table

logger = logging.getLogger("ddtree")

_kernels = None


def _triton(interpreted: bool = False):
    """The Triton module (False without Triton); reloaded when the CPU interpreter is wanted and the
    module was decorated without it."""
    global _kernels
    if _kernels is None or (interpreted and _kernels and not _kernels._decorated_interpreted):
        try:
            import importlib

            from ddtree.kernels.fp8 import triton as mod

            if interpreted and not mod._decorated_interpreted:
                mod = importlib.reload(mod)
        except ImportError:
            mod = False
        _kernels = mod
    return _kernels


@functools.lru_cache(maxsize=None)
def cublas_blockwise(device_index: int) -> bool:
    """Whether this torch build's `torch._scaled_mm` runs 1x128 / 128x128 block scaling on the device
    (cuBLASLt >= 12.9, sm_90+): one tiny GEMM, tried once per device (outside any graph capture:
    `Fp8Linear.prepare`); False (and a log line) otherwise, and the Triton GEMM serves."""
    dev = torch.device("cuda", device_index)
    try:
        # K = 512: four K blocks, so the scales need no padding (cuBLAS refuses a scale tensor
        # longer than K / 128, which a one-block probe would hand it)
        a = torch.ones(4, 512, device=dev).to(R.FP8)
        b = torch.ones(128, 512, device=dev).to(R.FP8)
        sa = torch.ones(4, 4, device=dev).t()  # [rows, K blocks], column-major
        sb = cublas_scale(torch.ones(1, 4, device=dev))
        y = torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16)
        return bool((y == 512).all())
    except (RuntimeError, TypeError, AttributeError) as e:
        logger.info("FP8: torch._scaled_mm block scaling unavailable (%s); Triton GEMMs only.", e)
        return False


def cublas_ok(w: torch.Tensor, group_n: int, group_k: int) -> bool:
    """Whether `torch._scaled_mm`'s block-scaled GEMM takes this weight: 128 x 128 blocks, widths
    that are multiples of 16, a device where it runs."""
    N, K = w.shape
    return (
        w.is_cuda
        and group_n == 128
        and group_k == 128
        and N % 16 == 0
        and K % 128 == 0
        and cublas_blockwise(w.device.index or 0)
    )


def cublas_scale(w_scale: torch.Tensor) -> torch.Tensor:
    """The weight scales in the layout cuBLAS's 128x128 block scaling reads: [K blocks padded to a
    multiple of 4, N blocks], N-blocks contiguous (a transposed view)."""
    nb, kb = w_scale.shape
    padded = torch.ones(nb, -(-kb // 4) * 4, dtype=torch.float32, device=w_scale.device)
    padded[:, :kb] = w_scale
    return padded.t()


def choose(
    rows: int,
    n: int,
    k: int,
    cublas: bool,
    exact: bool = False,
    deepgemm: bool = False,
) -> str:
    """The backend for a [rows, k] x [n, k]^T GEMM (`cublas` / `deepgemm`: whether each takes the
    weight here).

    `exact` (float32 activations, the mode in which speculative output must equal AR token for
    token): auto keeps the Triton GEMM at every row count, at one tile shape (tuning.EXACT): its
    reduction over K is then the same for a row whatever the row count, so a verify's 85 rows
    compute what AR's 5 decode rows do. cuBLAS picks its algorithm per row count (with it above
    64 rows the toy pairs' FP8 DFLASH / DDTREE left FP8 AR on the H200: tests/gpu/test_fp8_gpu.py),
    DeepGEMM writes no float32, and the table changes backend between row classes. In bf16 a
    divergence must be a near-tie, and each row class takes its fastest backend."""
    if exact:
        return "triton"
    runs = {"triton": True, "cublas": cublas, "deepgemm": deepgemm}
    return next(b for b in table.preference(rows, n, k) if runs[b])


def use_kernels(x: torch.Tensor) -> bool:
    if envs.REFERENCE.has("kernels") or envs.REFERENCE.has("fp8"):
        return False
    if x.device.type != "cuda" and not (
        envs.TRITON_INTERPRET.on() and envs.FUSED_KERNELS_INTERPRET.on()
    ):
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return bool(_triton(interpreted=x.device.type != "cuda"))


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    group_n: int,
    group_k: int,
    bias: torch.Tensor | None = None,
    scale_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] in the model dtype, w [N, K] float8_e4m3fn, w_scale [ceil(N / group_n), ceil(K /
    group_k)] float32 -> [..., N] in x's dtype. `scale_t`: `cublas_scale(w_scale)`, when the cuBLAS
    path may run (computed once by the caller, outside any graph capture)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    N = w.shape[0]
    if not use_kernels(x2):
        y = R.fp8_linear(x2, w, w_scale, group_n, group_k, bias)
        return y.view(*x.shape[:-1], N)
    from ddtree.kernels.fp8.tuning import gemm_config

    T = _triton(interpreted=x2.device.type != "cuda")
    M = x2.shape[0]
    cublas = scale_t is not None and cublas_ok(w, group_n, group_k)
    deepgemm = DG.takes(w, group_n, group_k, x.dtype)
    exact = x.dtype == torch.float32
    config = gemm_config(M, N, exact)
    backend = choose(M, N, K, cublas, exact, deepgemm)
    if backend in ("cublas", "deepgemm"):  # both read cuBLAS's activation layout
        q, s = T.group_quant(x2, group_k, rows=-(-M // 4) * 4, column_major=True)
        if backend == "cublas":
            y = torch._scaled_mm(q, w.t(), s, scale_t, out_dtype=x.dtype)[:M]
        else:
            y = DG.gemm(q, s, w, w_scale, M, x.dtype)
        if bias is not None:  # added after: the libraries' block-scaled paths run without one
            y = y + bias
    else:
        q, s = T.group_quant(x2, group_k)
        y = T.gemm(q, s, w, w_scale, group_n, group_k, x.dtype, config, bias)
    return y.view(*x.shape[:-1], N)


def warm_up(
    w: torch.Tensor,
    w_scale: torch.Tensor,
    group_n: int,
    group_k: int,
    dtype: torch.dtype,
    max_rows: int,
    scale_t: torch.Tensor | None = None,
    min_rows: int = 1,
) -> int:
    """Run `linear` on this weight at every row count 1..max_rows where auto picks DeepGEMM: its
    kernels compile at first use per tile config, which its heuristics pick per row count, so
    every count a forward may meet runs once here, before any request. Returns the calls made.
    min_rows: start there instead (processes warming one cache in parallel split the rows)."""
    if not DG.takes(w, group_n, group_k, dtype) or not use_kernels(w):
        return 0
    N, K = w.shape
    cublas = scale_t is not None and cublas_ok(w, group_n, group_k)
    x = torch.zeros(max_rows, K, dtype=dtype, device=w.device)
    calls = 0
    with torch.no_grad():
        for m in range(max(min_rows, 1), max_rows + 1):
            if choose(m, N, K, cublas, deepgemm=True) == "deepgemm":
                linear(x[:m], w, w_scale, group_n, group_k, scale_t=scale_t)
                calls += 1
    return calls
