"""Every environment switch the code reads, in one table (name, default, what it does), read one
way.

A reader names the entry (`envs.REFERENCE.has("gdn")`, `envs.CACHE.get()`), never `os.environ` with a
literal: tests/test_envs.py checks that every `DDTREE_*` name in the code, the tests, bench/ and the
docs is in `TABLE`. Flags: unset, empty, 0, false, no and off (any case) mean off; any other value
means on. Part lists (`PartsVar`: DDTREE_REFERENCE, DDTREE_DISABLE) name the parts they act on, and
refuse a name they do not have. The list stays short: a variant of the product is a server or
constructor argument, one of a measurement the bench's or the study's flag.
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


@dataclass(frozen=True)
class PartsVar(EnvVar):
    """A comma list of named parts (`all`: every one); a name outside `parts` raises naming the
    valid ones, so a typo never silently leaves a part as it was."""

    parts: tuple[str, ...] = ()

    def chosen(self) -> frozenset[str]:
        names = {p.strip().lower() for p in self.get().split(",")} - {""}
        if "all" in names:
            return frozenset(self.parts)
        unknown = names - set(self.parts)
        if unknown:
            raise ValueError(
                f"{self.name}={self.get()!r}: unknown part(s) {', '.join(sorted(unknown))}; "
                f"use a comma list of {', '.join(self.parts)} or all"
            )
        return frozenset(names)

    def has(self, part: str) -> bool:
        """Whether `part` is chosen (a part this variable does not have is a bug: it raises)."""
        if part not in self.parts:
            raise KeyError(f"{self.name} has no part {part!r} (parts: {', '.join(self.parts)})")
        return part in self.chosen()


REFERENCE = PartsVar(
    "DDTREE_REFERENCE",
    "",
    "a comma list of parts that run their PyTorch reference instead of their kernels (or all): "
    "attention (the triton attention backend; no Triton needed, no CUDA graphs), kernels (the "
    "fused decoder-layer kernels, the selector, the dynamic conv and the FP8 linears), tree_build "
    "(the DDTree node selection's per-depth sorts, not the one-launch kernel), fp8 (the block-FP8 "
    "linears: dequantize, float32 matmul), gdn (every Gated "
    "DeltaNet op: not fla, not our Triton kernels), grammar_mask (grammar bitmasks applied by "
    "PyTorch, not xgrammar's kernel)",
    parts=("attention", "kernels", "tree_build", "fp8", "gdn", "grammar_mask"),
)
DISABLE = PartsVar(
    "DDTREE_DISABLE",
    "",
    "a comma list of kernel features to turn off (or all): hopper_attention (never the Gluon "
    "sm_90 tree-attention kernel; the Triton kernel does every split), pdl (our Triton kernels "
    "launch as ordinary kernels, not programmatic dependents: kernels/pdl.py)",
    parts=("hopper_attention", "pdl"),
)
FUSED_KERNELS_INTERPRET = EnvVar(
    "DDTREE_FUSED_KERNELS_INTERPRET",
    "",
    "1 (with TRITON_INTERPRET=1): the fused, the FP8, the GDN tree / tree-conv and the tree-build "
    "Triton kernels run on the CPU in Triton's interpreter (tests, ddtree.tools.studies.op_count)",
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
    "/metrics, engine/round/clock.py)",
)
POLICY_TRACE = EnvVar(
    "DDTREE_POLICY_TRACE",
    "",
    "--speculative-ddtree-budget auto: a file the budget policy appends one JSON line per round "
    "to (every rung's expected tokens, seconds and rate; the round before's realised accept and "
    "times; engine/budget/trace.py; unset: none)",
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
        REFERENCE,
        DISABLE,
        FUSED_KERNELS_INTERPRET,
        CACHE,
        BUDGET_PROFILE_DIR,
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
