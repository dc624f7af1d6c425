#!/usr/bin/env python3
"""Compile the split-KV tree-attention kernel for sm_90 WITHOUT a GPU and print, per config, what ptxas made of
it: registers, stack (spills), shared memory, resident programs per SM, and instruction counts from the SASS
(HGMMA = Hopper wgmma, HMMA = mma.sync, LDL/STL = local-memory spills, LDGSTS = cp.async pipelined loads).

    python3 bench/tree_attention_compile_report.py            # 32 q heads, 8 KV heads, D 128, bf16, page 16

Uses the ptxas / cuobjdump that Triton's package carries; runs on the CPU machine (no device time).
"""

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ddtree.kernels.tree_attention import triton as kernel  # noqa: E402
from ddtree.kernels.tree_attention.tuning import KernelConfig, ctas_per_sm  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTRS = {"q_ptr": "*bf16", "k_pool": "*bf16", "v_pool": "*bf16", "block_table": "*i64", "qo_indptr": "*i64",
        "kv_lens": "*i64", "mask_ptr": "*u8", "out_ptr": "*bf16", "part_o": "*fp32", "part_lse": "*fp32",
        "k_ext": "*bf16", "v_ext": "*bf16"}


def report(cfg: KernelConfig, mode: int = 1, split: bool = True, hkv: int = 8, group: int = 4, dim: int = 128):
    fn = kernel._split_kv_attn
    names = fn.arg_names
    consts = dict(HKV=hkv, G=group, D=dim, PAGE=16, BLOCK_M=cfg.block_m, TAIL_M=cfg.tail_m, BLOCK_N=cfg.block_n,
                  TREE_N=cfg.tree_n, TAIL_SPLIT=cfg.tail_split, MODE=mode, EXTRA=False, SPLIT=split, DOT=0)
    sig, cvals, attrs = {}, {}, {}
    for i, a in enumerate(names):
        if a in consts:
            sig[a] = "constexpr"
            cvals[(i,)] = consts[a]
        else:
            sig[a] = PTRS.get(a, "fp32" if a == "qk_scale" else "i32")
            if a in PTRS or a.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]  # as Triton specialises 16-aligned pointers / strides
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cvals, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    usage = subprocess.run([f"{BIN}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                           text=True).stdout
    sass = subprocess.run([f"{BIN}/cuobjdump", "--dump-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = ck.metadata.shared
    per_sm = ctas_per_sm(regs, shared, cfg.num_warps)
    n = {k: len(re.findall(k, sass)) for k in ("HGMMA", "HMMA", "LDL", "STL", "LDGSTS")}
    return dict(regs=regs, stack=stack, shared=shared, per_sm=per_sm, **n)


def short(c: KernelConfig) -> str:
    return (f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}t{c.tail_m}tn{c.tree_n}"
            f"{'T' if c.tail_split else 'S'}")


def main():
    from importlib import import_module

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    configs = import_module("gpu_tree_attention").sweep_configs(260) + [KernelConfig(16, 64, 4, 3)]
    if len(sys.argv) > 1:  # e.g. "KernelConfig(64, 64, 4, 5)" ...: only these
        configs = [eval(a, {"KernelConfig": KernelConfig}) for a in sys.argv[1:]]
    print("| config | mode | regs | stack B | shared B | programs/SM | HGMMA | HMMA | LDL | STL | LDGSTS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cfg in configs:
        for mode in (1, 0):
            try:
                r = report(cfg, mode)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                print(f"| {short(cfg)} | {mode} | failed: {type(e).__name__}: {str(e)[:80]} |")
                continue
            print(f"| {short(cfg)} | {mode} | {r['regs']} | {r['stack']} | {r['shared']} | {r['per_sm']} | "
                  f"{r['HGMMA']} | {r['HMMA']} | {r['LDL']} | {r['STL']} | {r['LDGSTS']} |", flush=True)


if __name__ == "__main__":
    main()
