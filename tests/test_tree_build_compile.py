"""The tree-build kernel compiled for sm_90 without a GPU (ptxas from Triton's package) at the
engine's default budget (B = 64, K = 64, D = 15: the measured 27B round), at its default 4 warps
and at 1: it compiles, does not spill, no load takes the read-only (non-coherent) path, which
could miss the program's own workspace writes, and its six CTA barriers (the workspace hand-offs:
table, depth 0, the depth loop, node map, outputs, ancestors) survive; at 1 warp the sorting
network needs no barrier of its own, so exactly those six remain. Runs
studies/tree_build_compile_report.py in a clean subprocess (the test process runs Triton's
interpreter, which cannot compile)."""

import pytest
from compile_reports import needs_sass_tools, run_report

pytest.importorskip("triton")


def test_b64_compiles_without_spills_and_keeps_its_barriers():
    needs_sass_tools()
    rows = run_report("tree_build_compile_report.py", "--json", "64,64,15", "64,64,15,1")
    assert [r["config"]["warps"] for r in rows] == [4, 1]
    for r in rows:
        assert r["stack"] == 0 and r["LDL"] == 0 and r["STL"] == 0, r
        assert r["ptx_nc"] == 0 and r["LDG_CONSTANT"] == 0, r
    assert rows[0]["BAR"] >= 6 and rows[1]["BAR"] == 6, rows
