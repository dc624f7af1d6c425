#!/usr/bin/env python3
"""Compile the no_buffer tree verify's Triton kernel (ddtree/kernels/gdn/tree_chunk_triton.py) for
sm_90 WITHOUT a GPU and print, per launch config, what ptxas made of it: registers, stack (spills),
shared memory, and SASS counts (HGMMA = Hopper wgmma, HMMA = mma.sync, LDL/STL = spills).

    python3 studies/gdn_tree_chunk_compile_report.py            # defaults per block, 27B heads, bf16
    python3 studies/gdn_tree_chunk_compile_report.py 64,16,64,8,tf32   # BT,BKC,BV,warps[,precision]
    python3 studies/gdn_tree_chunk_compile_report.py --json     # one JSON line per config (tests)
    python3 studies/gdn_tree_chunk_compile_report.py --split    # the split form's two kernels, defaults

Uses the ptxas / cuobjdump that Triton's package carries; runs on the CPU machine (no device time).
The defaults (block rows 16 / 32 / 64, what `tree_chunk_triton` launches for n <= 17 / 33 / 65) must
not spill: tests/test_gdn_tree_chunk_compile.py.
"""

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from sm90_compile import compile_sm90, resources  # noqa: E402 (bench/, the script's folder)

from ddtree.kernels.gdn import tree_chunk_split_triton as sp  # noqa: E402
from ddtree.kernels.gdn import tree_chunk_triton as tc  # noqa: E402


def _ptrs(dt: str) -> dict:
    return dict(
        q_ptr=f"*{dt}",
        k_ptr=f"*{dt}",
        v_ptr=f"*{dt}",
        g_ptr="*fp32",
        beta_ptr=f"*{dt}",
        valid_ptr="*i8",
        depth_ptr="*i64",
        mask_ptr="*u8",
        s0_ptr="*fp32",
        s0_rows_ptr="*i64",
        o_ptr=f"*{dt}",
        gs_ptr="*fp32",
        bs_ptr=f"*{dt}",
        st_rows_ptr="*i64",
        m_ptr="*fp32",
        coef_ptr="*fp32",
    )


def _bytes(dt: str) -> int:
    return 2 if dt in ("bf16", "fp16") else 4


def defaults(dk: int = 128, dv: int = 128) -> list[tuple]:
    """(BT, BKC, BV, warps, precision) the wrapper launches for trees of 17 / 33 / 65 nodes."""
    out = []
    for n in (17, 33, 65):
        c = tc.launch_config(n, dk, dv)
        out.append((c["BT"], c["BKC"], c["BV"], c["num_warps"], "tf32x3"))
    return out


def report(bt, bkc, bv, warps, precision="tf32x3", dt="bf16", dk=128) -> dict:
    """The one-launch kernel (`_tree_chunk_kernel`) at one launch config."""
    consts = dict(
        BT=bt,
        BK=max(16, triton.next_power_of_2(dk)),
        BKC=bkc,
        BV=bv,
        L2NORM=True,
        S0_ROWS=True,
        STASH=True,
        PREC=precision,
        PREC_IN=tc.input_precision(_bytes(dt), precision),
    )
    config = dict(bt=bt, bkc=bkc, bv=bv, warps=warps, precision=precision, dtype=dt)
    return compile_report(tc._tree_chunk_kernel, consts, warps, dt, config)


def split_reports(n=65, precision="tf32", dt="bf16", dk=128, dv=128) -> list[dict]:
    """The split form's two kernels at the wrapper's launch for n nodes (tf32: its precision for
    16-bit inputs)."""
    cfg = sp.launch_config(n, dk, dv)
    prec_in = tc.input_precision(_bytes(dt), precision)
    out = []
    for name, fn, extra in (
        ("solve", sp._solve_kernel, dict(L2NORM=True, STASH=True, PREC_IN=prec_in)),
        ("output", sp._output_kernel, dict(S0_ROWS=True)),
    ):
        c = dict(cfg[name])
        warps = c.pop("num_warps")
        consts = dict(c, PREC=precision, **extra)
        config = dict(kernel=name, **{k.lower(): v for k, v in c.items()}, warps=warps)
        out.append(compile_report(fn, consts, warps, dt, dict(config, precision=precision)))
    return out


def compile_report(fn, consts: dict, warps: int, dt: str, config: dict) -> dict:
    ptrs = _ptrs(dt)
    types = {a: ptrs.get(a, "fp32" if a == "scale" else "i32") for a in fn.arg_names}
    res, sass = resources(compile_sm90(fn, consts, types, num_warps=warps))
    counts = {k: len(re.findall(k, sass)) for k in ("HGMMA", "HMMA", "LDL", "STL")}
    return dict(config=config, **res, **counts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    as_json = "--json" in argv
    specs = [a for a in argv if a not in ("--json", "--split")]
    if "--split" in argv:
        rows = split_reports()
    else:
        configs = [
            tuple(int(x) if x.isdigit() else x for x in s.split(",")) for s in specs
        ] or defaults()
        rows = [report(*cfg) for cfg in configs]
    for r in rows:
        if as_json:
            print(json.dumps(r), flush=True)
        else:
            c = " ".join(f"{k}={v}" for k, v in r["config"].items())
            print(
                f"{c}: regs {r['regs']} stack {r['stack']} shared {r['shared']} "
                f"HGMMA {r['HGMMA']} HMMA {r['HMMA']} LDL {r['LDL']} STL {r['STL']}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
