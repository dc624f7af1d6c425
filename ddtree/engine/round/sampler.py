"""Target-token selection at every tree node: argmax at T=0, an exact sample from the filtered target
distribution at T>0.

A sample is keyed, not drawn from a stream: the token at absolute position p of a request with seed s
is argmax_v (filtered logit_v / T + G(s, p, v)), where G is standard Gumbel noise from a counter-based
hash of (s, p, v) (the Gumbel-max trick). Every tree node whose token would sit at p draws with the
same noise, so the accept walk emits AR's token at p whatever the tree, the budget, the batch or the
mode. It stays an exact sample of the target: the noise at p is independent of the noise at earlier
positions, which alone decided the prefix (the draft tree is a function of that prefix), and along
the accepted path each position's noise is used once. Siblings share their noise; the walk follows
at most one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.engine.scheduling.request import SamplingParams

_M32 = 0xFFFFFFFF


# odd and below 2**27: a bijection mod 2**32, and a 32-bit value times it stays exact in int64
_MUL = 0x45D9F3B


def _mix32(x):
    """A 32-bit integer hash (two multiply-xorshift rounds, Thomas Mueller's constant: full
    avalanche), a bijection of [0, 2**32), on Python ints or int64 tensors alike."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """`_mix32` in place on an int64 tensor: the [rows, vocab] noise allocates only its shifts."""
    x ^= x >> 16
    x.mul_(_MUL).bitwise_and_(_M32)
    x ^= x >> 16
    x.mul_(_MUL).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def _seed_keys(seed):
    """Two 32-bit keys from a 63-bit seed (host ints for one request, or a tensor of seeds)."""
    a = _mix32((seed & _M32) ^ _mix32(((seed >> 32) & _M32) ^ 0x9E3779B9))
    return a, _mix32(a ^ 0x7F4A7C15)


def gumbel_noise(seed: int | torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [..., vocab] fp32 of the tokens at `positions` ([...] int64, absolute
    positions in the sequence) of a request sampled with `seed` (an int, or an int64 tensor that
    broadcasts against `positions`): a pure function of (seed, position, token id), on any device.
    Each (position, token) goes through two rounds of `_mix32` keyed by the (seed, position) keys,
    so rows of different positions are unrelated and a row's entries distinct."""
    a, b = _seed_keys(seed)
    k1 = _mix32(_mix32((positions & _M32) ^ a) ^ b)
    k2 = _mix32(k1 ^ a)
    k1, k2 = k1[..., None], k2[..., None]
    v = torch.arange(vocab, device=positions.device, dtype=torch.int64)
    x = _mix32_(v ^ k1)
    x ^= k2
    _mix32_(x)
    # 23 bits -> u in [2**-24, 1 - 2**-24], exact in fp32 (24 bits would round the top to 1.0)
    u = (x >> 9).float().add_(0.5).mul_(2.0**-23)
    return u.log_().neg_().log_().neg_()


def filter_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Temperature-scaled fp32 logits with top-k / top-p filtered entries set to -inf. logits [..., V]."""
    x = logits.float() / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # keep the smallest prefix reaching top_p
        # the top token always stays: a top_p that rounds to 0 in fp32 would otherwise drop every entry
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


@dataclass(frozen=True)
class NodePositions:
    """Where the token drawn at each node of a round would sit: `first` (the root's draw, one past
    the pending token) + the node's depth. Nodes at one depth share their position and so their
    noise: a request's round hashes `bound` + 1 noise rows, not one per node."""

    first: torch.Tensor  # [b] int64
    depths: torch.Tensor  # [b, n] int64, in 0..bound
    bound: int  # static bound on the depths

    @classmethod
    def of_tree(cls, kv_lens: torch.Tensor, depths: torch.Tensor, bound: int) -> NodePositions:
        """A verified tree's nodes: the root (the pending token) sits at kv_len, a node at depth d
        at kv_len + d, and the token it draws one past that."""
        return cls(kv_lens + 1, depths.clamp(0, bound), bound)

    @classmethod
    def roots(cls, first: torch.Tensor) -> NodePositions:
        """One draw per request (a prefill's first token) at `first` [b]."""
        return cls(first, torch.zeros_like(first)[:, None], 0)

    def of(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i's (positions [bound + 1] of its depths, depths [n]): `sample_from`'s last two."""
        steps = torch.arange(self.bound + 1, device=self.first.device)
        return self.first[i] + steps, self.depths[i]


def sample_from(
    logits: torch.Tensor,
    params: SamplingParams,
    seed: int | torch.Tensor | None,
    positions: torch.Tensor,
    depths: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of logits [n, V] (masked entries -inf, e.g. by a grammar): the row's
    filtered logits plus the Gumbel noise of (seed, its position), argmax'd. Without `depths`, row
    i's position is positions[i]; with depths [n], it is positions[depths[i]] (rows that share a
    position share one hashed noise row)."""
    if params.greedy:
        return logits.argmax(-1)
    if seed is None:
        raise ValueError("a sampled request needs a seed (the engine draws one at admission)")
    x = filter_logits(logits, params.temperature, params.top_k, params.top_p)
    noise = gumbel_noise(seed, positions, x.shape[-1])
    if depths is not None:
        noise = noise.index_select(0, depths)
    return (x + noise).argmax(-1)


def sample_nodes(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int | None],
    positions: NodePositions,
    greedy: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [b, n, V] -> tokens [b, n]. Greedy rows share one batched argmax (`greedy`, when the
    caller has it already: a CUDA graph computed it)."""
    out = logits.argmax(-1) if greedy is None else greedy.clone()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_from(logits[i], p, seeds[i], *positions.of(i))
    return out
