#!/usr/bin/env python3
"""Compile the tree-build kernel (ddtree/kernels/tree_build/triton.py) for sm_90 WITHOUT a GPU and
print, per budget, what ptxas made of it: registers, stack (spills), shared memory, SASS counts
(LDL/STL = spills, BAR = CTA barriers, LDG.E.CONSTANT = read-only-path loads) and the compile time.

    python3 studies/tree_build_compile_report.py                 # budgets 8..256, D = 15, K = B
    python3 studies/tree_build_compile_report.py 64,64,15,4      # B,K,D[,warps]
    python3 studies/tree_build_compile_report.py --json          # one JSON line per config (tests)

Uses the ptxas / cuobjdump that Triton's package carries; runs on the CPU machine (no device time).
The workspace is written and read back by the same program across CTA barriers: its loads must
not take the read-only (non-coherent) path, and the barriers must survive (tests/test_tree_build.py).
"""

import json
import os
import re
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sm90_compile import compile_sm90, resources  # noqa: E402 (bench/, the script's folder)

from ddtree.kernels.tree_build import triton as tb  # noqa: E402

PTRS = dict(
    logp_ptr="*fp32",
    ids_ptr="*i64",
    root_ptr="*i64",
    limit_ptr="*i64",
    cut_ptr="*i64",
    tok_ptr="*i64",
    par_ptr="*i64",
    dep_ptr="*i64",
    valid_ptr="*u8",
    mask_ptr="*u8",
    pscore_ptr="*fp32",
    score_ws="*fp32",
    index_ws="*i32",
)


def report(B: int, K: int, D: int, warps: int | None = None, shadow=True, cut=True) -> dict:
    cfg = tb.launch_config(B, K, D)
    default_warps = cfg.pop("num_warps")
    warps = warps or default_warps
    consts = dict(cfg, B=B, K=K, D=D, SHADOW=shadow, HAS_CUT=cut)
    t0 = time.perf_counter()
    ck = compile_sm90(tb._tree_build_kernel, consts, PTRS, num_warps=warps, num_stages=1)
    seconds = time.perf_counter() - t0
    res, sass = resources(ck)
    counts = {
        k: len(re.findall(pat, sass))
        for k, pat in (
            ("LDL", r"\bLDL\b"),
            ("STL", r"\bSTL\b"),
            ("BAR", r"\bBAR\.SYNC"),
            ("LDG_CONSTANT", r"LDG\.E[.\w]*\.CONSTANT"),
        )
    }
    ptx = ck.asm["ptx"]
    return dict(
        config=dict(B=B, K=K, D=D, warps=warps, T=cfg["T"], TP=cfg["TP"], FP=cfg["FP"]),
        **res,
        ptx_nc=len(re.findall(r"ld\.global\.nc", ptx)),
        compile_s=round(seconds, 1),
        **counts,
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    as_json = "--json" in argv
    specs = [a for a in argv if a != "--json"]
    configs = [tuple(int(x) for x in s.split(",")) for s in specs] or [
        (b, b, 15) for b in (8, 16, 32, 64, 128, 256)
    ]
    for cfg in configs:
        r = report(*cfg)
        if as_json:
            print(json.dumps(r), flush=True)
        else:
            c = " ".join(f"{k}={v}" for k, v in r["config"].items())
            rest = " ".join(f"{k} {v}" for k, v in r.items() if k != "config")
            print(f"{c}: {rest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
