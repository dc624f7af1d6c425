"""The no_buffer tree verify's Triton kernel, compiled for sm_90 without a GPU (ptxas from Triton's
package) at its default launch for a 65-node tree (27B heads, bf16): no register spills
(a 64-row block sits at 255 registers; a wider column tile or a 128-row block spills), and the
64-row block's dots on Hopper's wgmma. Runs bench/gdn_tree_chunk_compile_report.py in a clean
subprocess (the test process runs Triton's interpreter, which cannot compile)."""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def test_default_launches_do_not_spill():
    if not all(os.path.exists(os.path.join(BIN, t)) for t in ("ptxas", "cuobjdump")):
        pytest.skip("this Triton build carries no ptxas / cuobjdump")
    from ddtree.kernels.gdn.tree_chunk_triton import launch_config

    c = launch_config(65, 128, 128)
    spec = f"{c['BT']},{c['BKC']},{c['BV']},{c['num_warps']},tf32x3"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(ROOT, "bench", "gdn_tree_chunk_compile_report.py")
    proc = subprocess.run(
        [sys.executable, script, "--json", spec],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["config"]["bt"] == 64
    assert rows[0]["stack"] == 0 and rows[0]["LDL"] == 0 and rows[0]["HGMMA"] > 0, rows[0]


def test_split_form_kernels_do_not_spill():
    """The split form (kernels/gdn/tree_chunk_split_triton.py) at its default launch for 65 nodes,
    tf32 (its precision for bf16 inputs): neither kernel spills, the output kernel fits two
    programs per SM at 4 warps (<= 255 registers), and both run on Hopper's wgmma."""
    if not all(os.path.exists(os.path.join(BIN, t)) for t in ("ptxas", "cuobjdump")):
        pytest.skip("this Triton build carries no ptxas / cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(ROOT, "bench", "gdn_tree_chunk_compile_report.py")
    proc = subprocess.run(
        [sys.executable, script, "--json", "--split"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {
        r["config"]["kernel"]: r
        for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    }
    out, solve = rows["output"], rows["solve"]
    assert out["config"]["warps"] == 4 and out["stack"] == 0 and out["HGMMA"] > 0, out
    assert solve["stack"] == 0 and solve["HGMMA"] > 0, solve
