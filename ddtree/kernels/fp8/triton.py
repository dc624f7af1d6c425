"""Triton kernels for block-FP8 linears (the math: `reference.py`).

- `group_quant`: activations [M, K] -> float8_e4m3fn [rows, K] and float32 scales per token and group
  of bk columns, in one launch; `rows` >= M pads with zero rows (cuBLAS's block-scaled GEMM wants a
  multiple of 4) and the scales can be written column-major (its layout for them).
- `gemm`: C [M, N] = dequant(A) @ dequant(B)^T with B the weight [N, K] (row scale group g, bk
  columns a block): each bk-wide K step is one fp8 tensor-core dot accumulated in float32 and scaled
  by the A row scales and the B block scales; one K block per step, so every output element sums
  its K blocks in the same order whatever the tile shape. With `split_k` > 1 (decode rows: too few
  N tiles to keep every SM streaming the weight) program (tile, s) sums the s-th run of K blocks
  into a float32 workspace and `_split_reduce` adds the runs in order: deterministic, but a
  different summation order than split 1 (so float32 callers keep split 1: tuning.py).

A variant that quantized the activation tile in registers inside the GEMM (one launch per linear)
lost to the two launches at every row count (docs/design-numbers.md): deleted.

No host sync, shapes fixed by the inputs: CUDA-graph capturable (launch once before capture to
compile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree import envs
from ddtree.kernels.fp8.reference import EPS, FP8, FP8_MAX
from ddtree.kernels.fp8.tuning import GemmConfig

# TRITON_INTERPRET is read when a kernel is decorated; the dispatch reloads this module for the other mode
_decorated_interpreted = envs.TRITON_INTERPRET.on()
_EPS = tl.constexpr(EPS)
_FP8_MAX = tl.constexpr(FP8_MAX)
REDUCE_BLOCK, REDUCE_WARPS = 1024, 4  # `_split_reduce`'s launch (studies/fp8_compile_report.py too)


@triton.jit
def _group_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sk,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """GROUPS groups of one row per program: [GROUPS, GROUP] values, one scale per group (the same
    per-group arithmetic whatever GROUPS is)."""
    row = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    if EVEN_K:  # every group of the program inside K: row masks only (16-byte accesses)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=row < M, other=0.0).to(tl.float32)
    else:
        in_k = (cols < K) & (row < M)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=in_k, other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), 1), _EPS), _FP8_MAX)
    q = tl.clamp(tl.div_rn(x, scale[:, None]), -_FP8_MAX, _FP8_MAX).to(q_ptr.dtype.element_ty)
    if EVEN_K:
        tl.store(q_ptr + row * stride_qm + cols, q)
        tl.store(s_ptr + row * stride_sm + g * stride_sk, scale)
    else:
        tl.store(q_ptr + row * stride_qm + cols, q, mask=cols < K)
        tl.store(s_ptr + row * stride_sm + g * stride_sk, scale, mask=g * GROUP < K)


QUANT_ELEMS = 1024  # values per group-quant program (8 groups of 128: 16-byte loads over 4 warps)


def group_quant(
    x: torch.Tensor, group: int, rows: int | None = None, column_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (q [rows, K] float8_e4m3fn, scales [rows, ceil(K / group)]
    float32; rows M by default; rows past M are zeros (scale EPS / 448)); column_major: the scales'
    storage is [groups, rows] (a transposed view is returned). A program quantizes up to
    QUANT_ELEMS values of a row (one group per program left 1,024-row activations at ~5x their
    copy time)."""
    M, K = x.shape
    rows = M if rows is None else rows
    groups = triton.cdiv(K, group)
    per = min(triton.next_power_of_2(groups), max(1, QUANT_ELEMS // group))
    q = torch.empty(rows, K, dtype=FP8, device=x.device)
    if column_major:
        s = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    _group_quant_kernel[(rows, triton.cdiv(groups, per))](
        x,
        q,
        s,
        M,
        K,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        s.stride(1),
        GROUP=group,
        GROUPS=per,
        EVEN_K=K % (group * per) == 0,
        num_warps=max(1, min(8, per * group // 256)),
    )
    return q, s


@triton.jit
def _gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    bias_ptr,
    ws_ptr,
    M,
    N,
    K,
    per,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_ask,
    stride_bsn,
    stride_bsk,
    GROUP_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped launch order: GROUP_M row tiles walk the N tiles together (their B tiles stay in L2)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_blocks = tl.cdiv(K, BLOCK_K)
    kb0 = tl.program_id(1) * per  # this program's run of K blocks (the last may be shorter)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + (kb0 * BLOCK_K + offs_k)[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + (kb0 * BLOCK_K + offs_k)[:, None]
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + (offs_n // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb0, tl.minimum(kb0 + per, k_blocks)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_ask, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:  # the run's partial sum; `_split_reduce` adds the bias and casts
        ws_ptrs = ws_ptr + (tl.program_id(1) * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(ws_ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_reduce(
    ws_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """C[m, n] = sum over s in order of ws[s, m, n] (+ bias[n]), cast to C's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + (offs // N) * stride_cm + n, acc.to(c_ptr.dtype.element_ty), mask=mask)


def gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    group_n: int,
    group_k: int,
    out_dtype: torch.dtype,
    config: GemmConfig,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """a [M, K] float8_e4m3fn with a_scale [M, ceil(K / group_k)] (any strides); w [N, K]
    float8_e4m3fn, w_scale [ceil(N / group_n), ceil(K / group_k)] -> [M, N] in out_dtype. Unit
    stride along K for a and w. `config.split_k` runs of K blocks (evened out so none is empty)."""
    M, K = a.shape
    N = w.shape[0]
    c = torch.empty(M, N, dtype=out_dtype, device=a.device) if out is None else out
    k_blocks = triton.cdiv(K, group_k)
    per = triton.cdiv(k_blocks, max(1, min(config.split_k, k_blocks)))  # K blocks per run
    split = triton.cdiv(k_blocks, per)  # no empty run
    ws = torch.empty(split, M, N, dtype=torch.float32, device=a.device) if split > 1 else c
    grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n), split)
    _gemm_kernel[grid](
        a,
        a_scale,
        w,
        w_scale,
        c,
        c if bias is None else bias,
        ws,
        M,
        N,
        K,
        per,
        a.stride(0),
        w.stride(0),
        c.stride(0),
        a_scale.stride(0),
        a_scale.stride(1),
        w_scale.stride(0),
        w_scale.stride(1),
        GROUP_N=group_n,
        HAS_BIAS=bias is not None,
        EVEN_K=K % group_k == 0,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=group_k,
        GROUP_M=config.group_m,
        SPLIT_K=split,
        num_warps=config.warps,
        num_stages=config.stages,
    )
    if split > 1:
        _split_reduce[(triton.cdiv(M * N, REDUCE_BLOCK),)](
            ws,
            c,
            c if bias is None else bias,
            M,
            N,
            c.stride(0),
            HAS_BIAS=bias is not None,
            SPLIT_K=split,
            BLOCK=REDUCE_BLOCK,
            num_warps=REDUCE_WARPS,
        )
    return c
