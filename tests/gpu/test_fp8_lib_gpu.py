"""The FP8 GEMM library (DeepGEMM, kernels/fp8/deepgemm.py) on the device: its GEMM against the
reference at the served shapes and row counts, the engine's dispatch (the measured table) through
`kernels.fp8.linear`, a graph replay equal to eager, and the warm-up compiling every kernel a row
count up to its bound needs (a second pass over the row counts compiles nothing). Skipped where
the library does not import (the dispatch then serves the fallback: tests/test_fp8_dispatch.py)."""

import os
import pathlib

import pytest
import torch

from ddtree.kernels import fp8
from ddtree.kernels.fp8 import deepgemm as DG
from ddtree.kernels.fp8 import reference as R
from ddtree.kernels.fp8 import triton as T

pytestmark = pytest.mark.gpu
SHAPES = [(6144, 4096), (4096, 12288), (34816, 5120)]  # 8B qkv, 8B down, 27B gate|up
ROWS = [1, 16, 65, 520, 1040]


@pytest.fixture(scope="module", autouse=True)
def library():
    if not DG.available(0):
        pytest.skip("DeepGEMM does not import here (or the device is not sm_90)")


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator(device="cuda").manual_seed(1)
    return {
        (N, K): R.quantize_weight(
            0.02 * torch.randn(N, K, generator=gen, device="cuda"), (128, 128)
        )
        for N, K in SHAPES
    }


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_deepgemm_matches_reference(weights, shape, m):
    wq, ws = weights[shape]
    x = torch.randn(m, shape[1], device="cuda").to(torch.bfloat16)
    ref = R.block_matmul(*R.group_quant(x, 128), wq, ws, 128, 128, torch.float32)
    q, s = T.group_quant(x, 128, rows=-(-m // 4) * 4, column_major=True)
    y = DG.gemm(q, s, wq, ws, m, torch.bfloat16)
    assert y.shape == (m, shape[0]) and _rel(y, ref) < 3e-3  # bf16 output rounding, ~1.7e-3
    auto = fp8.linear(x, wq, ws, 128, 128, scale_t=fp8.cublas_scale(ws))
    assert _rel(auto, ref) < 3e-3


def test_deepgemm_in_a_graph_is_eager(weights):
    wq, ws = weights[SHAPES[0]]
    for m in (1, 65, 520):
        x = torch.randn(m, SHAPES[0][1], device="cuda").to(torch.bfloat16)

        def f():
            q, s = T.group_quant(x, 128, rows=-(-m // 4) * 4, column_major=True)
            return DG.gemm(q, s, wq, ws, m, torch.bfloat16)

        eager = f().clone()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = f()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def _cached_kernels() -> int:
    root = pathlib.Path(os.environ.get("DG_JIT_CACHE_DIR", pathlib.Path.home() / ".deep_gemm"))
    return sum(1 for _ in root.rglob("*.cubin"))


def test_warm_up_compiles_every_row_count(weights, monkeypatch):
    """After `fp8.warm_up` to 300 rows, linears at every row count up to it compile nothing (the
    library forced at every row count, whatever the table gives this shape)."""
    monkeypatch.setattr(fp8.table, "preference", lambda *a: ("deepgemm", "triton"))
    wq, ws = weights[SHAPES[1]]
    st = fp8.cublas_scale(ws)
    calls = fp8.warm_up(wq, ws, 128, 128, torch.bfloat16, 300, st)
    assert calls == 300
    before = _cached_kernels()
    x = torch.randn(300, SHAPES[1][1], device="cuda").to(torch.bfloat16)
    for m in range(1, 301):
        fp8.linear(x[:m], wq, ws, 128, 128, scale_t=st)
    torch.cuda.synchronize()
    assert _cached_kernels() == before
