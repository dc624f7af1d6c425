"""DFlash2's selector kernels over the round's transition table (`markov_tree.transitions`):
- `selector_chain`: the greedy chain's walk (reference `markov_tree.greedy_chain`): one program per
  request walks the D positions from the root's row, the row's best child being the next token and
  the next row (the PyTorch walk: three small launches per position).
- `markov_beams`: the path-conditioned tree's per-depth beams (reference: the loop of
  `markov_tree.select_markov_nodes`): per depth every beam slot's k best children (its table row,
  gathered through a per-request workspace), their B best by `tree_build.bitonic`'s (score, index)
  key with the chain's pair (slot 0, rank 0) forced first; the same fp32 adds and the same order as
  the reference, so the same bits (the PyTorch loop: ~8 launches per depth).
Launch shapes depend only on tensor shapes (CUDA-graph capturable; the first call compiles)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree import envs
from ddtree.kernels.tree_build.bitonic import bitonic_topk, key_index, key_score, score_key

# TRITON_INTERPRET is read when a kernel is decorated; the dispatch reloads this module when it
# needs the other mode
_decorated_interpreted = envs.TRITON_INTERPRET.on()


@triton.jit
def _selector_chain_kernel(logq_ptr, child_ptr, cand_ptr, tok_ptr, out_ptr, D, K):
    b = tl.program_id(0)
    row = tl.zeros([], dtype=tl.int64)
    for d in range(D):
        at = (b * D + d) * K
        tl.store(out_ptr + b * D + d, tl.load(logq_ptr + at + row))
        row = tl.load(child_ptr + at + row)
        tl.store(tok_ptr + b * D + d, tl.load(cand_ptr + at + row))


def selector_chain(
    best_logq: torch.Tensor, best_child: torch.Tensor, cand: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [b, D] int64, log q [b, D] fp32) of the greedy chain from the transition table's
    best child per row: best_logq [b, D, K] fp32, best_child / cand [b, D, K] int64."""
    b, D, K = cand.shape
    tok = torch.empty(b, D, dtype=torch.int64, device=cand.device)
    logq = torch.empty(b, D, dtype=torch.float32, device=cand.device)
    if b:
        _selector_chain_kernel[(b,)](
            best_logq.contiguous(), best_child.contiguous(), cand.contiguous(), tok, logq, D, K
        )
    return tok, logq


@triton.jit
def _markov_beams_kernel(
    logq_ptr, child_ptr, cand_ptr, score_ptr, pslot_ptr, tok_ptr, row_ws, D, K,
    B: tl.constexpr, KC: tl.constexpr, BP: tl.constexpr, KP: tl.constexpr,
    LOG_N: tl.constexpr, LOG_BP: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BP)[:, None]
    r = tl.arange(0, KP)[None, :]
    pair_ok = (s < B) & (r < KC)
    flat = tl.reshape(s * KC + r, [BP * KP])  # the reference's (slot, rank) pair index
    flat_ok = tl.reshape(pair_ok, [BP * KP])
    forced = (tl.full([], 0x7FFFFFFF, tl.int64) << 32) | 0x7FFFFFFF  # max key, index 0
    p = tl.arange(0, BP)
    pv = p < B
    beam = tl.where(p == 0, 0.0, float("-inf"))  # the root, the only "depth-0 prefix"
    ws = row_ws + i * BP
    tl.store(ws + p, tl.zeros([BP], dtype=tl.int64))  # each slot's table row (candidate index)
    tl.debug_barrier()
    for d in range(D):
        at = (i * D + d) * K
        rows = tl.load(ws + s, mask=s < B, other=0)
        lq = tl.load(logq_ptr + (at + rows) * K + r, mask=pair_ok, other=float("-inf"))
        sc = beam[:, None] + lq
        chain = tl.sum(tl.sum(tl.where((s == 0) & (r == 0), sc, 0.0), 1), 0)
        key = score_key(tl.reshape(sc, [BP * KP]), flat, flat_ok)
        key = tl.where(flat == 0, forced, key)
        top = bitonic_topk(key, LOG_N, LOG_BP, 1)  # the B best pairs, best first
        pick = key_index(top)
        beam = tl.where(p == 0, chain, key_score(top))
        pslot = pick // KC
        prow = tl.load(ws + pslot, mask=pv, other=0)
        child = tl.load(child_ptr + (at + prow) * K + pick % KC, mask=pv, other=0)
        tl.debug_barrier()  # every parent row read before the slots are overwritten
        tl.store(ws + p, child, mask=pv)
        tl.debug_barrier()
        out = (i * D + d) * B + p
        tl.store(score_ptr + out, beam, mask=pv)
        tl.store(pslot_ptr + out, pslot.to(tl.int64), mask=pv)
        tl.store(tok_ptr + out, tl.load(cand_ptr + at + child, mask=pv, other=0), mask=pv)


def markov_beams(
    logq: torch.Tensor, child: torch.Tensor, cand: torch.Tensor, budget: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores fp32, parent slots, tokens), each [b, D, B]: the D beams from the transition table
    (logq / child [b, D, K, K], cand [b, D, K]); children per node k <= K."""
    b, D, K = cand.shape
    B, dev = budget, cand.device
    BP, KP = triton.next_power_of_2(B), triton.next_power_of_2(k)
    scores = torch.empty(b, D, B, dtype=torch.float32, device=dev)
    pslots, toks = (torch.empty(b, D, B, dtype=torch.int64, device=dev) for _ in range(2))
    ws = torch.empty(b, BP, dtype=torch.int64, device=dev)
    if b:
        _markov_beams_kernel[(b,)](
            logq.contiguous(), child.contiguous(), cand.contiguous(), scores, pslots, toks, ws,
            D, K, B=B, KC=k, BP=BP, KP=KP, LOG_N=(BP * KP).bit_length() - 1,
            LOG_BP=BP.bit_length() - 1, num_warps=4, num_stages=1,
        )  # fmt: skip
    return scores, pslots, toks
