"""Tiles of the Triton FP8 GEMM per row count (`gemm_config`), and its split-K for studies.

A few rows stream the weight (bandwidth bound: small BLOCK_M, enough N tiles to fill the SMs); more
rows take wgmma-sized tiles. The table is the sweep's choice (`studies/gpu_fp8_gemm.py --sweep` on
the 8B shapes; its times: docs/design-numbers.md):
- <= 16 rows: 16x32 beats 16x64 and 16x128 except on the widest weights (gate|up): 16x64 from
  N >= 16384;
- <= 128 rows: 64x64 (beside 32x64 and 64x128);
- more: 64x128 x 4 warps (beside 128x128 x 8 warps and 128x256) (cuBLAS serves these row counts:
  kernels/fp8's auto).

Split-K (`split_k`): at decode rows one M tile leaves N / BLOCK_N programs, 128 for a 4096-wide
weight at 16x32, each walking all of K: about one per SM, too few loads in flight to stream the
weight at the copy bandwidth (a decode GEMM runs far above its byte floor: BENCHMARKS.md, FP8).
Splitting K into runs gives SPLIT_CTAS_PER_SM programs per SM, each run at least
SPLIT_MIN_K_BLOCKS blocks long (a float32 partial per run and one reduce launch). Not in float32:
it changes the summation order between row counts, and there speculation must equal AR token for
token (kernels/fp8's `choose`).
The engine never splits: a GemmConfig with split_k > 1 (`auto_split`'s runs) is what a study
passes the kernel (studies/gpu_fp8_gemm.py's `split` column). Correct against the reference
(tests/test_fp8_kernels.py) and compiled for sm_90 without spills (tests/test_fp8_compile.py), but
not yet shown to pay on a GPU: `scripts/device/fp8.sh --only gemm` (GEMM_FLAGS="--rows 1,16,64
--sweep") times it per GEMM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    warps: int
    stages: int
    group_m: int = 8
    split_k: int = 1  # runs of K blocks, summed by a second launch (triton.py)


# (largest row count, config), first match
TABLE = (
    (16, GemmConfig(16, 32, 4, 4)),
    (128, GemmConfig(64, 64, 4, 4)),
    (1 << 30, GemmConfig(64, 128, 4, 4)),
)
WIDE = GemmConfig(16, 64, 4, 4)  # <= 16 rows of a weight with N >= WIDE_N
# float32 activations (speculation must equal AR bit for bit): one tile shape at every row count.
# The 16-row tiles run the fp8 mma.sync, the 64-row ones wgmma, and their K-block sums differ in
# the last bits: a row's output at 1 row != at 64+ rows (studies/gpu_fp8_gemm_libs.py's rowinv);
# wgmma tiles of any width agree with each other.
EXACT = GemmConfig(64, 64, 4, 4)
WIDE_N = 16384
SPLIT_MAX_ROWS = 16  # split-K at decode rows only (one M tile)
SPLIT_CTAS_PER_SM = 4
SPLIT_MIN_K_BLOCKS = 4


def auto_split(rows: int, n: int, k: int, config: GemmConfig, sms: int, group_k: int = 128) -> int:
    """Runs of K blocks for `rows` x [n, k] at `config`'s tiles on a device of `sms` SMs."""
    if rows > SPLIT_MAX_ROWS or sms <= 0:
        return 1
    tiles = -(-rows // config.block_m) * -(-n // config.block_n)
    want = -(-SPLIT_CTAS_PER_SM * sms // tiles)
    return max(1, min(want, -(-k // group_k) // SPLIT_MIN_K_BLOCKS))


def gemm_config(rows: int, n: int, exact: bool = False) -> GemmConfig:
    """The tiles for a [rows, k] x [n, k]^T GEMM, unsplit; `exact` (float32 activations): EXACT at
    every row count."""
    if exact:
        return EXACT
    if rows <= 16 and n >= WIDE_N:
        return WIDE
    return next(c for m, c in TABLE if rows <= m)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count
