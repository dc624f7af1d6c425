"""The tree conv kernel (ddtree/kernels/gdn/tree_conv.py) vs `reference.tree_causal_conv1d` under
Triton's CPU interpreter: chains, random trees, one-node trees, padding nodes, bias / no bias,
conv state rounding (bf16), node states; and the dispatch (`conv`) keeps the reference on the CPU."""

import pytest
import torch
from test_gdn_triton_tree import make_batch
from triton_utils import DEV, load_kernel_module, rel

tc = load_kernel_module("ddtree.kernels.gdn.tree_conv")

from ddtree.kernels.gdn import reference  # noqa: E402
from ddtree.kernels.gdn.backend import ran  # noqa: E402


def _inputs(sizes, n, C, dtype, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    parents, depths = make_batch(sizes, n, gen)
    b = len(sizes)
    x = torch.randn(b, n, C, generator=gen).to(dtype)
    x[depths < 0] = float("nan")  # padding inputs may hold anything
    st = torch.randn(b, C, 3, generator=gen).to(dtype)
    w = torch.randn(C, 4, generator=gen).to(dtype)
    bb = torch.randn(C, generator=gen).to(dtype) if bias else None
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return to(x), to(parents), to(st), to(w), to(bb), to(depths >= 0)


@pytest.mark.parametrize(
    "sizes,n,C,dtype,bias",
    [
        ([7, 3], 7, 40, torch.float32, True),
        ([1, 1, 1], 1, 24, torch.float32, False),
        ([12], 12, 600, torch.bfloat16, True),  # two C blocks
    ],
)
def test_kernel_matches_reference(sizes, n, C, dtype, bias):
    x, parents, st, w, bb, valid = _inputs(sizes, n, C, dtype, seed=n + C, bias=bias)
    y, s = tc.tree_causal_conv1d_triton(x, parents, st, w, bb, valid, return_node_states=True)
    ry, rs = reference.tree_causal_conv1d(x, parents, st, w, bb, valid, return_node_states=True)
    assert torch.isfinite(y).all() and (y[~valid] == 0).all()
    assert rel(y, ry) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(s[valid], rs[valid])  # the windows' inputs, copied exactly


def test_dispatch_keeps_the_reference_on_the_cpu():
    if DEV != "cpu":
        pytest.skip("CPU dispatch")
    x, parents, st, w, bb, valid = _inputs([5, 2], 5, 16, torch.float32, seed=1)
    ran.clear()
    y, s = tc.conv(x, parents, st, w, bb, valid, True)
    ry, rs = reference.tree_causal_conv1d(x, parents, st, w, bb, valid, True)
    assert torch.equal(y, ry) and torch.equal(s, rs) and ran[("tree_conv", "reference")]


def test_stash_rows_kernel_and_reference_agree(monkeypatch):
    """no_buffer's replay inputs (node input, node output) land in the pool's stash rows, the same
    from the kernel and from the reference, and nowhere else."""
    x, parents, st, w, bb, valid = _inputs([6, 3], 6, 24, torch.float32, seed=4)
    rows = torch.tensor([2, 0], device=DEV)
    pool = torch.zeros(3, *st.shape[1:], device=DEV)
    pool[rows] = st
    stashes = []
    for kernel in (True, False):
        monkeypatch.setattr(tc, "use_triton", lambda t, k=kernel: k)
        xs, ys = (torch.full((3, 8, 24), 7.0, device=DEV) for _ in range(2))
        y, _ = tc.conv(x, parents, pool, w, bb, valid, state_rows=rows, stash=(xs, ys))
        assert torch.equal(ys[rows, :6], y) and (xs[1] == 7).all() and (xs[:, 6:] == 7).all()
        assert torch.equal(xs[rows, :6][valid], x[valid]) and (xs[rows, :6][~valid] == 0).all()
        stashes.append((xs, ys))
    assert rel(stashes[0][1], stashes[1][1]) < 1e-6 and torch.equal(stashes[0][0], stashes[1][0])
