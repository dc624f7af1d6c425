"""Every Triton kernel that launches as a programmatic dependent (kernels/pdl.py) waits for the
kernel ahead of it (griddepcontrol.wait) before its first global load or store, in the PTX Triton
makes for sm_90 (no GPU needed): a PDL kernel may be scheduled while the one ahead still runs, so a
memory access ahead of the wait would race, and the interpreter cannot show it. The overlapped
output kernel of the no_buffer tree verify reads ahead of its wait by design and stores nothing
before it; its solve lets it launch only after its own wait. Runs studies/pdl_compile_report.py in a
clean subprocess (the test process may run the interpreter)."""

import pytest
from compile_reports import run_report

pytest.importorskip("triton")


def test_pdl_kernels_wait_before_any_memory_access():
    rows = run_report("pdl_compile_report.py")
    assert rows and all(r.get("gdc_wait") and r.get("wait_first") for r in rows), rows
    by_name = {r["name"]: r for r in rows}
    assert by_name["gdn output, overlapped (loads ahead of the wait)"]["loads_ahead"], rows
    assert by_name["gdn solve"]["trigger_after_wait"], rows
