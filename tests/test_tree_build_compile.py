"""The tree-build kernel compiled for sm_90 without a GPU (ptxas from Triton's package) at the
engine's default budget (B = 64, K = 64, D = 15: the measured 27B round), at its default 4 warps
and at 1: it compiles, does not spill, no load takes the read-only (non-coherent) path, which
could miss the program's own workspace writes, and its six CTA barriers (the workspace hand-offs:
table, depth 0, the depth loop, node map, outputs, ancestors) survive; at 1 warp the sorting
network needs no barrier of its own, so exactly those six remain. Runs
bench/tree_build_compile_report.py in a clean subprocess (the test process runs Triton's
interpreter, which cannot compile)."""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def test_b64_compiles_without_spills_and_keeps_its_barriers():
    if not all(os.path.exists(os.path.join(BIN, t)) for t in ("ptxas", "cuobjdump")):
        pytest.skip("this Triton build carries no ptxas / cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(ROOT, "bench", "tree_build_compile_report.py")
    proc = subprocess.run(
        [sys.executable, script, "--json", "64,64,15", "64,64,15,1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["config"]["warps"] for r in rows] == [4, 1]
    for r in rows:
        assert r["stack"] == 0 and r["LDL"] == 0 and r["STL"] == 0, r
        assert r["ptx_nc"] == 0 and r["LDG_CONSTANT"] == 0, r
    assert rows[0]["BAR"] >= 6 and rows[1]["BAR"] == 6, rows
