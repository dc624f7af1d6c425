"""Tree / chain verify attention over paged KV on Hopper (sm_90), in Gluon (Triton's explicit dialect).

The Triton kernel in `triton.py` is latency-bound at 65-node trees (issue slots mostly idle: cp.async address
arithmetic and the wgmma waits). This kernel runs the same split-KV scheme the way FA3 does on Hopper (the
measurements behind each choice: docs/design-numbers.md):
- a 1-warp producer partition (`gl.warp_specialize`) loads the page ids and issues the K/V tiles by TMA (one
  bulk copy per page, completing on the slot's mbarrier) into a ring of `stages` slots; the math warpgroup frees
  a slot with one arrive. Triton 3.6 puts a CTA barrier after every TMA issue and mbarrier op, so issuing from
  the math warps would stall them several times per tile;
- the math warpgroup gathers its Q rows itself (so that load overlaps the producer's first page-id load and
  TMA), keeps Q in registers for S = Q K^T (a wgmma then reads only K from shared memory per tile), and issues
  tile j+1's S = Q K^T and tile j's P V as two async wgmma groups. ptxas places the
  wait for P V(j) before tile j+1's softmax (the SASS: P(j+1) takes P(j)'s registers), so in the compiled
  kernel the softmax overlaps the other program's MMAs on the SM, not this program's P V; a loop that keeps
  the overlap (and one with S two tiles ahead) gained nothing beyond the run-to-run spread;
- a last row block of <= `tail_n` rows (one node's GQA group: a tree of 4k + 1 nodes, every default budget + the
  root, has 4 such rows at G = 4) runs swapped, S^T = K Q^T with the KV positions as wgmma's M and N = tail_n,
  instead of a 64-row block that is almost all padding;
- with block_m = 128 (`PINGPONG`, FA3's shape for head dim 128, and cuDNN's: 2 math warpgroups x 64 rows,
  128-wide tiles, 3 stages, one program per SM) the two math warpgroups are separate partitions that share every
  K/V tile (a slot frees after both arrive) and issue their MMAs in turn through two mbarriers; Q stays in shared
  memory there (the registers go to the 64 x 128 S and P). `dispatch.gluon_config_for` picks it where the
  rows fill their last 128-row block more than half; a 4k + 1-node tree keeps the 64-row blocks and the
  swapped tail.
Grid (q_block, request * kv_head, split), the Triton kernel's tail-split arithmetic: splits 0 .. S - 2 share the
full context tiles every row of the block sees, unmasked; the last split takes the partial context tile and the
new tokens under the mode's mask (causal, tree mask, all). Each writes a normalised partial and its base-2
log-sum-exp, and the Triton `merge.combine` merges (`reference.split_partials_reference` is the oracle). (The
Triton kernel running that last split instead was slower and is gone.)
Rows past the request's length in a tile read finite pool data (the engine's pools are zero-initialised) that
the mask gives weight 0. Written for sm_90, bf16/fp16, head dim 64 or 128, a page size that is a multiple of 8
and divides or is divided by 64 (TMA boxes of min(page, 64) rows) and no `new_kv` (the drafter's block); the
default plan uses it where `dispatch.gluon_unsupported` gives no reason: the checked shapes, and
> 32 rows per request (trees, chains) or <= tail_n (decode, all swapped).
`DDTREE_DISABLE=hopper_attention` turns it off (the Triton kernel then does everything);
DDTREE_REFERENCE=attention still replaces both with the PyTorch reference.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("ddtree")
# why the kernel cannot run here (no Gluon; failed to build or launch): Triton instead
_disabled: list[str] = []

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception as e:  # noqa: BLE001  (no Gluon in this Triton: the Triton kernel does everything)
    _disabled.append(f"no Gluon: {type(e).__name__}: {e}")


@dataclass(frozen=True)
class HopperConfig:
    block_m: int = (
        64  # rows per program: 64 per warpgroup (wgmma M); 128 = two warpgroups (see PINGPONG)
    )
    block_n: int = 64  # KV positions per tile (a multiple of the TMA box, min(page, block_n))
    stages: int = 3  # ring slots
    tail_n: int = (
        8  # a last row block of <= tail_n rows runs swapped (S^T = K Q^T, N = tail_n); 0 = off
    )
    pdl: bool | None = (
        None  # the split merge as a programmatic dependent; None: only for decode (dispatch.gluon_merge_pdl)
    )

    def __post_init__(self):
        # block_m 128: two consumer warpgroups (partitions) of 64 rows each sharing every K/V tile, their MMAs
        # issued in turn (ping-pong), one program per SM
        assert self.block_m in (64, 128) and self.block_n in (64, 128) and self.stages >= 2, self
        assert self.block_n == 64 or self.block_m == 128, self
        assert self.tail_n in (0, 8, 16), self

    @property
    def maxnreg(self) -> int:
        """Registers per thread at launch: 2 x (math + producer warpgroup) x 128 or 3 warpgroups x 168 fill the
        SM's 64K; setmaxnreg then moves them from the producer to the math warps."""
        return 128 if self.block_m == 64 else 168

    def programs_per_sm(self, head_dim: int) -> int:
        smem = (self.block_m + 2 * self.stages * self.block_n) * head_dim * 2 + 2048
        by_regs = 65536 // (self.maxnreg * 32 * 4 * (self.block_m // 64 + 1))
        return max(1, min(233472 // smem, by_regs))


DEFAULT = HopperConfig()
# two consumer warpgroups sharing 128-wide K/V tiles (FA3's shape for head dim 128): faster where the rows fill
# 128-row blocks, slower where a last block would hold a tree's 4-row tail (docs/design-numbers.md)
PINGPONG = HopperConfig(block_m=128, block_n=128, stages=3)


_LOG2E = 1.4426950408889634


def unavailable() -> str | None:
    """Why the kernel cannot run in this process (no Gluon; it failed to build or launch once), or None."""
    return _disabled[0] if _disabled else None


def disable(err: BaseException) -> None:
    if not _disabled:
        logger.warning(
            "Hopper tree-attention kernel unavailable (%s: %s); using the Triton kernel",
            type(err).__name__,
            str(err).splitlines()[0][:200] if str(err) else "",
        )
    _disabled.append(f"{type(err).__name__}: {err}")


if not _disabled:  # Gluon imported
    from ddtree.kernels.tree_attention.hopper_consume import consume

    @gluon.jit
    def _load_pages(
        bt_row,
        tile,
        n_pages,
        PAGE: gl.constexpr,
        BOX: gl.constexpr,
        BN: gl.constexpr,
        layout: gl.constexpr,
    ):
        # the pages of tile's BN // BOX boxes (past the table: page 0, whose rows the mask then ignores)
        pos = tile * BN + gl.arange(0, BN // BOX, layout=layout) * BOX
        return gl.load(bt_row + pos // PAGE, mask=pos // PAGE < n_pages, other=0)

    @gluon.jit
    def _issue_tile(
        k_desc,
        v_desc,
        pages,
        tile,
        k_buf,
        v_buf,
        bar,
        col,
        PAGE: gl.constexpr,
        BOX: gl.constexpr,
        BN: gl.constexpr,
        layout: gl.constexpr,
    ):
        # tile's K and V as BN // BOX TMA boxes of BOX rows (one page run each) into one ring slot
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes * (BN // BOX))
        box = gl.arange(0, BN // BOX, layout=layout)
        for p in gl.static_range(BN // BOX):
            page = gl.sum(gl.where(box == p, pages, 0), axis=0)
            row = (page * PAGE + (tile * BN + p * BOX) % PAGE).to(gl.int32)
            tma.async_copy_global_to_shared(k_desc, [row, col], bar, k_buf.slice(p * BOX, BOX))
            tma.async_copy_global_to_shared(v_desc, [row, col], bar, v_buf.slice(p * BOX, BOX))

    @gluon.jit
    def _split_attn(
        q_ptr,
        k_desc,
        v_desc,
        block_table,
        qo_indptr,
        kv_lens,
        mask_ptr,
        part_o,
        part_lse,
        qk_scale,
        num_splits,
        stride_qt,
        stride_qh,
        stride_bt,
        n_pages,
        stride_mb,
        stride_mt,
        HKV: gl.constexpr,
        G: gl.constexpr,
        D: gl.constexpr,
        PAGE: gl.constexpr,
        BOX: gl.constexpr,
        BM: gl.constexpr,
        BN: gl.constexpr,
        NS: gl.constexpr,
        MODE: gl.constexpr,
        TN: gl.constexpr,
        PDL: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        # the merge may be scheduled now; it waits (griddepcontrol.wait) for this grid's writes
        if PDL:
            gl.inline_asm_elementwise(
                "griddepcontrol.launch_dependents; // dummy $0",
                "=r",
                [],
                dtype=gl.int32,
                is_pure=False,
                pack=1,
            )
        qb = gl.program_id(0)
        b = gl.program_id(1) // HKV
        kvh = gl.program_id(1) % HKV
        split = gl.program_id(2)
        q_start = gl.load(qo_indptr + b)
        q_len = (gl.load(qo_indptr + b + 1) - q_start).to(gl.int32)
        n_rows = q_len * G
        row0 = qb * BM
        if row0 >= n_rows:
            return
        kv_len = gl.load(kv_lens + b).to(gl.int32)
        ctx = kv_len - q_len
        # [0, free_end): seen by every row of the block; [free_end, kv_end): the masked rest (MODE 0 causal,
        # 1 tree mask, 2 all new tokens), done by the last split
        free_end = ctx
        kv_end = kv_len
        if MODE == 0:
            free_end = ctx + row0 // G
            kv_end = ctx + (gl.minimum(row0 + BM, n_rows) - 1) // G + 1
        n_full = free_end // BN
        per_split = (n_full + num_splits - 2) // (num_splits - 1)
        tile_lo = split * per_split
        n_tiles = gl.minimum(tile_lo + per_split, n_full) - tile_lo
        masked = split == num_splits - 1
        if masked:
            tile_lo = n_full
            n_tiles = (kv_end + BN - 1) // BN - n_full
        bt_row = block_table + b * stride_bt

        q_smem = gl.allocate_shared_memory(k_desc.dtype, [BM, D], k_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NS, BN, D], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(k_desc.dtype, [NS, BN, D], k_desc.layout)
        NC: gl.constexpr = BM // 64  # consumer warpgroups, each freeing a slot with one arrive
        full = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(
            gl.int64, [NS + 2 * (NC - 1), 1], mbarrier.MBarrierLayout()
        )
        for i in gl.static_range(NS):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=NC)
        if NC == 2:  # the two turn barriers of the ping-pong
            mbarrier.init(empty.index(NS), count=1)
            mbarrier.init(empty.index(NS + 1), count=1)
        fence_async_shared()
        gl.thread_barrier()  # the barriers are initialised before either partition uses them
        # the consumer gathers Q itself, so that load overlaps the producer's first page-id load and TMA;
        # every partition takes the same bundles (hopper_consume.consume says what each holds)
        ring = (k_bufs, v_bufs, full, empty)
        job = (tile_lo, n_tiles, masked, qk_scale)
        mask_row = mask_ptr + b * stride_mb
        blk = (row0, n_rows, ctx, kv_len, mask_row, stride_mt)
        dest = (part_o, part_lse, q_start, kvh, split, num_splits)
        # constexprs go inline, never in a bundle (Gluon passes a bundled one as a run-time value)
        prod = (
            k_desc,
            v_desc,
            bt_row,
            k_bufs,
            v_bufs,
            full,
            empty,
            tile_lo,
            n_tiles,
            kvh * D,
            n_pages,
        )
        if NC == 1:
            turns = (empty.index(0), empty.index(0))  # unused without the ping-pong
            gl.warp_specialize(
                [
                    (consume, (q_ptr, stride_qt, stride_qh, q_smem, ring, turns, job, blk, dest,
                               HKV, G, D, BM, BN, NS, MODE, TN, False, 0, num_warps)),
                    (_produce, (prod, PAGE, BOX, BN, NS)),
                ],
                [1],
                [24],
            )  # fmt: skip
        else:  # ping-pong: the first warpgroup issues its MMAs first, then they alternate tile by tile
            lo, hi = empty.index(NS), empty.index(NS + 1)
            blk_hi = (row0 + 64, n_rows, ctx, kv_len, mask_row, stride_mt)
            gl.warp_specialize(
                [
                    (consume, (q_ptr, stride_qt, stride_qh, q_smem.slice(0, 64), ring, (lo, hi),
                               job, blk, dest, HKV, G, D, 64, BN, NS, MODE, 0, True, 1, 4)),
                    (consume, (q_ptr, stride_qt, stride_qh, q_smem.slice(64, 64), ring, (hi, lo),
                               job, blk_hi, dest, HKV, G, D, 64, BN, NS, MODE, 0, True, 0, 4)),
                    (_produce, (prod, PAGE, BOX, BN, NS)),
                ],
                [4, 1],
                [232, 24],
            )  # fmt: skip

    @gluon.jit
    def _produce(
        io,
        PAGE: gl.constexpr,
        BOX: gl.constexpr,
        BN: gl.constexpr,
        NS: gl.constexpr,
    ):
        k_desc, v_desc, bt_row, k_bufs, v_bufs, full, empty, tile_lo, n_tiles, col, n_pages = io
        # one warp: page ids and TMA issues for every tile, a slot as soon as the consumer frees it
        # whole in every thread
        pg_layout: gl.constexpr = gl.BlockedLayout([BN // BOX], [32], [1], [0])
        for j in range(n_tiles):
            slot = j % NS
            pages = _load_pages(
                bt_row, tile_lo + j, n_pages, PAGE, BOX, BN, pg_layout
            )  # overlaps the wait
            mbarrier.wait(empty.index(slot), ((j // NS) & 1) ^ 1)  # a fresh barrier passes parity 1
            _issue_tile(
                k_desc,
                v_desc,
                pages,
                tile_lo + j,
                k_bufs.index(slot),
                v_bufs.index(slot),
                full.index(slot),
                col,
                PAGE,
                BOX,
                BN,
                pg_layout,
            )


def tail_n(cfg: HopperConfig, group: int) -> int:
    """N of the swapped tail block (0: none): one node's GQA group must fit, and only 64-row blocks have it."""
    return cfg.tail_n if cfg.block_m == 64 and 0 < group <= cfg.tail_n else 0


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _descriptor(pool: torch.Tensor, box: int):
    s, hkv, d = pool.shape
    dt = gl.bfloat16 if pool.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([box, d], dt)
    return TensorDescriptor(pool.view(s, hkv * d), [s, hkv * d], [hkv * d, 1], [box, d], layout)


def launch_splits(
    q,
    k_pool,
    v_pool,
    block_table,
    qo_indptr,
    kv_lens,
    page_size,
    scale,
    part_o,
    part_lse,
    num_splits: int,
    max_q_len: int,
    mode: int,
    mask: torch.Tensor,
    stride_mb: int,
    stride_mt: int,
    cfg: HopperConfig = DEFAULT,
    pdl: bool = False,
) -> None:
    """Every split of every row: 0 .. num_splits - 2 over the full context tiles, the last over the masked
    rest (see the module docstring). mode: 0 causal, 1 tree mask (uint8 [b, n, n] `mask`), 2 all new
    tokens visible. pdl: the merge that follows is launched as a programmatic dependent, so trigger it."""
    assert num_splits >= 2
    hkv, d = k_pool.shape[1], k_pool.shape[2]
    group = q.shape[1] // hkv
    q_blocks = -(-(max_q_len * group) // cfg.block_m)
    box = min(page_size, cfg.block_n)
    b = qo_indptr.shape[0] - 1
    _split_attn[(q_blocks, b * hkv, num_splits)](
        q,
        _descriptor(k_pool, box),
        _descriptor(v_pool, box),
        block_table,
        qo_indptr,
        kv_lens,
        mask,
        part_o,
        part_lse,
        scale * _LOG2E,
        num_splits,
        q.stride(0),
        q.stride(1),
        block_table.stride(0),
        block_table.shape[1],
        stride_mb,
        stride_mt,
        HKV=hkv,
        G=group,
        D=d,
        PAGE=page_size,
        BOX=box,
        BM=cfg.block_m,
        BN=cfg.block_n,
        NS=cfg.stages,
        MODE=mode,
        TN=tail_n(cfg, group),
        PDL=pdl,
        num_warps=4,
        maxnreg=cfg.maxnreg,
    )
