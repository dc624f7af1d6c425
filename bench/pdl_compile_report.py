#!/usr/bin/env python3
"""Compile every Triton kernel that launches as a programmatic dependent (kernels/pdl.py) for sm_90
WITHOUT a GPU and check, in its PTX, that griddepcontrol.wait comes before its first global load or
store: a PDL kernel may be scheduled while the kernel ahead of it still runs, so one memory access
ahead of the wait is a race the interpreter cannot show.

    python3 bench/pdl_compile_report.py          # one JSON line per kernel; exit 1 if any fails

Runs on the CPU machine (Triton's own PTX backend); tests/test_pdl_compile.py runs it.
"""

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def _kernels() -> list[tuple[str, object, dict, dict]]:
    """(name, jit function, constexprs, argument types other than bf16 pointers / i32 scalars)."""
    from ddtree.kernels.fused import triton as fused

    f32 = {"eps": "fp32"}
    return [
        (
            "add_rmsnorm",
            fused._add_rmsnorm_kernel,
            dict(HAS_RES=True, OFFSET=True, BLOCK=8192),
            f32,
        ),
        ("qk_norm_rope", fused._qk_norm_rope_kernel, dict(D=256, RD=64, HB=8, OFFSET=True), f32),
        ("silu_mul", fused._silu_mul_kernel, dict(BLOCK=1024), {}),
        ("sigmoid_gate", fused._sigmoid_gate_kernel, dict(BLOCK=256), {}),
    ]


def check(fn, consts: dict, types: dict) -> dict:
    sig, cvals = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in consts or a == "PDL":
            sig[a], cvals[(i,)] = "constexpr", consts.get(a, True)
        else:
            sig[a] = types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
    ptx = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=cvals),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4},
    ).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    first = min([p for p in (ptx.find("ld.global"), ptx.find("st.global")) if p >= 0] or [len(ptx)])
    return dict(gdc_wait=wait >= 0, wait_first=0 <= wait < first)


def main() -> int:
    ok = True
    for name, fn, consts, types in _kernels():
        try:
            r = check(fn, consts, types)
        except Exception as e:  # noqa: BLE001 - reported, and the run fails
            r = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        ok &= bool(r.get("wait_first"))
        print(json.dumps({"name": name, **r}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
