"""Running a studies/*_compile_report.py script from a test: in a clean subprocess (the test process
may run Triton's interpreter, which cannot compile), its JSON lines parsed. The scripts compile for
sm_90 on the CPU (studies/sm90_compile.py)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def needs_sass_tools() -> None:
    """Skip where this Triton build carries no ptxas / cuobjdump (the SASS reports need them)."""
    triton = pytest.importorskip("triton")
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not all(os.path.exists(os.path.join(bin_dir, t)) for t in ("ptxas", "cuobjdump")):
        pytest.skip("this Triton build carries no ptxas / cuobjdump")


def run_report(script: str, *args: str) -> list[dict]:
    """The JSON rows bench/`script` prints for `args`; the script must exit 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "studies", script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, (rows, proc.stderr[-2000:])
    return rows
