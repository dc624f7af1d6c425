"""Paged attention on the split-KV kernels: the call's arguments, its `dispatch.LaunchPlan`, the launch (the
Triton kernel of `triton.py` or the Gluon kernel of `hopper.py` for the splits, then `merge.combine`).

Contract (same as `reference.paged_attention_reference`): q [T, Hq, D] holds request i's q_len_i new tokens at
rows qo_indptr[i]..qo_indptr[i+1]; they sit at logical KV positions kv_len_i - q_len_i .. kv_len_i - 1, whose
K/V are in the paged pools (or, with `new_kv`, in dense rows aligned with q). Every cached position
(< kv_len_i - q_len_i) is visible; among the new tokens visibility is causal, all-to-all (causal=False), or
`tree_mask[i, t, c]` (bool [b, n, n], n >= max q_len, ancestors-and-self).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from ddtree.kernels.tree_attention import dispatch, hopper
from ddtree.kernels.tree_attention.dispatch import AttentionShape, LaunchPlan
from ddtree.kernels.tree_attention.merge import combine, pdl_ok
from ddtree.kernels.tree_attention.triton import split_kv_attn
from ddtree.kernels.tree_attention.tuning import KernelConfig, resident_slots

LOG2E = 1.4426950408889634  # the kernel's softmax is base 2: scores scaled by scale * log2(e)


def _dot_mode(dtype: torch.dtype) -> int:
    if triton.knobs.runtime.interpret:
        return 2
    return 1 if dtype == torch.float32 else 0


def paged_attention(*args, **kw) -> torch.Tensor:
    """`paged_attention_plan` (same arguments) without the plan: [T, Hq, D]."""
    return paged_attention_plan(*args, **kw)[0]


def paged_attention_plan(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    scale: float,
    *,
    max_q_len: int,
    max_kv_len: int,
    tree_mask: torch.Tensor | None = None,
    causal: bool = True,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int | None = None,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
    hopper_ctx: bool | hopper.HopperConfig | None = None,
    plan: LaunchPlan | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, LaunchPlan | None]:
    """See the module docstring. `max_q_len` and `max_kv_len` are host ints bounding the batch (they size the
    grid and the split count only; pass the captured maxima under a CUDA graph). Without a tree mask the new
    tokens see each other causally, or all of them when `causal` is False. `new_kv` = (k, v) [T, Hkv, D] rows
    aligned with q: the new tokens' K/V are read from there instead of the pools (the drafter's block K/V,
    which is never stored). `window` W: a sliding window, keys with |query pos - key pos| < W (not with a
    tree mask). num_splits / config / hopper_ctx: passed to `dispatch.plan` (hopper_ctx True /
    None: the Gluon kernel of `hopper.py` wherever it is supported), unless `plan` is given. Returns
    ([T, Hq, D], the plan that ran; None for an empty batch)."""
    T, hq, dim = q.shape
    hkv = k_pool.shape[1]
    assert hq % hkv == 0 and dim == k_pool.shape[2] and dim >= 16 and dim & (dim - 1) == 0
    assert k_pool.stride(-1) == 1 and k_pool.stride() == v_pool.stride()
    b = qo_indptr.shape[0] - 1
    if out is None:
        out = torch.empty(T, hq, dim, dtype=q.dtype, device=q.device)
    if T == 0 or b == 0:
        return out, None
    if q.dtype != k_pool.dtype or q.stride(-1) != 1:
        q = q.to(k_pool.dtype).contiguous()
    mode = 1 if tree_mask is not None else 0 if causal else 2
    window = int(window or 0)
    if window and tree_mask is not None:
        raise ValueError(
            "a sliding window with a tree mask: node positions are depths, not indices"
        )
    if tree_mask is not None:
        mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
        assert mask.stride(-1) == 1
        smb, smt = mask.stride(0), mask.stride(1)
    else:
        mask, smb, smt = kv_lens, 0, 0
    if new_kv is not None:
        k_ext, v_ext = (t.to(k_pool.dtype).contiguous() for t in new_kv)
        assert k_ext.shape == (T, hkv, dim) and v_ext.shape == (T, hkv, dim)
    else:
        k_ext = v_ext = k_pool

    args = kernel_args(
        q,
        (k_pool, v_pool, k_ext, v_ext),
        (block_table, qo_indptr, kv_lens),
        (mask, smb, smt),
        out,
        scale * LOG2E,
        window,
    )

    shape = AttentionShape.of(
        q, k_pool, qo_indptr, page_size, max_q_len, max_kv_len, mode, new_kv is not None, window
    )

    def plan_for(hopper_ctx) -> LaunchPlan:
        return dispatch.plan(
            shape,
            q.device,
            num_splits=num_splits,
            config=config,
            hopper_ctx=hopper_ctx,
            triton_slots=lambda cfg: triton_slots(shape, cfg, q.device, args),
        )

    if plan is None:
        plan = plan_for(hopper_ctx)
    gluon_args = (q, k_pool, v_pool, block_table, qo_indptr, kv_lens, scale, mask, smb, smt)
    if plan.kernel == "hopper":
        try:
            run_plan(plan, shape, args, out, gluon_args)
            return out, plan
        except Exception as e:  # noqa: BLE001 - e.g. another Triton's Gluon: fall back, once and for all
            hopper.disable(e)
            plan = dataclasses.replace(
                plan_for(False), fallback=f"the Gluon kernel failed: {type(e).__name__}"
            )
    run_plan(plan, shape, args, out, gluon_args)
    return out, plan


def _consts(shape: AttentionShape, cfg: KernelConfig) -> dict:
    return dict(
        HKV=shape.num_kv_heads,
        G=shape.group,
        D=shape.head_dim,
        PAGE=shape.page_size,
        BLOCK_M=cfg.block_m,
        TAIL_M=cfg.tail_m,
        BLOCK_N=cfg.block_n,
        TREE_N=cfg.tree_n,
        TAIL_SPLIT=cfg.tail_split,
        MODE=shape.mode,
        EXTRA=shape.new_kv,
        WINDOW=shape.window > 0,
        DOT=_dot_mode(shape.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def triton_slots(shape: AttentionShape, cfg: KernelConfig, device: torch.device, args=None) -> int:
    """Resident programs of the split kernel variant that `cfg` and `shape` compile to (SMs x per SM). args:
    the call's argument builder (None: stand-in tensors of the shape's dtypes, for a plan asked ahead)."""
    consts = _consts(shape, cfg)
    key = tuple(sorted((k, str(v)) for k, v in consts.items())) + (str(shape.dtype),)
    if args is None:
        args = _stand_in_args(shape, device)
    f32 = torch.empty(1, dtype=torch.float32, device=device)
    # the variant a split launch uses (PDL as there), so that launch reuses this compile
    return resident_slots(
        device,
        key,
        lambda: split_kv_attn.warmup(
            *args(2, f32, f32), grid=(1,), SPLIT=True, PDL=pdl_ok(device), **consts
        ),
    )


def kernel_args(q, kv, table, mask, out, qk_scale: float, window: int):
    """args(splits, part_o, part_lse) -> the kernel's arguments in its order. kv: (k_pool, v_pool, k_ext,
    v_ext); table: (block_table, qo_indptr, kv_lens); mask: (tree mask, its batch and row strides)."""
    k_pool, v_pool, k_ext, v_ext = kv
    block_table, qo_indptr, kv_lens = table
    mask, smb, smt = mask

    def args(split_count, part_o, part_lse):
        return (
            q,
            k_pool,
            v_pool,
            block_table,
            qo_indptr,
            kv_lens,
            mask,
            out,
            part_o,
            part_lse,
            k_ext,
            v_ext,
            qk_scale,
            split_count,
            q.stride(0),
            q.stride(1),
            k_pool.stride(0),
            k_pool.stride(1),
            block_table.stride(0),
            out.stride(0),
            out.stride(1),
            smb,
            smt,
            k_ext.stride(1),
            k_ext.stride(0),
            window,
        )

    return args


def _stand_in_args(shape: AttentionShape, device: torch.device):
    hq, hkv, d, p = shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.page_size
    q = torch.zeros(1, hq, d, dtype=shape.dtype, device=device)
    pool = torch.zeros(p, hkv, d, dtype=shape.dtype, device=device)
    ints = torch.zeros(2, dtype=torch.int64, device=device)
    table = torch.zeros(1, 1, dtype=torch.int64, device=device)
    mask = torch.zeros(1, 1, 1, dtype=torch.uint8, device=device) if shape.mode == 1 else ints
    smb, smt = (1, 1) if shape.mode == 1 else (0, 0)

    return kernel_args(
        q, (pool, pool, pool, pool), (table, ints, ints), (mask, smb, smt), q, 1.0, shape.window
    )


def run_plan(
    plan: LaunchPlan, shape: AttentionShape, args, out: torch.Tensor, gluon_args: tuple
) -> None:
    """Launch `plan` ("hopper" or "triton"): the split kernels, then the merge. args(splits, part_o,
    part_lse): the Triton kernel's arguments; gluon_args: (q, k_pool, v_pool, block_table, qo_indptr, kv_lens,
    scale, mask, stride_mb, stride_mt) for `hopper.launch_splits`."""
    cfg, num_splits, hop, pdl = plan.config, plan.num_splits, plan.hopper, plan.pdl
    T, hq, dim = out.shape
    split = num_splits > 1
    if split:
        part_o = torch.empty(T, hq, num_splits, dim, dtype=torch.float32, device=out.device)
        part_lse = torch.empty(T, hq, num_splits, dtype=torch.float32, device=out.device)
    else:
        part_o = part_lse = out
    if hop:
        q, k_pool, v_pool, block_table, qo_indptr, kv_lens, scale, mask, smb, smt = gluon_args
        hopper.launch_splits(
            q,
            k_pool,
            v_pool,
            block_table,
            qo_indptr,
            kv_lens,
            shape.page_size,
            scale,
            part_o,
            part_lse,
            num_splits,
            shape.max_q_len,
            shape.mode,
            mask,
            smb,
            smt,
            hop,
            pdl,
        )
    else:
        q_blocks = -(-shape.rows // cfg.block_m)
        grid = (q_blocks, shape.batch * shape.num_kv_heads, num_splits)
        split_kv_attn[grid](
            *args(num_splits, part_o, part_lse), SPLIT=split, PDL=pdl, **_consts(shape, cfg)
        )
    if split:
        combine[(T, hq)](
            part_o,
            part_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HQ=hq,
            D=dim,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            PDL=pdl,
            num_warps=cfg.combine_warps,
            launch_pdl=pdl,
        )
