"""Every environment switch the code reads, in one table (name, default, what it does), read one
way.

A reader names the entry (`envs.NO_PDL.on()`, `envs.CACHE.get()`), never `os.environ` with a
literal: tests/test_envs.py checks that every `DDTREE_*` name in the code, the tests, bench/ and the
docs is in `TABLE`. Flags: unset, empty, 0, false, no and off (any case) mean off; any other value
means on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def flag_value(value: str) -> bool:
    """Empty, 0, false, no and off (any case) mean off; any other value means on."""
    return value.strip().lower() not in ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # "" = unset
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def on(self) -> bool:
        """The value as a flag (see the module docstring)."""
        return flag_value(self.get())

    def binary(self) -> bool:
        """A 0 / 1 switch (unset or empty: its default, else 1), checked: any other value raises
        naming it."""
        flag = self.get().strip() or self.default.strip() or "1"
        if flag not in ("0", "1"):
            raise ValueError(f"{self.name}={flag!r}: use 0 or 1")
        return flag == "1"


FORCE_REFERENCE_ATTENTION = EnvVar(
    "DDTREE_FORCE_REFERENCE_ATTENTION",
    "",
    "1: the triton attention backend runs the PyTorch reference (no Triton needed; no CUDA graphs)",
)
NO_HOPPER_ATTENTION = EnvVar(
    "DDTREE_NO_HOPPER_ATTENTION",
    "",
    "1: never the Gluon (sm_90) tree-attention kernel; the Triton kernel does every split",
)
NO_PDL = EnvVar(
    "DDTREE_NO_PDL",
    "",
    "1: our Triton kernels (the decoder layer's fused kernels, the GDN kernels, the split-KV "
    "merge) launch as ordinary kernels, not programmatic dependents (PDL, kernels/pdl.py)",
)
ATTENTION_WIDE_TILES = EnvVar(
    "DDTREE_ATTENTION_WIDE_TILES",
    "auto",
    "the Triton tree-attention kernel's tiles at head dims > 128 (the hybrid targets' gated "
    "attention): auto (tuning.default_config), or BLOCK_M,BLOCK_N,WARPS,STAGES for tree / chain / "
    "block rows, optionally ;BLOCK_M,BLOCK_N,WARPS,STAGES for decode rows (<= 16); timed by bench/"
    "gpu_tree_attention.py --shape qwen3.6-27b",
)
FORCE_REFERENCE_KERNELS = EnvVar(
    "DDTREE_FORCE_REFERENCE_KERNELS",
    "",
    "1: the fused decoder-layer kernels (add + RMSNorm, q/k norm + RoPE, SiLU-mul) run their "
    "references",
)
FORCE_REFERENCE_TREE_BUILD = EnvVar(
    "DDTREE_FORCE_REFERENCE_TREE_BUILD",
    "",
    "1: the DDTree tree build's node selection runs the PyTorch form (per-depth sorts), not the "
    "one-launch Triton kernel (kernels/tree_build)",
)
FUSED_KERNELS_INTERPRET = EnvVar(
    "DDTREE_FUSED_KERNELS_INTERPRET",
    "",
    "1 (with TRITON_INTERPRET=1): the fused, the FP8, the GDN tree / tree-conv and the tree-build "
    "Triton kernels run on the CPU in Triton's interpreter (tests, ddtree.tools.studies.op_count)",
)
FP8_GEMM = EnvVar(
    "DDTREE_FP8_GEMM",
    "auto",
    "block-FP8 linears (kernels/fp8): auto (the measured choice per shape and row count), triton "
    "(group-quant kernel + Triton GEMM), cublas (group-quant kernel + torch._scaled_mm block "
    "scaling) or reference (PyTorch)",
)
FP8_GEMM_CONFIG = EnvVar(
    "DDTREE_FP8_GEMM_CONFIG",
    "",
    "the Triton FP8 GEMM's tiles for every row count: BLOCK_M,BLOCK_N,WARPS,STAGES (default: "
    "kernels/fp8/tuning.py's table per row count; for sweeps)",
)
FORCE_REFERENCE_GDN = EnvVar(
    "DDTREE_FORCE_REFERENCE_GDN",
    "",
    "1: every Gated DeltaNet op runs the PyTorch reference (not fla, not our Triton kernels)",
)
GDN_TREE_CHUNK = EnvVar(
    "DDTREE_GDN_TREE_CHUNK",
    "auto",
    "the chunk-form GDN tree verify (no_buffer): auto = on CUDA, 1 = everywhere (CPU tests), "
    "torch = everywhere as the PyTorch form (the Triton kernel's reference), 0 = never; the "
    "Triton kernel runs where our Triton kernels do and the tree has <= 65 nodes",
)
GDN_COMMIT_KERNEL = EnvVar(
    "DDTREE_GDN_COMMIT_KERNEL",
    "1",
    "no_buffer commit: 1 = the in-place replay kernel (kernels/gdn/commit_triton.py) where our "
    "Triton kernels run; 0 = gathers + fla's fused recurrent / the reference + index_put",
)
GDN_DECODE_KERNEL = EnvVar(
    "DDTREE_GDN_DECODE_KERNEL",
    "1",
    "one-node rounds (AR, auto's width-1 rounds): 1 = the GDN conv and rule step the committed "
    "state rows in place at verify (kernels/gdn/decode_triton.py + the in-place tree conv where "
    "our Triton kernels run, the PyTorch step elsewhere) and the round's commit leaves the GDN "
    "state alone; 0 = the tree verify (stash) + commit, as wider trees",
)
GDN_TREE_CHUNK_FORM = EnvVar(
    "DDTREE_GDN_TREE_CHUNK_FORM",
    "split",
    "the chunk-form GDN tree kernel's launches: split = the solve once per head, then the "
    "outputs per column tile (tree_chunk_split_triton); one = both in one launch per column tile",
)
GDN_TREE_CHUNK_BV = EnvVar(
    "DDTREE_GDN_TREE_CHUNK_BV",
    "auto",
    "the chunk-form GDN tree kernel's value-column tile (programs per head = dv / BV): auto, 16, "
    "32, 64 or 128",
)
GDN_TREE_CHUNK_PRECISION = EnvVar(
    "DDTREE_GDN_TREE_CHUNK_PRECISION",
    "auto",
    "the chunk-form GDN tree kernel's fp32 dot precision: auto (tf32 for 16-bit inputs, as fla's "
    "chunk kernels; tf32x3 for fp32), tf32x3 (~fp32), tf32 (10-bit mantissa inputs) or ieee (no "
    "tensor cores)",
)
GDN_TREE_PREFETCH = EnvVar(
    "DDTREE_GDN_TREE_PREFETCH",
    "",
    "1: the tree GDN kernel issues node i + 1's loads before node i's math (same arithmetic)",
)
GDN_TREE_BV = EnvVar(
    "DDTREE_GDN_TREE_BV",
    "auto",
    "the tree GDN kernel's state column tile (programs per head = dv / BV): auto, or a power of "
    "two 4..128",
)
GDN_TREE_WARPS = EnvVar(
    "DDTREE_GDN_TREE_WARPS",
    "4",
    "warps per program of the tree GDN kernel: 1, 2, 4 or 8 (1: its reductions stay in one warp)",
)
GDN_STASH_DTYPE = EnvVar(
    "DDTREE_GDN_STASH_DTYPE",
    "",
    "extra_buffer's per-node GDN state stash: unset = --mamba-ssm-dtype; bfloat16 = written by the "
    "tree kernel in bf16 (half the bytes; children read rounded parent states)",
)
CACHE = EnvVar(
    "DDTREE_CACHE", "", "directory for the embedded / toy model pairs (unset: ~/.cache/ddtree)"
)
BUDGET_PROFILE_DIR = EnvVar(
    "DDTREE_BUDGET_PROFILE_DIR",
    "",
    "--speculative-ddtree-budget auto: directory of the cached per-device round-cost profiles "
    "(unset: ~/.cache/ddtree/budget; 'off': always re-measure, write nothing)",
)
PEER_CHECKOUT = EnvVar(
    "DDTREE_PEER_CHECKOUT",
    "",
    "path of the paper's code checkout for the peer comparison (unset: .peer/ in the repository)",
)
TOY_HYBRID = EnvVar(
    "DDTREE_TOY_HYBRID",
    "out/toy_hybrid_pair",
    "studies/gpu_gdn_tree.py: directory of the toy hybrid pair",
)
TP_TIMEOUT_S = EnvVar(
    "DDTREE_TP_TIMEOUT_S",
    "300",
    "--tp-size > 1: seconds a model collective waits for the other ranks before it fails (and a "
    "rank starting up for the others)",
)
ROUND_CLOCK = EnvVar(
    "DDTREE_ROUND_CLOCK",
    "1",
    "0: no CUDA events at a decode round's phase boundaries (the device / idle round times in "
    "/metrics, engine/round_clock.py)",
)
POLICY_TRACE = EnvVar(
    "DDTREE_POLICY_TRACE",
    "",
    "--speculative-ddtree-budget auto: a file the budget policy appends one JSON line per round "
    "to (every rung's expected tokens, seconds and rate; the round before's realised accept and "
    "times; engine/policy_trace.py; unset: none)",
)
GC_FREEZE = EnvVar(
    "DDTREE_GC_FREEZE",
    "1",
    "0: the server does not freeze its start-up heap after the warm-up (gc.freeze: full "
    "collections then walk only what serving allocated; server/gc_watch.py)",
)
TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET",
    "",
    "Triton's own: 1 runs Triton kernels on the CPU in its interpreter (the CPU tests)",
)

TABLE: dict[str, EnvVar] = {
    v.name: v
    for v in (
        FORCE_REFERENCE_ATTENTION,
        NO_HOPPER_ATTENTION,
        NO_PDL,
        ATTENTION_WIDE_TILES,
        FORCE_REFERENCE_KERNELS,
        FORCE_REFERENCE_TREE_BUILD,
        FUSED_KERNELS_INTERPRET,
        FP8_GEMM,
        FP8_GEMM_CONFIG,
        FORCE_REFERENCE_GDN,
        GDN_TREE_CHUNK,
        GDN_COMMIT_KERNEL,
        GDN_DECODE_KERNEL,
        GDN_TREE_CHUNK_FORM,
        GDN_TREE_CHUNK_BV,
        GDN_TREE_CHUNK_PRECISION,
        GDN_TREE_PREFETCH,
        GDN_TREE_BV,
        GDN_TREE_WARPS,
        GDN_STASH_DTYPE,
        CACHE,
        BUDGET_PROFILE_DIR,
        PEER_CHECKOUT,
        TOY_HYBRID,
        TP_TIMEOUT_S,
        ROUND_CLOCK,
        POLICY_TRACE,
        GC_FREEZE,
        TRITON_INTERPRET,
    )
}


def describe() -> str:
    """The table as text (name, default, what it does)."""
    return "\n".join(f"{v.name}={v.default or '<unset>'}: {v.help}" for v in TABLE.values())
