"""The block-FP8 kernels compiled for sm_90 without a GPU (ptxas from Triton's package), at every tile
of the tuning table, with the 16-divisibility a real launch specializes on: they
compile, do not spill (no stack, no LDL / STL), and run their dots on the fp8 tensor cores (QGMMA,
Hopper's fp8 warpgroup MMA, from BLOCK_M 64; the fp8 mma.sync, HMMA, below), the decode tiles with
split-K and its reduce included. ~15 s. Runs
studies/fp8_compile_report.py in a clean subprocess (the test process runs Triton's interpreter)."""

import pytest
from compile_reports import needs_sass_tools, run_report

pytest.importorskip("triton")


def test_fp8_kernels_compile_without_spills_on_fp8_tensor_cores():
    needs_sass_tools()
    rows = run_report("fp8_compile_report.py", "--json")
    assert rows[0]["kernel"] == "group_quant" and rows[-1]["kernel"] == "split_reduce"
    assert len(rows) == 8 and [r["config"][4] for r in rows[5:7]] == [4, 4]  # split-K variants
    for r in rows:
        assert r["stack"] == 0 and r["LDL"] == 0 and r["STL"] == 0, r
    for r in rows[1:-1]:
        mma = "QGMMA" if r["config"][0] >= 64 else "HMMA"
        assert r[mma] > 0 and r["HGMMA"] == 0, r
