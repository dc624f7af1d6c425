#!/usr/bin/env python3
"""Compile every Triton kernel that launches as a programmatic dependent (kernels/pdl.py) for sm_90
WITHOUT a GPU and check, in its PTX, that griddepcontrol.wait comes before its first global load or
store: a PDL kernel may be scheduled while the kernel ahead of it still runs, so one memory access
ahead of the wait is a race the interpreter cannot show. The one exception, the no_buffer tree
verify's output kernel (kernels/gdn/tree_chunk_triton.py), reads ahead of its wait by design (the
outputs of kernels launched before the solve ahead of it): for it the check is that nothing is
stored before the wait, and for its solve that launch_dependents comes after the solve's own wait.

    python3 studies/pdl_compile_report.py          # one JSON line per kernel; exit 1 if any fails

Runs on the CPU machine (Triton's own PTX backend); tests/test_pdl_compile.py runs it.
"""

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sm90_compile import compile_sm90  # noqa: E402 (bench/, the script's folder)


def _kernels() -> list[tuple[str, object, dict, dict]]:
    """(name, jit function, constexprs, argument types other than bf16 pointers / i32 scalars)."""
    import triton.language as tl

    from ddtree.kernels.fused import triton as fused
    from ddtree.kernels.gdn import commit_triton, decode_triton, tree_conv
    from ddtree.kernels.gdn import fused as gdn_fused
    from ddtree.kernels.gdn import tree_chunk_triton as chunk_kernels

    f32 = {"eps": "fp32"}
    # the GDN kernels at the 27B shape (dk = dv = 128, conv kernel 4), fp32 states and gates
    state = {
        n: "*fp32" for n in ("ssm_ptr", "s0_ptr", "g_ptr", "m_ptr", "coef_ptr", "gs_ptr", "st_ptr")
    }
    rows = {n: "*i64" for n in ("rows_ptr", "slots_ptr", "path_ptr", "acc_ptr", "par_ptr")}
    rows.update(depth_ptr="*i64", st_rows_ptr="*i64", s0_rows_ptr="*i64", valid_ptr="*u8")
    gdn = {**state, **rows, "mask_ptr": "*u8", "scale": "fp32"}
    chunk = dict(BT=64, BK=128, BKC=32, PREC="tf32")
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
        ("gdn gating", gdn_fused._gating_kernel, dict(BLOCK=1024), {"g_ptr": "*fp32"}),
        (
            "gdn gated_rmsnorm",
            gdn_fused._gated_rmsnorm_kernel,
            dict(HW_DT=tl.bfloat16, BLOCK=128),
            f32,
        ),
        (
            "gdn tree_conv",
            tree_conv._tree_conv_kernel,
            dict(
                K=4, HAS_BIAS=False, STATES=False, ROWS=True, STASH=True, IN_PLACE=False, BLOCK=256
            ),
            gdn,
        ),
        (
            "gdn tree_conv in place",
            tree_conv._tree_conv_kernel,
            dict(
                K=4, HAS_BIAS=False, STATES=False, ROWS=True, STASH=False, IN_PLACE=True, BLOCK=256
            ),
            gdn,
        ),
        (
            "gdn decode",
            decode_triton._decode_kernel,
            dict(BK=128, BV=32, RAW_GATE=True, L2NORM=True),
            gdn,
        ),
        (
            "gdn solve",
            chunk_kernels._solve_kernel,
            dict(chunk, L2NORM=True, RAW_GATE=True, STASH=True, PREC_IN="tf32", EARLY=True),
            {**gdn, "alog_ptr": "*fp32", "dtb_ptr": "*fp32", "g_ptr": "*bf16"},
        ),
        (
            "gdn output",
            chunk_kernels._output_kernel,
            dict(chunk, BV=32, S0_ROWS=True, EARLY=False),
            gdn,
        ),
        (
            "gdn output, overlapped (loads ahead of the wait)",
            chunk_kernels._output_kernel,
            dict(chunk, BV=32, S0_ROWS=True, EARLY=True),
            gdn,
        ),
        (
            "gdn commit ssm",
            commit_triton._replay_ssm_kernel,
            dict(BK=128, BV=32, L2NORM=True),
            gdn,
        ),
        ("gdn commit conv", commit_triton._replay_conv_kernel, dict(KM1=3, BJ=4, BC=256), gdn),
    ]


def _first(ptx: str, ops) -> int:
    """Where the first of the instructions `ops` is (whole mnemonics: "red.global" is not the tail
    of "cp.async.ca.shared.global"), or the PTX's length."""
    pos = [m.start() for op in ops for m in [re.search(r"(?<![\w.])" + re.escape(op), ptx)] if m]
    return min(pos or [len(ptx)])


def check(fn, consts: dict, types: dict) -> dict:
    """wait_first: the wait comes before the first global access the kernel may not make early
    (any, or with EARLY set on an output kernel only stores and atomics); trigger_after_wait: a
    launch_dependents, if any, comes after the wait."""
    types = {a: types.get(a, "*bf16" if a.endswith("_ptr") else "i32") for a in fn.arg_names}
    ptx = compile_sm90(fn, consts, types, num_warps=4).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    trigger = ptx.find("griddepcontrol.launch_dependents")
    early = consts.get("EARLY") and "S0_ROWS" in consts  # the overlapped output kernel
    stores = ("st.global", "atom.global", "red.global")
    ops = stores if early else ("ld.global", "cp.async", *stores)
    first = _first(ptx, ops)
    out = dict(gdc_wait=wait >= 0, wait_first=0 <= wait < first)
    if early:  # it does read ahead of the wait (else the overlap is gone)
        out["loads_ahead"] = _first(ptx, ("ld.global",)) < wait
    if trigger >= 0:
        out["trigger_after_wait"] = trigger > wait >= 0
    return out


def main() -> int:
    ok = True
    for name, fn, consts, types in _kernels():
        try:
            r = check(fn, consts, types)
        except Exception as e:  # noqa: BLE001 - reported, and the run fails
            r = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        ok &= bool(r.get("wait_first")) and all(
            r.get(k, True) for k in ("loads_ahead", "trigger_after_wait")
        )
        print(json.dumps({"name": name, **r}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
