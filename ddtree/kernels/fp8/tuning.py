"""Tiles of the Triton FP8 GEMM per row count (`gemm_config`), and the override switch for sweeps.

A few rows stream the weight (bandwidth bound: small BLOCK_M, enough N tiles to fill the SMs, deep
pipelining); many rows are tensor-core bound (large tiles). The table is the H200 sweep's choice
(`bench/gpu_fp8_gemm.py`: every candidate at 1 .. 1040 rows on the 8B and 27B weight shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddtree import envs


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    warps: int
    stages: int
    group_m: int = 8


# (largest row count, config), first match
TABLE = (
    (16, GemmConfig(16, 64, 4, 4)),
    (32, GemmConfig(32, 64, 4, 4)),
    (64, GemmConfig(64, 64, 4, 4)),
    (128, GemmConfig(64, 128, 4, 4)),
    (1 << 30, GemmConfig(128, 128, 8, 3)),
)


def parse_config(text: str) -> GemmConfig:
    try:
        bm, bn, warps, stages = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(
            f"{envs.FP8_GEMM_CONFIG.name}={text!r}: pass BLOCK_M,BLOCK_N,WARPS,STAGES, e.g. 16,64,4,4"
        ) from None
    return GemmConfig(bm, bn, warps, stages)


def gemm_config(rows: int, n: int, k: int) -> GemmConfig:
    forced = envs.FP8_GEMM_CONFIG.get().strip()
    if forced:
        return parse_config(forced)
    return next(c for m, c in TABLE if rows <= m)
