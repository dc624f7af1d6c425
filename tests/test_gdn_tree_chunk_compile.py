"""The no_buffer tree verify's Triton kernel, compiled for sm_90 without a GPU (ptxas from Triton's
package) at its default launch for a 65-node tree (27B heads, bf16): no register spills
(a 64-row block sits at 255 registers; a wider column tile or a 128-row block spills), and the
64-row block's dots on Hopper's wgmma. Runs studies/gdn_tree_chunk_compile_report.py in a clean
subprocess (the test process runs Triton's interpreter, which cannot compile)."""

import pytest
from compile_reports import needs_sass_tools, run_report

pytest.importorskip("triton")


def test_default_launches_do_not_spill():
    needs_sass_tools()
    from ddtree.kernels.gdn.tree_chunk_triton import launch_config

    c = launch_config(65, 128, 128)
    spec = f"{c['BT']},{c['BKC']},{c['BV']},{c['num_warps']},tf32x3"
    rows = run_report("gdn_tree_chunk_compile_report.py", "--json", spec)
    assert len(rows) == 1 and rows[0]["config"]["bt"] == 64
    assert rows[0]["stack"] == 0 and rows[0]["LDL"] == 0 and rows[0]["HGMMA"] > 0, rows[0]


def test_split_form_kernels_do_not_spill():
    """The split form (kernels/gdn/tree_chunk_split_triton.py) at its default launch for 65 nodes,
    tf32 (its precision for bf16 inputs): neither kernel spills, the output kernel fits two
    programs per SM at 4 warps (<= 255 registers), and both run on Hopper's wgmma."""
    needs_sass_tools()
    rows = {
        r["config"]["kernel"]: r
        for r in run_report("gdn_tree_chunk_compile_report.py", "--json", "--split")
    }
    out, solve = rows["output"], rows["solve"]
    assert out["config"]["warps"] == 4 and out["stack"] == 0 and out["HGMMA"] > 0, out
    assert solve["stack"] == 0 and solve["HGMMA"] > 0, solve
