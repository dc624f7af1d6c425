"""The tree conv reading the state pool's committed rows and writing its node-state stash through the
slot index (no gather / scatter around the kernel), under Triton's CPU interpreter: the same outputs
and windows as the reference on gathered rows, only the requests' rows of the stash written, and the
dispatch's reference path (CPU) doing the same by gather and scatter."""

import torch
from test_gdn_triton_tree import make_batch
from triton_utils import DEV, load_kernel_module, rel

tc = load_kernel_module("ddtree.kernels.gdn.tree_conv")

from ddtree.kernels.gdn import reference  # noqa: E402

R, W, C, K = 5, 9, 40, 4


def _case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    parents, depths = make_batch([7, 4], 7, gen)
    x = torch.randn(2, 7, C, generator=gen)
    pool = torch.randn(R, C, K - 1, generator=gen)
    w, bias = torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    rows = torch.tensor([3, 1])
    stash = torch.full((R, W, C, K - 1), 7.0)  # sentinel: rows / nodes nobody may write
    to = lambda *ts: [t.to(DEV) for t in ts]  # noqa: E731
    return to(x, parents, pool, w, bias, depths >= 0, rows, stash)


def _check(y, stash, x, parents, pool, w, bias, valid, rows):
    ry, rs = reference.tree_causal_conv1d(x, parents, pool[rows], w, bias, valid, True)
    assert rel(y, ry) < 1e-6
    for i, r in enumerate(rows.tolist()):
        assert torch.equal(stash[r, :7][valid[i]], rs[i][valid[i]])
    others = [r for r in range(R) if r not in rows.tolist()]
    assert (stash[others] == 7).all() and (stash[:, 7:] == 7).all()


def test_kernel_reads_and_writes_pool_rows():
    x, parents, pool, w, bias, valid, rows, stash = _case()
    y, st = tc.tree_causal_conv1d_triton(
        x, parents, pool, w, bias, valid, True, state_rows=rows, node_states=stash
    )
    assert st is stash
    _check(y, stash, x, parents, pool, w, bias, valid, rows)


def test_dispatch_reference_path_gathers_and_scatters():
    x, parents, pool, w, bias, valid, rows, stash = _case(1)
    y, st = tc.conv(x, parents, pool, w, bias, valid, True, state_rows=rows, node_states=stash)
    assert st is stash
    _check(y, stash, x, parents, pool, w, bias, valid, rows)
    # one-node trees (AR rounds) take the root conv, same contract
    x1, p1, v1 = x[:, :1], parents[:, :1], valid[:, :1]
    stash.fill_(7.0)
    y1, _ = tc.conv(x1, p1, pool, w, bias, v1, True, state_rows=rows, node_states=stash)
    ry, rs = reference.tree_causal_conv1d(x1, p1, pool[rows], w, bias, v1, True)
    assert rel(y1, ry) < 1e-6 and torch.equal(stash[rows, :1], rs)
