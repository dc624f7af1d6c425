"""The no_buffer tree verify's Triton kernels (kernels/gdn/tree_chunk_triton.py: the solve with the
gate inside, and the overlapped outputs), compiled for sm_90 without a GPU (ptxas from Triton's
package) at their default launch for a 65-node tree (27B heads, bf16, tf32 dots): no register
spills (the solve's 64-row block sits at ~255 registers at 8 warps; 4 warps or a 64-wide dk chunk
spill), the output kernel at 4 warps within 255 registers (two programs per SM), and both on
Hopper's wgmma. Runs studies/gdn_tree_chunk_compile_report.py in a clean subprocess (the test
process runs Triton's interpreter, which cannot compile)."""

import pytest
from compile_reports import needs_sass_tools, run_report

pytest.importorskip("triton")


def test_default_launches_do_not_spill():
    needs_sass_tools()
    rows = {
        r["config"]["kernel"]: r for r in run_report("gdn_tree_chunk_compile_report.py", "--json")
    }
    out, solve = rows["output"], rows["solve"]
    assert solve["config"]["bt"] == 64 and out["config"]["warps"] == 4, rows
    for r in (out, solve):
        assert r["stack"] == 0 and r["LDL"] == 0 and r["HGMMA"] > 0, r
