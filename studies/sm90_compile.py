"""Compiling one Triton kernel for sm_90 WITHOUT a GPU, and what ptxas made of it: the common half
of studies/gdn_tree_chunk_compile_report.py, tree_build_compile_report.py and pdl_compile_report.py.
Uses Triton's own PTX backend and the ptxas / cuobjdump its package carries; import it with
TRITON_INTERPRET unset (those scripts pop it before importing triton)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(fn, consts: dict, types: dict | None = None, default: str = "i32", **options):
    """Triton's compiled `fn` for sm_90: the constexprs from `consts` (a kernel's PDL switch, when
    not given, True: how it launches on the H200), every other argument typed by `types` (name ->
    Triton type string) or `default`; `options`: num_warps, num_stages."""
    types = types or {}
    sig, cvals = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in consts or a == "PDL":
            sig[a], cvals[(i,)] = "constexpr", consts.get(a, True)
        else:
            sig[a] = types.get(a, default)
    return triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=cvals),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )


def resources(ck) -> tuple[dict, str]:
    """({regs, stack, shared}, the SASS) of a compiled kernel, by the cuobjdump Triton carries."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    try:

        def dump(flag: str) -> str:
            return subprocess.run(
                [f"{BIN}/cuobjdump", flag, f.name], capture_output=True, text=True
            ).stdout

        usage, sass = dump("--dump-resource-usage"), dump("--dump-sass")
    finally:
        os.unlink(f.name)
    return dict(
        regs=int(re.search(r"REG:(\d+)", usage).group(1)),
        stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
        shared=ck.metadata.shared,
    ), sass
