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
FP8_SPLIT_K = EnvVar(
    "DDTREE_FP8_SPLIT_K",
    "1",
    "runs of K blocks of the Triton FP8 GEMM outside float32: 1 (none, the default until a GPU "
    "A/B shows it pays: scripts/device/fp8.sh's rounds), auto (decode rows, as many as keep every "
    "SM streaming the weight: kernels/fp8/tuning.py) or a number for every call",
)
FORCE_REFERENCE_GDN = EnvVar(
    "DDTREE_FORCE_REFERENCE_GDN",
    "",
    "1: every Gated DeltaNet op runs the PyTorch reference (not fla, not our Triton kernels)",
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
DFLASH2_TREE = EnvVar(
    "DDTREE_DFLASH2_TREE",
    "path",
    "DDTREE over a DFlash2 drafter: path (the path-conditioned tree: children scored by the "
    "selector under their parent's token) or marginal (DDTree over the unary logits' per-position "
    "marginals, the selector unused; the A/B of `bench acceptance`)",
)
DP_REPLICA_PROCESS = EnvVar(
    "DDTREE_DP_REPLICA_PROCESS",
    "",
    "1: a --dp-size 1 server runs its engine in a replica process behind the dispatcher, as "
    "--dp-size N does (the process boundary measured alone; the default runs it inside the HTTP "
    "process)",
)
TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET",
    "",
    "Triton's own: 1 runs Triton kernels on the CPU in its interpreter (the CPU tests)",
)

GRAMMAR_FORCED = EnvVar(
    "DDTREE_GRAMMAR_FORCED",
    "1",
    "0: a draft tree under a grammar keeps the drafter's raw log-probs and drafts no forced token "
    "the drafter missed (grammar/tree.py; to measure what forcing gains)",
)
FORCE_REFERENCE_GRAMMAR_MASK = EnvVar(
    "DDTREE_FORCE_REFERENCE_GRAMMAR_MASK",
    "",
    "1: grammar bitmasks are applied to the logits by the PyTorch reference, not xgrammar's kernel",
)

TABLE: dict[str, EnvVar] = {
    v.name: v
    for v in (
        FORCE_REFERENCE_ATTENTION,
        NO_HOPPER_ATTENTION,
        NO_PDL,
        FORCE_REFERENCE_KERNELS,
        FORCE_REFERENCE_TREE_BUILD,
        FUSED_KERNELS_INTERPRET,
        FP8_GEMM,
        FP8_GEMM_CONFIG,
        FP8_SPLIT_K,
        FORCE_REFERENCE_GDN,
        CACHE,
        BUDGET_PROFILE_DIR,
        PEER_CHECKOUT,
        TOY_HYBRID,
        TP_TIMEOUT_S,
        ROUND_CLOCK,
        POLICY_TRACE,
        DFLASH2_TREE,
        GC_FREEZE,
        DP_REPLICA_PROCESS,
        TRITON_INTERPRET,
        GRAMMAR_FORCED,
        FORCE_REFERENCE_GRAMMAR_MASK,
    )
}


def describe() -> str:
    """The table as text (name, default, what it does)."""
    return "\n".join(f"{v.name}={v.default or '<unset>'}: {v.help}" for v in TABLE.values())
