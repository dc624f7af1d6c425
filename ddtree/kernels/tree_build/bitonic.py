"""Bitonic top-k / sort of one program's register vector, and the int64 total-order key of
(fp32 score, index) the tree build sorts.

The network is `triton.language.standard.sort_impl` (Triton 3.7) with its helpers decorated here:
Triton's interpreter cannot call tl.sort / tl.topk when triton was imported before
TRITON_INTERPRET was set (they were decorated as compiled functions), and a copy also pins the
network against library changes. Its reductions use the standard combine functions, which the
interpreter runs in numpy (any other combine runs element by element in Python).

Keys are distinct (the index is part of the key), so any correct sorting network returns one
order: descending score, ties to the lower index (-inf included) = a stable descending sort.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ddtree import envs

# TRITON_INTERPRET is read when a kernel is decorated; the dispatch reloads this module (and the
# kernel module) when it needs the other mode
_decorated_interpreted = envs.TRITON_INTERPRET.on()


@triton.jit
def _indicator(n_dims: tl.constexpr, j: tl.constexpr):
    ar = tl.arange(0, 2)
    return tl.reshape(ar, [1] * (n_dims - j - 1) + [2] + [1] * j)


@triton.jit
def _compare_and_swap(x, flip, i: tl.constexpr, n_dims: tl.constexpr):
    """Compare-and-swap along the i-th innermost axis of the [2] * n_dims hypercube x (integers)."""
    # the partner: (a + b) - a, exact in wrapping integer arithmetic (Triton's xor_sum form costs
    # the same on the GPU, but the interpreter reduces only the standard combines in numpy)
    y = tl.reduce(x, n_dims - 1 - i, tl.standard._sum_combine, keep_dims=True) - x
    is_right = _indicator(n_dims, i)
    return tl.where((x > y) != (flip ^ is_right), y, x)


@triton.jit
def _merge(x, stage: tl.constexpr, order: tl.constexpr, n_dims: tl.constexpr):
    """`stage` rounds of compare-and-swap; order 0 ascending, 1 descending, 2 alternating."""
    if order == 2:
        flip = _indicator(n_dims, stage)
    else:
        flip = order
    for i in tl.static_range(stage):
        x = _compare_and_swap(x, flip, stage - 1 - i, n_dims)
    return x


@triton.jit
def bitonic_topk(x, LOG_N: tl.constexpr, LOG_K: tl.constexpr, DESCENDING: tl.constexpr):
    """x [2**LOG_N] integers -> its 2**LOG_K largest (DESCENDING=1, largest first) or smallest
    (0, ascending); LOG_K = LOG_N sorts. Sort the 2**LOG_K-blocks, then halve by the elementwise
    max (min) of block pairs and re-merge (https://www.doc.ic.ac.uk/~hlgr/pdfs/MassivelyParallelTopK.pdf).
    """
    h = tl.reshape(x, [2] * LOG_N)
    for i in tl.static_range(1, LOG_K + 1):
        h = _merge(h, i, 2 if i < LOG_N else DESCENDING, LOG_N)
    for i in tl.static_range(LOG_K + 1, LOG_N + 1):
        # h has LOG_N - (i - LOG_K - 1) axes: halve along the one above the 2**LOG_K blocks
        if DESCENDING:
            h = tl.reduce(h, LOG_N - i, tl.standard._elementwise_max)
        else:
            h = tl.reduce(h, LOG_N - i, tl.standard._elementwise_min)
        h = _merge(h, LOG_K, 2 if i < LOG_N else DESCENDING, LOG_N - (i - LOG_K))
    return tl.reshape(h, [2**LOG_K])


@triton.jit
def score_key(score, index, valid):
    """int64 key whose descending order is descending fp32 score, then ascending index (< 2**31):
    the score's bits made order-preserving as a signed int32 (negative floats: magnitude bits
    flipped; -0.0 sorts below +0.0, as in CUDA's radix sort: scores never hold -0.0), then
    2**31 - 1 - index. Invalid entries get the smallest key (int64 min)."""
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    ordered = tl.where(valid, ordered, -2147483648)
    low = tl.where(valid, 0x7FFFFFFF - index.to(tl.int32), 0)
    return (ordered.to(tl.int64) << 32) | low.to(tl.int64)


@triton.jit
def key_index(key):
    """The index a valid `score_key` carries (int32)."""
    return 0x7FFFFFFF - key.to(tl.int32)  # the low 32 bits (truncation)


@triton.jit
def key_score(key):
    """The fp32 score a valid `score_key` carries, bit for bit."""
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)
