"""Tiles of the Triton FP8 GEMM per row count (`gemm_config`), its split-K, and the override
switches for sweeps.

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

Split-K (`split_k`): at decode rows one M tile leaves N / BLOCK_N programs, 128 for a 4096-wide
weight at 16x32, each walking all of K: about one per SM, too few loads in flight to stream the
weight at the copy bandwidth (a decode GEMM runs far above its byte floor: BENCHMARKS.md, FP8).
Splitting K into runs gives SPLIT_CTAS_PER_SM programs per SM, each run at least
SPLIT_MIN_K_BLOCKS blocks long (a float32 partial per run and one reduce launch). Not in float32:
it changes the summation order between row counts, and there speculation must equal AR token for
token (kernels/fp8's `choose`).
Opt-in (DDTREE_FP8_SPLIT_K=auto): correct against the reference (tests/test_fp8_kernels.py) and
compiled for sm_90 without spills (tests/test_fp8_compile.py), but not yet timed on a GPU; the A/B
is `scripts/device/fp8.sh --only gemm,rounds` (GEMM_FLAGS="--rows 1,16,64 --sweep").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ddtree import envs


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
# the last bits: a row's output at 1 row != at 64+ rows (the H100 study, 2026-12-06:
# studies/gpu_fp8_gemm_libs.py, rowinv); wgmma tiles of any width agree with each other.
EXACT = GemmConfig(64, 64, 4, 4)
WIDE_N = 16384
SPLIT_MAX_ROWS = 16  # split-K at decode rows only (one M tile)
SPLIT_CTAS_PER_SM = 4
SPLIT_MIN_K_BLOCKS = 4


def parse_config(text: str) -> GemmConfig:
    try:
        bm, bn, warps, stages, *split = (int(v) for v in text.split(","))
        if len(split) > 1:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{envs.FP8_GEMM_CONFIG.name}={text!r}: pass BLOCK_M,BLOCK_N,WARPS,STAGES[,SPLIT_K], "
            "e.g. 16,64,4,4"
        ) from None
    return GemmConfig(bm, bn, warps, stages, split_k=split[0] if split else 1)


def split_switch() -> int:
    """DDTREE_FP8_SPLIT_K, checked: 0 for auto, else the forced number of runs (1: none)."""
    value = envs.FP8_SPLIT_K.get().strip() or envs.FP8_SPLIT_K.default
    if value == "auto":
        return 0
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{envs.FP8_SPLIT_K.name}={value!r}: use auto or a number >= 1")
    return int(value)


def auto_split(rows: int, n: int, k: int, config: GemmConfig, sms: int, group_k: int = 128) -> int:
    """Runs of K blocks for `rows` x [n, k] at `config`'s tiles on a device of `sms` SMs."""
    if rows > SPLIT_MAX_ROWS or sms <= 0:
        return 1
    tiles = -(-rows // config.block_m) * -(-n // config.block_n)
    want = -(-SPLIT_CTAS_PER_SM * sms // tiles)
    return max(1, min(want, -(-k // group_k) // SPLIT_MIN_K_BLOCKS))


def gemm_config(
    rows: int, n: int, k: int, sms: int = 0, exact: bool = False, group_k: int = 128
) -> GemmConfig:
    """The tiles and split for a [rows, k] x [n, k]^T GEMM on a device of `sms` SMs (0: no
    split); `exact` (float32 activations): EXACT at every row count, never split."""
    forced = envs.FP8_GEMM_CONFIG.get().strip()
    if forced:
        config = parse_config(forced)
    elif exact:
        config = EXACT
    elif rows <= 16 and n >= WIDE_N:
        config = WIDE
    else:
        config = next(c for m, c in TABLE if rows <= m)
    if exact:
        return replace(config, split_k=1)
    if forced and config.split_k > 1:
        return config
    split = split_switch() or auto_split(rows, n, k, config, sms, group_k)
    return replace(config, split_k=split)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count
