#!/usr/bin/env python3
"""Compile the block-FP8 kernels (ddtree/kernels/fp8/triton.py) for sm_90 WITHOUT a GPU and print what
ptxas made of each: registers, stack (spills), shared memory, and SASS counts (QGMMA = Hopper's fp8
warpgroup MMA, HGMMA / HMMA = bf16 / older MMA paths, LDL / STL = spills).

    python3 studies/fp8_compile_report.py            # the tuning table's tiles, split-K, its reduce
    python3 studies/fp8_compile_report.py --json     # one JSON line per kernel (tests)

Uses the ptxas / cuobjdump that Triton's package carries; runs on the CPU machine (no device time).
"""

import json
import os
import re
import sys
import time
from dataclasses import replace

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sm90_compile import resources  # noqa: E402 (bench/, the script's folder)

from ddtree.kernels.fp8 import triton as T  # noqa: E402
from ddtree.kernels.fp8.tuning import TABLE, WIDE  # noqa: E402

GEMM_TYPES = dict(
    a_ptr="*fp8e4nv",
    as_ptr="*fp32",
    b_ptr="*fp8e4nv",
    bs_ptr="*fp32",
    c_ptr="*bf16",
    bias_ptr="*bf16",
    ws_ptr="*fp32",
)


def compile_aligned(fn, consts: dict, types: dict, aligned: tuple[str, ...], **options):
    """`compile_sm90` with the 16-divisibility a real launch specializes on (pointers from torch
    allocations; the widths and row strides of the served shapes, multiples of 16) marked on
    `aligned` arguments; the row count M stays unmarked (1, 65, 520 ... rows)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, cvals, attrs = {}, {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a], cvals[(i,)] = "constexpr", consts[a]
        else:
            sig[a] = types.get(a, "i32")
            if a in aligned or a.endswith("_ptr"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=cvals, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )


def counts(sass: str) -> dict:
    return {
        k: len(re.findall(pat, sass))
        for k, pat in (
            ("QGMMA", r"\bQGMMA\b"),
            ("HGMMA", r"\bHGMMA\b"),
            ("HMMA", r"\bHMMA\b"),
            ("LDL", r"\bLDL\b"),
            ("STL", r"\bSTL\b"),
        )
    }


def gemm(cfg) -> dict:
    consts = dict(
        SPLIT_K=cfg.split_k,
        GROUP_N=128,
        HAS_BIAS=False,
        EVEN_K=True,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=128,
        GROUP_M=cfg.group_m,
    )
    t0 = time.perf_counter()
    aligned = ("N", "K", "stride_am", "stride_bn", "stride_cm", "stride_asm", "stride_bsn")
    ck = compile_aligned(
        T._gemm_kernel, consts, GEMM_TYPES, aligned, num_warps=cfg.warps, num_stages=cfg.stages
    )
    res, sass = resources(ck)
    return dict(
        kernel="gemm",
        config=[cfg.block_m, cfg.block_n, cfg.warps, cfg.stages, cfg.split_k],
        seconds=round(time.perf_counter() - t0, 2),
        **res,
        **counts(sass),
    )


def split_reduce() -> dict:
    types = dict(ws_ptr="*fp32", c_ptr="*bf16", bias_ptr="*bf16")
    ck = compile_aligned(
        T._split_reduce,
        dict(HAS_BIAS=True, SPLIT_K=4, BLOCK=T.REDUCE_BLOCK),
        types,
        ("N", "stride_cm"),
        num_warps=T.REDUCE_WARPS,
    )
    res, sass = resources(ck)
    return dict(kernel="split_reduce", **res, **counts(sass))


def group_quant() -> dict:
    types = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32")
    ck = compile_aligned(
        T._group_quant_kernel,
        dict(GROUP=128, GROUPS=T.QUANT_ELEMS // 128, EVEN_K=True),
        types,
        ("K", "stride_xm", "stride_qm"),
        num_warps=T.QUANT_ELEMS // 256,
    )
    res, sass = resources(ck)
    return dict(kernel="group_quant", **res, **counts(sass))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    decode = [replace(c, split_k=4) for c in (TABLE[0][1], WIDE)]  # split-K runs at decode rows
    gemms = [gemm(cfg) for cfg in [c for _, c in TABLE] + [WIDE] + decode]
    rows = [group_quant()] + gemms + [split_reduce()]
    for r in rows:
        print(json.dumps(r) if "--json" in argv else r, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
