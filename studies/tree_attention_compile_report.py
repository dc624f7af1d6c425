#!/usr/bin/env python3
"""Compile the split-KV tree-attention kernel for sm_90 WITHOUT a GPU and print, per config, what ptxas made of
it: registers, stack (spills), shared memory, resident programs per SM, and instruction counts from the SASS
(HGMMA = Hopper wgmma, HMMA = mma.sync, LDL/STL = local-memory spills, LDGSTS = cp.async pipelined loads), and
the deepest `async_wait` in the TTGIR: how many load groups stay in flight while a tile is computed (0 = every
tile waits for its own loads: the latency is exposed once per tile).

    python3 studies/tree_attention_compile_report.py            # 32 q heads, 8 KV heads, D 128, bf16, page 16
    python3 studies/tree_attention_compile_report.py "KernelConfig(64, 64, 4, 5)" ...     # only these configs
    python3 studies/tree_attention_compile_report.py --defaults --json   # the shipped defaults (tests use this)

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
from ddtree.kernels.tree_attention.tuning import KernelConfig, ctas_per_sm, default_config  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTRS = {
    "q_ptr": "*bf16",
    "k_pool": "*bf16",
    "v_pool": "*bf16",
    "block_table": "*i64",
    "qo_indptr": "*i64",
    "kv_lens": "*i64",
    "mask_ptr": "*u8",
    "out_ptr": "*bf16",
    "part_o": "*fp32",
    "part_lse": "*fp32",
    "k_ext": "*bf16",
    "v_ext": "*bf16",
}


def _sass_counts(cubin: bytes) -> tuple[int, int, str]:
    """(registers, stack bytes, SASS) of a cubin, by the cuobjdump Triton carries."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    usage = subprocess.run(
        [f"{BIN}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True
    ).stdout
    sass = subprocess.run(
        [f"{BIN}/cuobjdump", "--dump-sass", f.name], capture_output=True, text=True
    ).stdout
    os.unlink(f.name)
    return (
        int(re.search(r"REG:(\d+)", usage).group(1)),
        int(re.search(r"STACK:(\d+)", usage).group(1)),
        sass,
    )


def report(
    cfg: KernelConfig,
    mode: int = 1,
    split: bool = True,
    hkv: int = 8,
    group: int = 4,
    dim: int = 128,
):
    fn = kernel.split_kv_attn
    names = fn.arg_names
    consts = dict(
        HKV=hkv,
        G=group,
        D=dim,
        PAGE=16,
        BLOCK_M=cfg.block_m,
        TAIL_M=cfg.tail_m,
        BLOCK_N=cfg.block_n,
        TREE_N=cfg.tree_n,
        TAIL_SPLIT=cfg.tail_split,
        MODE=mode,
        EXTRA=False,
        SPLIT=split,
        DOT=0,
        PDL=True,
    )
    sig, cvals, attrs = {}, {}, {}
    for i, a in enumerate(names):
        if a in consts:
            sig[a] = "constexpr"
            cvals[(i,)] = consts[a]
        else:
            sig[a] = PTRS.get(a, "fp32" if a == "qk_scale" else "i32")
            if a in PTRS or a.startswith("stride"):
                # as Triton specialises 16-aligned pointers / strides
                attrs[(i,)] = [["tt.divisibility", 16]]
    ck = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=cvals, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )
    regs, stack, sass = _sass_counts(ck.asm["cubin"])
    shared = ck.metadata.shared
    per_sm = ctas_per_sm(regs, shared, cfg.num_warps)
    n = {k: len(re.findall(k, sass)) for k in ("HGMMA", "HMMA", "LDL", "STL", "LDGSTS")}
    depth = max(
        [int(x) for x in re.findall(r"async_wait[^\n]*\{num = (\d+)", ck.asm["ttgir"])] or [0]
    )
    return dict(
        regs=regs,
        stack=stack,
        shared=shared,
        per_sm=per_sm,
        wait_depth=depth,
        gdc_launch="griddepcontrol.launch_dependents" in ck.asm["ptx"],
        **n,
    )


def combine_report():
    """The split merge as launched after the Triton kernel on sm_90 (PDL): it must wait for the split grid
    (griddepcontrol.wait) before its first global load."""
    from ddtree.kernels.tree_attention import merge

    fn = merge.combine
    consts = dict(HQ=32, D=128, BLOCK_S=16, PDL=True)
    sig, cvals = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a], cvals[(i,)] = "constexpr", consts[a]
        else:
            sig[a] = {"part_o": "*fp32", "part_lse": "*fp32", "out_ptr": "*bf16"}.get(a, "i32")
    ptx = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=cvals),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 1},
    ).asm["ptx"]
    wait, load = ptx.find("griddepcontrol.wait"), ptx.find("ld.global")
    return dict(gdc_wait=wait >= 0, wait_before_loads=0 <= wait < load)


def hopper_report(
    hkv: int = 8,
    group: int = 4,
    dim: int = 128,
    page: int = 16,
    mode: int = 1,
    cfg=None,
    pdl: bool = False,
):
    """The Gluon kernel (hopper.py) for sm_90, bound to CPU tensors of the 65-node shape."""
    import torch
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    from ddtree.kernels.tree_attention import hopper

    target = GPUTarget("cuda", 90, 32)
    pool = torch.empty(4096, hkv, dim, dtype=torch.bfloat16)
    q = torch.empty(65, hkv * group, dim, dtype=torch.bfloat16)
    i64 = torch.empty(8, dtype=torch.int64)
    f32 = torch.empty(8, dtype=torch.float32)
    cfg = cfg or hopper.DEFAULT
    box = min(page, cfg.block_n)
    desc = hopper._descriptor(pool, box)
    u8 = torch.empty(8, dtype=torch.uint8)
    args = (
        q,
        desc,
        desc,
        i64,
        i64,
        i64,
        u8,
        f32,
        f32,
        0.1,
        4,
        q.stride(0),
        q.stride(1),
        300,
        300,
        65 * 65,
        65,
        hkv,
        group,
        dim,
        page,
        box,
        cfg.block_m,
        cfg.block_n,
        cfg.stages,
        mode,
        hopper.tail_n(cfg, group),
        pdl,
    )
    fn = hopper._split_attn
    backend = make_backend(target)
    nw = 4
    kw = {"num_warps": nw, "maxnreg": cfg.maxnreg}  # as launch_splits
    bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(
        *args, **kw
    )
    options, sig, consts, attrs = fn._pack_args(backend, kw, bound, spec, options)
    ck = triton.compile(
        GluonASTSource(fn, sig, consts, attrs), target=target, options=options.__dict__
    )
    regs, stack, sass = _sass_counts(ck.asm["cubin"])
    n = {
        k: len(re.findall(k, sass))
        for k in ("HGMMA", "HMMA", "LDL", "STL", "LDGSTS", "UTMALDG", "USETMAXREG")
    }
    # the swapped one-node tail block (tail_n = 8)
    n["HGMMA_N8"] = len(re.findall(r"HGMMA\.64x8x16", sass))
    # the 64-row block's S = Q K^T (m64n64) with Q read from shared memory (its A operand a descriptor) or registers
    n["QK_A_SMEM"] = len(re.findall(r"HGMMA\.64x64x16\.\S+ R\d+, gdesc", sass))
    n["QK_A_REGS"] = len(re.findall(r"HGMMA\.64x64x16\.\S+ R\d+, R\d+, gdesc", sass))
    return dict(
        regs=regs,
        stack=stack,
        shared=ck.metadata.shared,
        per_sm=ctas_per_sm(regs, ck.metadata.shared, nw),
        serialized=_wgmma_serialized(ck.asm["ptx"]),
        gdc_launch="griddepcontrol.launch_dependents" in ck.asm["ptx"],
        **n,
    )


def _wgmma_serialized(ptx: str) -> list[str]:
    """ptxas's C75xx notes: it serialises every wgmma of the kernel when an accumulator in flight is touched
    (e.g. copied across a loop's back edge), which costs the overlap the kernel is built on."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [f"{BIN}/ptxas", "-arch=sm_90a", "-v", f.name, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
        )
    return sorted(set(re.findall(r"C75\d\d", log.stdout + log.stderr)))


def _or_error(fn, *args, **kw) -> dict:
    """fn's report, or {"error": ...} when it does not compile."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def short(c: KernelConfig) -> str:
    return (
        f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}t{c.tail_m}tn{c.tree_n}"
        f"{'T' if c.tail_split else 'S'}"
    )


# the shipped defaults: (what, rows per request = q tokens x GQA 4, max context, kernel MODE: 0 causal, 1 tree)
DEFAULT_SHAPES = [
    ("decode 16k", 4, 16384, 0),
    ("decode 1k", 4, 1024, 0),
    ("tree 65 nodes", 260, 16384, 1),
]


def main():
    import json
    from importlib import import_module

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    as_json = "--json" in sys.argv
    if "--defaults" in sys.argv:
        runs = [
            (name, default_config(rows, 128, ctx), mode) for name, rows, ctx, mode in DEFAULT_SHAPES
        ]
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        configs = import_module("gpu_tree_attention").sweep_configs(260) + [
            KernelConfig(16, 64, 4, 3)
        ]
        if args:  # e.g. "KernelConfig(64, 64, 4, 5)" ...: only these
            configs = [eval(a, {"KernelConfig": KernelConfig}) for a in args]
        runs = [(short(c), c, mode) for c in configs for mode in (1, 0)]
    if not as_json:
        print(
            "| config | mode | regs | stack B | shared B | programs/SM | wait depth | HGMMA | HMMA | LDL | STL | "
            "LDGSTS |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    if "--defaults" in sys.argv:
        from ddtree.kernels.tree_attention import hopper

        extra = [  # (name, report, human-readable label)
            (
                {"name": "hopper ctx", "config": str(hopper.DEFAULT), "mode": 1},
                _or_error(hopper_report),
                f"Hopper kernel (Gluon, {hopper.DEFAULT})",
            ),
            (
                {"name": "hopper pingpong", "config": str(hopper.PINGPONG), "mode": 1},
                _or_error(hopper_report, cfg=hopper.PINGPONG),
                f"Hopper kernel, two warpgroups ({hopper.PINGPONG})",
            ),
            # decode: causal, the merge launched as a programmatic dependent (dispatch.gluon_merge_pdl)
            (
                {"name": "hopper decode", "mode": 0},
                _or_error(hopper_report, mode=0, pdl=True),
                "Hopper kernel, decode",
            ),
            ({"name": "combine"}, _or_error(combine_report), "Split merge (PDL)"),
        ]
        for head, r, label in extra:
            print(json.dumps({**head, **r}) if as_json else f"{label}: {r}", flush=True)
    for name, cfg, mode in runs:
        r = _or_error(report, cfg, mode)  # a config that does not compile is reported, not fatal
        if as_json:
            print(json.dumps({"name": name, "config": short(cfg), "mode": mode, **r}), flush=True)
        elif "error" in r:
            print(f"| {short(cfg)} | {mode} | failed: {r['error'][:80]} |")
        else:
            print(
                f"| {short(cfg)} | {mode} | {r['regs']} | {r['stack']} | {r['shared']} | {r['per_sm']} | "
                f"{r['wait_depth']} | {r['HGMMA']} | {r['HMMA']} | {r['LDL']} | {r['STL']} | {r['LDGSTS']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
