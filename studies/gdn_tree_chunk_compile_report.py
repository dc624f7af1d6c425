#!/usr/bin/env python3
"""Compile the no_buffer tree verify's Triton kernels (ddtree/kernels/gdn/tree_chunk_triton.py: the
solve and the outputs) for sm_90 WITHOUT a GPU and print, per launch, what ptxas made of them:
registers, stack (spills), shared memory, and SASS counts (HGMMA = Hopper wgmma, HMMA = mma.sync,
LDL/STL = spills).

    python3 studies/gdn_tree_chunk_compile_report.py            # the default launch, 65 nodes
    python3 studies/gdn_tree_chunk_compile_report.py --variants # + the launch variants timed by
                                                              #   studies/gpu_tree_cost.py --gdn
    python3 studies/gdn_tree_chunk_compile_report.py --json     # one JSON line per kernel (tests)

27B heads (dk = dv = 128), bf16 inputs (tf32 dots), the raw gate, the stash, pool rows. Uses the
ptxas / cuobjdump that Triton's package carries; runs on the CPU machine (no device time). The
default launches must not spill: tests/test_gdn_tree_chunk_compile.py.
"""

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sm90_compile import compile_sm90, resources  # noqa: E402 (studies/, the script's folder)

from ddtree.kernels.gdn import tree_chunk_triton as tc  # noqa: E402

TYPES = dict(
    q_ptr="*bf16",
    k_ptr="*bf16",
    v_ptr="*bf16",
    g_ptr="*bf16",  # the raw gate input a
    beta_ptr="*bf16",
    alog_ptr="*fp32",
    dtb_ptr="*fp32",
    valid_ptr="*i8",
    depth_ptr="*i64",
    mask_ptr="*u8",
    s0_ptr="*fp32",
    s0_rows_ptr="*i64",
    o_ptr="*bf16",
    gs_ptr="*fp32",
    bs_ptr="*bf16",
    st_rows_ptr="*i64",
    m_ptr="*fp32",
    coef_ptr="*fp32",
    scale="fp32",
)
VARIANTS = {  # label -> tree_chunk_triton's launch keywords (studies/gpu_tree_cost.py --gdn)
    "default": {},
    "output BV 16": dict(block_v=16),
    "output BV 64, 8 warps": dict(block_v=64, num_warps=8),
    "output 8 warps": dict(num_warps=8),
}


def reports(n=65, label="default", precision="tf32", dk=128, dv=128) -> list[dict]:
    cfg = tc.launch_config(n, dk, dv, **VARIANTS[label])
    out = []
    for name, fn, extra in (
        (
            "solve",
            tc._solve_kernel,
            dict(L2NORM=True, RAW_GATE=True, STASH=True, PREC_IN="tf32", EARLY=True),
        ),
        ("output", tc._output_kernel, dict(S0_ROWS=True, EARLY=True)),
    ):
        c = dict(cfg[name])
        warps = c.pop("num_warps")
        consts = dict(c, PREC=precision, **extra)
        types = {a: TYPES.get(a, "i32") for a in fn.arg_names}
        res, sass = resources(compile_sm90(fn, consts, types, num_warps=warps))
        counts = {k: len(re.findall(k, sass)) for k in ("HGMMA", "HMMA", "LDL", "STL")}
        config = dict(variant=label, kernel=name, **{k.lower(): v for k, v in c.items()})
        out.append(dict(config=dict(config, warps=warps), **res, **counts))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    labels = list(VARIANTS) if "--variants" in argv else ["default"]
    for label in labels:
        for r in reports(label=label):
            if "--json" in argv:
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
