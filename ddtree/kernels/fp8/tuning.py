"""Tiles of the Triton FP8 GEMM per row count (`gemm_config`), and the override switch for sweeps.

A few rows stream the weight (bandwidth bound: small BLOCK_M, enough N tiles to fill the SMs); more
rows take wgmma-sized tiles. The table is the H200 sweep's choice (`studies/gpu_fp8_gemm.py --sweep`
on the 8B shapes, 2026-12; us per call at 1 / 16 / 64 / 520 rows, best in brackets):
- <= 16 rows: 16x32 (qkv 15.5 / 16.9, o 14.1 / 14.7, down 35.8 / 37.9) beats 16x64 and 16x128
  except on the widest weights (gate|up: 16x64 30.3 / 33.3 vs 16x32 31.9 / 36.0): 16x64 from N >=
  16384;
- <= 128 rows: 64x64 (64 rows: qkv 18.0, o 17.5, gate|up 36.8, down 46.4 vs 32x64 26.1 / 20.4 /
  64.7 / 54.4 and 64x128 22.6 / 22.6 / 38.1 / 60.7);
- more: 64x128 x 4 warps (520 rows: qkv 62.8, gate|up 197 vs 128x128 x 8 warps 70.0, 237; 128x256
  lost 2.5x) (cuBLAS serves these row counts: kernels/fp8's auto).
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
    (16, GemmConfig(16, 32, 4, 4)),
    (128, GemmConfig(64, 64, 4, 4)),
    (1 << 30, GemmConfig(64, 128, 4, 4)),
)
WIDE = GemmConfig(16, 64, 4, 4)  # <= 16 rows of a weight with N >= WIDE_N
WIDE_N = 16384


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
    if rows <= 16 and n >= WIDE_N:
        return WIDE
    return next(c for m, c in TABLE if rows <= m)
