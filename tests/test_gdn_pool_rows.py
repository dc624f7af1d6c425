"""The tree conv reading the state pool's committed rows and writing its node-state stash through the
slot index (no gather / scatter around the kernel), under Triton's CPU interpreter: the same outputs
and windows as the reference on gathered rows, only the requests' rows of the stash written, and the
dispatch's reference path (CPU) doing the same by gather and scatter."""

import pytest
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


def _one_node_case(k, dtype, seed):
    """Roots of 3 live requests (rows permuted) + 2 padded rows (valid False) on scratch row R - 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 1, C, generator=gen).to(dtype)
    x[3:] = float("nan")  # a padded root's input may hold anything
    pool = torch.randn(R, C, k - 1, generator=gen).to(dtype)
    w, bias = torch.randn(C, k, generator=gen).to(dtype), torch.randn(C, generator=gen).to(dtype)
    rows = torch.tensor([2, 0, 3, R - 1, R - 1])
    valid = torch.tensor([True, True, True, False, False])[:, None]
    parents = torch.full((5, 1), -1)
    to = lambda *ts: [t.to(DEV) for t in ts]  # noqa: E731
    return to(x, parents, pool, w, bias, valid, rows)


@pytest.mark.parametrize("k,dtype", [(4, torch.float32), (2, torch.float32), (3, torch.bfloat16)])
@pytest.mark.parametrize("kernel", [True, False])
def test_one_node_conv_in_place_on_the_committed_rows(monkeypatch, k, dtype, kernel):
    """One-node trees with in_place: each live row's window becomes the one after its root (the
    reference's node state), its output the reference's; the padded rows write only the scratch
    row (zeros shifted in, finite); other rows untouched. The kernel and the dispatch's reference
    path (gather, step, write back) alike."""
    x, parents, pool, w, bias, valid, rows = _one_node_case(k, dtype, seed=k)
    before = pool.clone()
    monkeypatch.setattr(tc, "use_triton", lambda t: kernel)
    y, st = tc.conv(x, parents, pool, w, bias, valid, state_rows=rows, in_place=True)
    live = rows[:3]
    ry, rs = reference.tree_causal_conv1d(x[:3], parents[:3], before[live], w, bias, None, True)
    assert st is None and rel(y[:3], ry) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert (y[3:] == 0).all()
    assert torch.equal(pool[live], rs[:, 0])  # the windows' inputs, copied exactly
    assert torch.equal(pool[1], before[1])  # a row no request owns
    assert torch.isfinite(pool[R - 1].float()).all()
    # the scratch row took the padded roots' (zero) inputs, once or twice (the two padded rows
    # race there: the kernel's programs shift it in turn, the reference's write-back lands once)
    assert (pool[R - 1][:, -1] == 0).all() and not torch.equal(pool[R - 1], before[R - 1])


def test_in_place_conv_refuses_what_it_cannot_do():
    x, parents, pool, w, bias, valid, rows = _case()[:7]
    with pytest.raises(ValueError, match="one-node"):  # seven nodes
        tc.conv(x, parents, pool, w, bias, valid, state_rows=rows, in_place=True)
    with pytest.raises(ValueError, match="one-node"):  # no pool rows
        tc.conv(x[:, :1], parents[:, :1], pool[rows], w, bias, valid[:, :1], in_place=True)
