"""The DDTree node selection (`ddtree.speculative.tree.select_nodes`) in one launch: one program per
request runs the per-depth beam over all D depths, the final best-`budget` selection (depth
limits, shadow-linear, the per-request budget cut), the node order, parents and the ancestor
mask; the PyTorch form launches ~13 ops per depth (three of them a radix sort).

Phases of a program (B = budget, K = candidates per depth, T = `num_candidates(B, K)`):
1. the candidate table: pair c = (parent slot s, rank r), in flat (s, r) order, for the T pairs
   with (s + 1)(r + 1) <= B and r < K (`_beam_candidates`); slot s starts at
   sum_{r<K} min(s, B // (r + 1)).
2. per depth d: cand[c] = beam_{d-1}[s] + logp[d, r] (the same fp32 add as PyTorch, so the
   same bits), and the top B of the T candidates by `score_key` (descending score, ties to the
   lower c: PyTorch's stable sort) -> the depth's beam scores and picks, best first.
3. the D * B prefixes keyed by score (-inf past the depth limit, +inf on the shadow chain) and
   flat index (depth-major: ties to the shallower prefix): the top B, best first; path scores;
   the budget cut; the node order = ascending flat index of the kept ones, padding last; each
   node's parent through a flat -> node map.
4. the ancestor mask: every node's ancestors walked up D steps, then row blocks of the mask.

Programs hand data between phases through a per-request int32 / fp32 workspace in global memory
(gathers at data-dependent indices), each hand-off behind a CTA barrier (`tl.debug_barrier`: its
writes are visible to the whole program after it). Launched with num_stages=1: the software
pipeliner must not hoist a depth's workspace loads above the previous depth's barrier.
No host sync, shapes static per (b, B, K, D): CUDA-graph capturable (the first call compiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree import envs
from ddtree.kernels.tree_build.bitonic import (
    bitonic_topk,
    key_index,
    key_score,
    score_key,
)
from ddtree.speculative.tree import TreeNodes

_decorated_interpreted = envs.TRITON_INTERPRET.on()

TILE = 1024  # elements of a 2D tile (candidate table, mask rows)


@triton.jit
def _beam_depth(prev, lp_ptr, d, s_ld, crank, c, cv, sc_ws, pick_ws, p, pv,
                B: tl.constexpr, LOG_TP: tl.constexpr, LOG_BP: tl.constexpr):  # fmt: skip
    """Depth d's beam from the parents' scores `prev` of the candidates: its B best, stored."""
    lp = tl.load(lp_ptr + d * s_ld + crank, mask=cv, other=float("-inf"))
    top = bitonic_topk(score_key(prev + lp, c, cv), LOG_TP, LOG_BP, 1)
    tl.store(sc_ws + d * B + p, key_score(top), mask=pv)
    tl.store(pick_ws + d * B + p, key_index(top), mask=pv)
    tl.debug_barrier()  # the next depth gathers these scores at its candidates' slots


@triton.jit
def _tree_build_kernel(
    logp_ptr, ids_ptr, root_ptr, limit_ptr, cut_ptr,
    tok_ptr, par_ptr, dep_ptr, valid_ptr, mask_ptr, pscore_ptr, score_ws, index_ws,
    s_lb, s_ld, s_ib, s_id, s_root, s_limit, s_cut,
    B: tl.constexpr, K: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
    BP: tl.constexpr, LOG_BP: tl.constexpr, TP: tl.constexpr, LOG_TP: tl.constexpr,
    FP: tl.constexpr, LOG_FP: tl.constexpr, KP: tl.constexpr, SB: tl.constexpr,
    NP: tl.constexpr, RB: tl.constexpr, SHADOW: tl.constexpr, HAS_CUT: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = B + 1
    DB: tl.constexpr = D * B
    lp_ptr = logp_ptr + i * s_lb
    sc_ws = score_ws + i * DB  # [D * B] fp32: each depth's beam scores, best first
    tab_slot = index_ws + i * (2 * TP + 2 * DB + D * NP)  # [TP] candidate -> parent slot
    tab_rank = tab_slot + TP  # [TP] candidate -> rank
    pick_ws = tab_rank + TP  # [D * B] each depth's beam: the candidate it came from
    node_ws = pick_ws + DB  # [D * B] flat prefix -> node id (kept nodes only)
    anc_ws = node_ws + DB  # [D, NP] each node's ancestor t + 1 steps up (the root stays)

    # 1. the candidate table, SB slots at a time
    rr = tl.arange(0, KP)
    for s0 in range(0, BP, SB):
        s = s0 + tl.arange(0, SB)
        below = tl.minimum(s[:, None], B // (rr[None, :] + 1))
        start = tl.reduce(tl.where(rr[None, :] < K, below, 0), 1, tl.standard._sum_combine)
        per = tl.where(s < B, tl.minimum(B // (s + 1), K), 0)
        at = start[:, None] + rr[None, :]
        m = rr[None, :] < per[:, None]
        tl.store(tab_slot + at, tl.broadcast_to(s[:, None], (SB, KP)), mask=m)
        tl.store(tab_rank + at, tl.broadcast_to(rr[None, :], (SB, KP)), mask=m)
    tl.debug_barrier()

    # 2. the beam, depth by depth
    c = tl.arange(0, TP)
    cv = c < T
    cslot = tl.load(tab_slot + c, mask=cv, other=0)
    crank = tl.load(tab_rank + c, mask=cv, other=0)
    p = tl.arange(0, BP)
    pv = p < B
    root_only = tl.where(cslot == 0, 0.0, float("-inf"))  # depth 0: the root, score 0, slot 0
    _beam_depth(root_only, lp_ptr, 0, s_ld, crank, c, cv, sc_ws, pick_ws, p, pv, B, LOG_TP, LOG_BP)
    for d in range(1, D):
        prev = tl.load(sc_ws + (d - 1) * B + cslot, mask=cv, other=float("-inf"))
        _beam_depth(prev, lp_ptr, d, s_ld, crank, c, cv, sc_ws, pick_ws, p, pv, B, LOG_TP, LOG_BP)

    # 3. the best B prefixes of all depths, the budget cut, the node order and parents
    lim = tl.load(limit_ptr + i * s_limit).to(tl.int32)
    f = tl.arange(0, FP)
    fv = f < DB
    score = tl.load(sc_ws + f, mask=fv, other=float("-inf"))
    ok = (score > float("-inf")) & (f // B + 1 <= lim)
    key = tl.where(ok, score, float("-inf"))
    if SHADOW:  # the top-1 chain (slot 0 of every depth) first: accept length >= the chain's
        key = tl.where((f % B == 0) & (f // B + 1 <= tl.minimum(lim, B)), float("inf"), key)
    sel = key_index(bitonic_topk(score_key(key, f, fv), LOG_FP, LOG_BP, 1))  # flat, best first
    sel_score = tl.load(sc_ws + sel, mask=pv, other=float("-inf"))
    sel_ok = (sel_score > float("-inf")) & (sel // B + 1 <= lim) & pv
    tl.store(pscore_ptr + i * B + p, tl.where(sel_ok, sel_score, float("-inf")), mask=pv)
    if HAS_CUT:
        sel_ok = sel_ok & (p < tl.load(cut_ptr + i * s_cut))
    # kept nodes in flat order (depth, then beam slot = score order), then the rest
    order = tl.where(pv, tl.where(sel_ok, sel, sel + DB), 2 * DB + p)
    order = bitonic_topk(order, LOG_BP, LOG_BP, 0)
    kept = order < DB
    flat = tl.where(kept, order, 0)
    depth = flat // B + 1
    pick = tl.load(pick_ws + flat, mask=kept, other=0)
    pslot = tl.load(tab_slot + pick, mask=kept, other=0)
    rank = tl.load(tab_rank + pick, mask=kept, other=0)
    token = tl.load(ids_ptr + i * s_ib + (depth - 1) * s_id + rank, mask=kept, other=0)
    tl.store(node_ws + flat, p + 1, mask=kept)
    tl.debug_barrier()
    # a kept node's parent is kept (it ranks before its child): its id is in the map
    up = (depth >= 2) & kept
    parent = tl.load(node_ws + (depth - 2) * B + pslot, mask=up, other=0)  # depth 1: the root

    row = i * N
    tl.store(tok_ptr + row, tl.load(root_ptr + i * s_root).to(tl.int64))
    tl.store(par_ptr + row, -1)
    tl.store(dep_ptr + row, 0)
    tl.store(valid_ptr + row, 1)
    tl.store(tok_ptr + row + 1 + p, tl.where(kept, token, 0), mask=pv)
    tl.store(par_ptr + row + 1 + p, tl.where(kept, parent, -1), mask=pv)
    tl.store(dep_ptr + row + 1 + p, tl.where(kept, depth, 0), mask=pv)
    tl.store(valid_ptr + row + 1 + p, kept.to(tl.uint8), mask=pv)
    tl.debug_barrier()

    # 4. the ancestor mask: row j = j and its ancestors (padding, parent -1: itself only)
    j = tl.arange(0, NP)
    jv = j < N
    cur = j
    for step in range(D):
        above = tl.load(par_ptr + row + cur, mask=jv, other=-1).to(tl.int32)
        cur = tl.where(above >= 0, above, cur)
        tl.store(anc_ws + step * NP + j, cur)
    tl.debug_barrier()
    for r0 in range(0, N, RB):
        rows = r0 + tl.arange(0, RB)
        rv = rows < N
        m = rows[:, None] == j[None, :]
        for t in tl.static_range(D):  # unrolled: the D loads are independent
            a = tl.load(anc_ws + t * NP + rows, mask=rv, other=-1)
            m = m | (a[:, None] == j[None, :])
        at = mask_ptr + row * N + rows[:, None] * N + j[None, :]
        tl.store(at, m.to(tl.uint8), mask=rv[:, None] & jv[None, :])


def num_candidates(B: int, K: int) -> int:
    """T: the (slot, rank) pairs a depth's top B can come from (`_beam_candidates`)."""
    return sum(min(K, B // (s + 1)) for s in range(B))


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def launch_config(B: int, K: int, D: int) -> dict:
    """Constexpr sizes and warps for budget B, K candidates per depth, D depths."""
    T = num_candidates(B, K)
    BP, KP, NP = _pow2(B), _pow2(K), _pow2(B + 1)
    TP, FP = max(BP, _pow2(T)), max(BP, _pow2(D * B))
    return dict(
        T=T,
        BP=BP,
        LOG_BP=BP.bit_length() - 1,
        TP=TP,
        LOG_TP=TP.bit_length() - 1,
        FP=FP,
        LOG_FP=FP.bit_length() - 1,
        KP=KP,
        SB=min(BP, max(1, TILE // KP)),
        NP=NP,
        RB=min(NP, max(1, TILE // NP)),
        num_warps=4 if max(FP, TP) <= 1024 else 8,
    )


def select_nodes_triton(
    root_tokens: torch.Tensor,
    logp: torch.Tensor,
    ids: torch.Tensor,
    budget: int,
    shadow_linear: bool,
    limit: torch.Tensor,
    budgets: torch.Tensor | None = None,
    num_warps: int | None = None,
) -> TreeNodes:
    """`select_nodes` in one launch (module docstring); the caller checks `supported`."""
    b, D, K = logp.shape
    B, dev = budget, logp.device
    cfg = launch_config(B, K, D)
    default_warps = cfg.pop("num_warps")
    logp = logp if logp.stride(-1) == 1 else logp.contiguous()
    ids = ids if ids.stride(-1) == 1 else ids.contiguous()
    N = B + 1
    tokens, parents, depths = (torch.empty(b, N, dtype=torch.int64, device=dev) for _ in range(3))
    valid = torch.empty(b, N, dtype=torch.bool, device=dev)
    mask = torch.empty(b, N, N, dtype=torch.bool, device=dev)
    path_scores = torch.empty(b, B, dtype=torch.float32, device=dev)
    score_ws = torch.empty(b, D * B, dtype=torch.float32, device=dev)
    index_ws = torch.empty(
        b, 2 * cfg["TP"] + 2 * D * B + D * cfg["NP"], dtype=torch.int32, device=dev
    )
    cut = limit if budgets is None else budgets
    _tree_build_kernel[(b,)](
        logp, ids, root_tokens, limit, cut,
        tokens, parents, depths, valid.view(torch.uint8), mask.view(torch.uint8), path_scores,
        score_ws, index_ws,
        logp.stride(0), logp.stride(1), ids.stride(0), ids.stride(1),
        root_tokens.stride(0), limit.stride(0), cut.stride(0),
        B=B, K=K, D=D, SHADOW=bool(shadow_linear), HAS_CUT=budgets is not None, **cfg,
        num_warps=num_warps or default_warps, num_stages=1,
    )  # fmt: skip
    return TreeNodes(tokens, parents, depths, valid, mask, path_scores)
