#!/usr/bin/env python3
"""Compile the tree-build kernel (ddtree/kernels/tree_build/triton.py) for sm_90 WITHOUT a GPU and
print, per budget, what ptxas made of it: registers, stack (spills), shared memory, SASS counts
(LDL/STL = spills, BAR = CTA barriers, LDG.E.CONSTANT = read-only-path loads) and the compile time.

    python3 bench/tree_build_compile_report.py                 # budgets 8..256, D = 15, K = B
    python3 bench/tree_build_compile_report.py 64,64,15,4      # B,K,D[,warps]
    python3 bench/tree_build_compile_report.py --json          # one JSON line per config (tests)

Uses the ptxas / cuobjdump that Triton's package carries; runs on the CPU machine (no device time).
The workspace is written and read back by the same program across CTA barriers: its loads must
not take the read-only (non-coherent) path, and the barriers must survive (tests/test_tree_build.py).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ddtree.kernels.tree_build import triton as tb  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
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
    fn = tb._tree_build_kernel
    sig, cvals = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
            cvals[(i,)] = consts[a]
        else:
            sig[a] = PTRS.get(a, "i32")
    t0 = time.perf_counter()
    ck = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=cvals),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": 1},
    )
    seconds = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])

    def dump(flag: str) -> str:
        return subprocess.run(
            [f"{BIN}/cuobjdump", flag, f.name], capture_output=True, text=True
        ).stdout

    usage, sass = dump("--dump-resource-usage"), dump("--dump-sass")
    os.unlink(f.name)
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
        regs=int(re.search(r"REG:(\d+)", usage).group(1)),
        stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
        shared=ck.metadata.shared,
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
