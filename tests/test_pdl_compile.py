"""Every Triton kernel that launches as a programmatic dependent (kernels/pdl.py) waits for the
kernel ahead of it (griddepcontrol.wait) before its first global load or store, in the PTX Triton
makes for sm_90 (no GPU needed): a PDL kernel may be scheduled while the one ahead still runs, so a
memory access ahead of the wait would race, and the interpreter cannot show it. Runs
bench/pdl_compile_report.py in a clean subprocess (the test process may run the interpreter)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pdl_kernels_wait_before_any_memory_access():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "pdl_compile_report.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows and proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-2000:])
    assert all(r.get("gdc_wait") and r.get("wait_first") for r in rows), rows
