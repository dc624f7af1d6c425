"""Which kernel runs a paged-attention call, with which tiles, splits and PDL: a frozen `LaunchPlan`
from the call's host shape (`AttentionShape`) and the device, decided here once, launched by
`launch.run_plan` (the Triton kernel or the Gluon kernel of `hopper.py` for the splits, the split
merge).

The rules (the measurements behind them: BENCHMARKS.md, docs/design-numbers.md):
- tiles: `tuning.default_config` from rows per request (q tokens x GQA group), head dim and context;
- the Gluon kernel (`gluon_unsupported` says where not) does every split of tree / chain rows
  (> 32 rows) and decode rows, `gluon_config_for` picks its config; never with `new_kv` (the
  drafter's block) or a sliding window (the Triton kernel masks it per row), never with one split
  asked for;
- splits: the fewest that fill the GPU's resident slots (`tuning.choose_num_splits`), unless fixed
  by the caller (a CUDA graph fixes them per bucket); the Gluon kernel always has >= 2 (its last
  split is the masked one);
- PDL: the merge launches as a programmatic dependent on sm_90 (`merge.pdl_ok`), after the Gluon
  kernel only where `gluon_merge_pdl` says.
A plan depends only on host ints and the device, so a CUDA graph captured with a plan replays that
plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ddtree.kernels.tree_attention.tuning import (
    KernelConfig,
    choose_num_splits,
    default_config,
    split_min_tiles,
)

MODES = {
    "causal": 0,
    "tree": 1,
    "all": 2,
}  # how new tokens see each other (the kernels' MODE constexpr)


@dataclass(frozen=True)
class AttentionShape:
    """The host-side shape of one call: what the plan may depend on."""

    batch: int
    max_q_len: int
    max_kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype  # the pools' dtype
    mode: int = 0  # MODES
    new_kv: bool = False  # the new tokens' K/V come alongside (drafter block), not from the pools
    pools_ok: bool = True  # the pools are contiguous and 16-byte aligned (TMA descriptors)
    window: int = 0  # sliding window (0: none); the Triton kernel applies it, never the Gluon one

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def rows(self) -> int:
        """Rows per request, at most: q tokens x GQA group."""
        return self.max_q_len * self.group

    @classmethod
    def of(
        cls, q, k_pool, qo_indptr, page_size, max_q_len, max_kv_len, mode, new_kv, window=0
    ) -> AttentionShape:
        return cls(
            qo_indptr.shape[0] - 1,
            max_q_len,
            max_kv_len,
            q.shape[1],
            k_pool.shape[1],
            q.shape[2],
            page_size,
            k_pool.dtype,
            mode,
            new_kv,
            k_pool.is_contiguous() and k_pool.data_ptr() % 16 == 0,
            window,
        )


@dataclass(frozen=True)
class LaunchPlan:
    """kernel: "hopper" (the Gluon kernel's splits, then the merge), "triton" (split kernel, then
    the merge when num_splits > 1) or "reference" (PyTorch). config: the Triton tiles (its kernel,
    the merge's warps); fallback: why not Gluon (or why the reference), None where nothing was
    refused."""

    kernel: str
    config: KernelConfig | None = None
    hopper: object | None = None  # hopper.HopperConfig
    num_splits: int = 1
    pdl: bool = False
    fallback: str | None = None

    @property
    def capture_key(self) -> tuple:
        """What a CUDA graph of the call fixes: buckets with equal keys share a graph."""
        return self.num_splits, self.kernel == "hopper"


def reference_plan(why: str) -> LaunchPlan:
    return LaunchPlan("reference", fallback=why)


def plan(
    shape: AttentionShape,
    device: torch.device,
    *,
    num_splits: int | None = None,
    config: KernelConfig | None = None,
    hopper_ctx=None,
    triton_slots: Callable[[KernelConfig], int] | None = None,
) -> LaunchPlan:
    """The plan of one call. num_splits: fixed (None: chosen here); config: fixed Triton tiles;
    hopper_ctx: True / None (Gluon wherever supported), False (never), or a HopperConfig (that
    one). triton_slots(config): resident Triton
    programs on the device (the launcher's compiled variant); needed only when the Triton kernel's
    split count is chosen here."""
    from ddtree.kernels.tree_attention import hopper, merge

    rows = shape.rows
    cfg = config or default_config(rows, shape.head_dim, shape.max_kv_len)
    why = None
    hop = hopper_ctx
    if hop is None or hop is True:
        why = (
            "the drafter block's K/V come alongside"
            if shape.new_kv
            else "a sliding window (the Triton kernel applies it)"
            if shape.window
            else "one split asked for"
            if num_splits == 1
            else gluon_unsupported(shape, device)
        )
        hop = gluon_config_for(rows) if why is None else None
    elif hop is False:
        why, hop = "hopper_ctx=False", None
    if hop is not None and shape.window:
        raise ValueError(f"hopper_ctx={hop}: the Gluon kernel has no sliding window")
    if hop is not None:
        if num_splits is None:
            slots = hop.programs_per_sm(shape.head_dim) * hopper.sm_count(device)
            num_splits = choose_num_splits(
                -(-rows // hop.block_m) * shape.batch * shape.num_kv_heads,
                shape.max_kv_len,
                hop.block_n,
                slots,
                min_tiles=split_min_tiles(rows),
                tail_split=True,
            )
        num_splits = max(num_splits, 2)
    elif num_splits is None:
        q_blocks = -(-rows // cfg.block_m)
        slots = triton_slots(cfg) if triton_slots is not None else 2 * 132
        num_splits = choose_num_splits(
            q_blocks * shape.batch * shape.num_kv_heads,
            shape.max_kv_len,
            cfg.block_n,
            slots,
            min_tiles=split_min_tiles(rows),
            tail_split=cfg.tail_split,
        )
    # the merge as a programmatic dependent (it hides the launch gap): after the Triton kernel, after
    # the Hopper kernel where gluon_merge_pdl says
    pdl = (
        num_splits > 1
        and merge.pdl_ok(device)
        and (hop is None or gluon_merge_pdl(hop, rows, shape.group))
    )
    return LaunchPlan("hopper" if hop is not None else "triton", cfg, hop, num_splits, pdl, why)


# ---- the Gluon (sm_90) kernel's rules: where the default plan uses it, with which config
# ----------------

# Gluon is experimental and its API moves between Triton releases (warp_specialize's arguments
# already differ on Triton's main branch): only the release the kernel was written and checked with
# is tried.
GLUON_TRITON_VERSIONS = ("3.6.",)
# What has been run against the reference on the H200 (BENCHMARKS.md): bf16, head dim 128, 16-token
# pages. The kernel also compiles for sm_90 at head dim 64 and 32-128-token pages
# (tree_attention_compile_report.py) and is written for fp16, but until those run on the device they
# stay with the Triton kernel.
GLUON_CHECKED_ON_DEVICE = {"dtypes": (torch.bfloat16,), "head_dims": (128,), "page_sizes": (16,)}


def gluon_config_for(rows_per_request: int):
    """The default plan's HopperConfig: PINGPONG when the rows fill their last 128-row block
    more than half, else DEFAULT (64-row blocks, a swapped block for a one-node tail or a decode
    token's group)."""
    from ddtree.kernels.tree_attention.hopper import DEFAULT, PINGPONG

    rest = rows_per_request % PINGPONG.block_m
    return PINGPONG if rest == 0 or rest > PINGPONG.block_m // 2 else DEFAULT


def gluon_rows_supported(rows_per_request: int, group: int) -> bool:
    """> 32 rows: 64-row blocks (+ a swapped tail); <= tail_n: one swapped block (decode).
    17..32: Triton."""
    from ddtree.kernels.tree_attention.hopper import DEFAULT, tail_n

    return rows_per_request > 32 or 0 < rows_per_request <= tail_n(DEFAULT, group)


def gluon_merge_pdl(cfg, rows_per_request: int, group: int) -> bool:
    """Whether the merge after the Gluon kernel launches as a programmatic dependent (the kernel
    then triggers it first thing). By default only for decode-shaped launches (all blocks swapped),
    where the launch gap is a visible share of a memory-bound call; the caller still checks
    merge.pdl_ok."""
    from ddtree.kernels.tree_attention.hopper import tail_n

    if cfg.pdl is not None:
        return cfg.pdl
    return rows_per_request <= tail_n(cfg, group)


def gluon_unsupported(shape: AttentionShape, device: torch.device) -> str | None:
    """Why the default plan does not use the Gluon kernel for `shape`, or None. It does on
    Hopper for the dtype / head dim / page size in GLUON_CHECKED_ON_DEVICE and rows per request (q
    tokens x GQA group) either > 32 (trees, chains) or <= DEFAULT.tail_n (decode: one token's group,
    the swapped path); rows in between stay with the Triton kernel's 16/32-row blocks."""
    import triton

    from ddtree import envs
    from ddtree.kernels.tree_attention import hopper

    if hopper.unavailable():
        return f"the Gluon kernel is unavailable: {hopper.unavailable()}"
    if not triton.__version__.startswith(GLUON_TRITON_VERSIONS):
        return f"Gluon checked only with Triton {GLUON_TRITON_VERSIONS}, not {triton.__version__}"
    if envs.DISABLE.has("hopper_attention"):
        return f"{envs.DISABLE.name}=hopper_attention is set"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "not sm_90"
    checked = GLUON_CHECKED_ON_DEVICE
    if (
        shape.dtype not in checked["dtypes"]
        or shape.head_dim not in checked["head_dims"]
        or shape.page_size not in checked["page_sizes"]
    ):
        return (
            f"{shape.dtype}, head dim {shape.head_dim}, page {shape.page_size}: not checked on the "
            "device"
        )
    if not gluon_rows_supported(shape.rows, shape.group):
        return f"{shape.rows} rows per request (17..32 or a GQA group wider than the swapped tail)"
    if not shape.pools_ok:
        return "the KV pools are not contiguous and 16-byte aligned"
    return None
