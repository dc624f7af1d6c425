"""Tensor-parallel layers on torch.distributed (NCCL on GPUs, gloo on the CPU).

Column-parallel projections need no class: a rank's fused q|k|v, gate|up and GDN in_proj are plain
`nn.Linear`s of its local rows (`tp_layout.shard_target` sizes them, the loader reads their slices).
What differs are the three places where a rank's partial result must be combined:

- `RowParallelLinear` (o_proj, down_proj, GDN out_proj): partial sums over the local input columns,
  then one all-reduce; a bias is added once, after it.
- `VocabParallelEmbedding`: rows of the local vocab shard, zeros elsewhere, then an all-reduce (one
  rank contributes each row and the others add exact zeros, so the sum is exact in any dtype).
- `ParallelLMHead`: local logits, then an all-gather to full-vocab logits [..., V] on every rank.
  All-gather rather than a distributed argmax / sampler: the sampler (top-k, top-p), log-probs
  (log-softmax, top_logprobs), the drafter's per-depth top-k in the tree build and the accept walk all
  read full-vocab rows, and all of them then run unchanged. The price is the gather: b * n * V
  elements per verify, a few percent of the verify itself (docs/design-numbers.md). A greedy-only
  round could gather (max, argmax) pairs instead; that is the first thing to try if the gather
  shows in a profile.

Every all-reduce / all-gather leaves bit-identical results on every rank (ring and tree collectives
reduce each element once and broadcast it), so the hidden states, logits, trees, accept walks and
samples that follow are the same everywhere without any further broadcast.

With `tp` None or of size 1 every class is exactly its `torch.nn` base (same parameters, same
forward): the single-GPU engine runs through these classes with no collective and no extra op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddtree.models.tp_layout import vocab_rows

# torch 2.13 renamed all_gather_into_tensor (the H200's torch 2.11 has only the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group: `group` carries the model's collectives
    (NCCL on GPUs, gloo on the CPU)."""

    rank: int
    size: int
    group: object = None  # torch.distributed ProcessGroup


def _active(tp: TPGroup | None) -> bool:
    return tp is not None and tp.size > 1


def all_reduce(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    if _active(tp):
        dist.all_reduce(x, group=tp.group)
    return x


class RowParallelLinear(nn.Linear):
    """`nn.Linear(in_local, out)` over this rank's input columns; the output is summed over ranks."""

    def __init__(self, in_local: int, out: int, bias: bool = False, tp: TPGroup | None = None):
        super().__init__(in_local, out, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _active(self.tp):
            return super().forward(x)
        y = all_reduce(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [rank * R, (rank + 1) * R) of the (padded) vocab, R = ceil(V / tp)."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup | None = None):
        rows = vocab if not _active(tp) else vocab_rows(vocab, tp.size)
        super().__init__(rows, hidden)
        self.tp, self.start = tp, 0 if not _active(tp) else tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not _active(self.tp):
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill(outside[..., None], 0), self.tp)


class ParallelLMHead(nn.Linear):
    """Logits of this rank's vocab rows, all-gathered to [..., V] on every rank."""

    def __init__(self, hidden: int, vocab: int, tp: TPGroup | None = None):
        rows = vocab if not _active(tp) else vocab_rows(vocab, tp.size)
        super().__init__(hidden, rows, bias=False)
        self.tp, self.vocab_size = tp, vocab

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a [T, V] buffer for 2-D x (a graph's static logits): the GEMM writes it in place of
        a [T, V] result and its copy (32 MB a 65-row round at a 248k vocab); the same matmul."""
        if not _active(self.tp):
            if out is None:
                return super().forward(x)
            if torch.is_grad_enabled() and self.weight.requires_grad:  # out= has no autograd
                return out.copy_(super().forward(x))
            return torch.matmul(x, self.weight.t(), out=out)
        local = F.linear(x, self.weight)
        flat = local.reshape(-1, local.shape[-1]).contiguous()
        gathered = flat.new_empty(self.tp.size * flat.shape[0], flat.shape[1])
        _all_gather(gathered, flat, group=self.tp.group)
        full = gathered.view(self.tp.size, *flat.shape).transpose(0, 1).reshape(flat.shape[0], -1)
        logits = full[:, : self.vocab_size].reshape(*local.shape[:-1], self.vocab_size)
        return logits if out is None else out.copy_(logits)
