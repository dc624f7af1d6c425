"""Tree gated delta rule: the Triton kernel vs the PyTorch reference (outputs and node states).

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before the kernel
module is imported). Skips when triton is not installed.
"""

import pytest
import torch
from triton_utils import DEV, load_kernel_module, rel

kernel_module = load_kernel_module("ddtree.kernels.gdn.triton_tree")
load_kernel_module("ddtree.kernels.gdn.tree_chunk_triton")  # no_buffer's path in TreeContext

from ddtree.kernels.gdn.reference import tree_gated_delta_rule  # noqa: E402

TOL = 1e-4


def random_parents(n, gen, first_branch_is_path=True):
    """Parent array in topological order; root 0. With first_branch_is_path False, node 1 and node 2 are
    both children of the root, and deeper nodes hang mostly off node 2 (the accepted chain is not the
    first branch)."""
    par = [-1]
    for c in range(1, n):
        if not first_branch_is_path and c <= 2:
            par.append(0)
        elif not first_branch_is_path:
            par.append(c - 1 if c > 3 else 2)
        else:
            par.append(int(torch.randint(0, c, (1,), generator=gen)))
    return par


def depths_of(par):
    d = []
    for p in par:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def make_batch(sizes, n, gen, first_branch_is_path=True):
    """Requests of `sizes` real nodes padded to n nodes (padding: parent -1, depth -1)."""
    parents = torch.full((len(sizes), n), -1, dtype=torch.int64)
    depths = torch.full((len(sizes), n), -1, dtype=torch.int64)
    for i, m in enumerate(sizes):
        par = random_parents(m, gen, first_branch_is_path)
        parents[i, :m] = torch.tensor(par)
        depths[i, :m] = torch.tensor(depths_of(par))
    return parents, depths


def inputs(b, n, hk, hv, d, gen, garbage_padding=None):
    q = torch.randn(b, n, hk, d, generator=gen)
    k = torch.randn(b, n, hk, d, generator=gen)
    v = torch.randn(b, n, hv, d, generator=gen)
    g = -torch.rand(b, n, hv, generator=gen) * 2
    beta = torch.rand(b, n, hv, generator=gen)
    s0 = torch.randn(b, hv, d, d, generator=gen) * 0.5
    if garbage_padding is not None:  # padding inputs may hold anything, NaN included
        pad = garbage_padding
        for t in (q, k, v):
            t[pad] = float("nan")
        g[pad] = float("inf")
        beta[pad] = float("nan")
    return q, k, v, g, beta, s0


def check(
    sizes, n, d, seed, hk=2, hv=4, first_branch_is_path=True, valid_arg=False, kernel_kw=None, **kw
):
    gen = torch.Generator().manual_seed(seed)
    parents, depths = make_batch(sizes, n, gen, first_branch_is_path)
    q, k, v, g, beta, s0 = inputs(len(sizes), n, hk, hv, d, gen, garbage_padding=depths < 0)
    valid = (depths >= 0) if valid_arg else None
    to = [t.to(DEV) for t in (q, k, v, g, beta, parents, depths, s0)]
    o, st = kernel_module.tree_gated_delta_rule_triton(
        *to, return_node_states=True, valid=valid, **kw, **(kernel_kw or {})
    )
    ro, rst = tree_gated_delta_rule(*to, return_node_states=True, valid=valid, **kw)
    assert torch.isfinite(o).all() and torch.isfinite(st).all()
    pad = (depths < 0).to(DEV)
    assert (o[pad] == 0).all()
    eo, es = rel(o, ro), rel(st, rst)
    print(f"sizes={sizes} n={n} d={d}: rel err out {eo:.2e} states {es:.2e}")
    assert eo < TOL and es < TOL
    return eo, es


@pytest.mark.parametrize("d", [16, 32])
def test_random_trees(d):
    check([7, 20], 20, d, seed=d)
    check([1, 13], 16, d, seed=d + 1)  # a single-node tree, padding in both requests


def test_accepted_path_not_first_branch():
    check([12, 9], 12, 16, seed=3, first_branch_is_path=False)


def test_explicit_valid_and_mha():
    check([5, 3], 6, 16, seed=4, hk=4, hv=4, valid_arg=True)


def test_no_l2norm_custom_scale_and_tile():
    check([10, 6], 10, 32, seed=5, use_qk_l2norm=False, scale=0.3, kernel_kw={"block_v": 8})


def test_bf16_inputs():
    gen = torch.Generator().manual_seed(6)
    parents, depths = make_batch([8, 5], 8, gen)
    q, k, v, g, beta, s0 = inputs(2, 8, 2, 4, 16, gen)
    args = [
        t.to(DEV)
        for t in (q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), parents, depths, s0)
    ]
    o, st = kernel_module.tree_gated_delta_rule_triton(*args, return_node_states=True)
    ro, rst = tree_gated_delta_rule(*args, return_node_states=True)
    assert o.dtype == torch.bfloat16
    assert rel(o, ro) < 1e-2 and rel(st, rst) < 1e-4


def test_no_node_states_and_force_reference(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    parents, depths = make_batch([4, 4], 4, gen)
    args = [
        t.to(DEV)
        for t in (*inputs(2, 4, 2, 4, 16, gen)[:5], parents, depths, inputs(2, 4, 2, 4, 16, gen)[5])
    ]
    o, st = kernel_module.tree_gated_delta_rule_triton(*args)
    assert st is None
    monkeypatch.setenv("DDTREE_REFERENCE", "gdn")
    called = []
    real = kernel_module.tree_gated_delta_rule_rows
    monkeypatch.setattr(
        kernel_module,
        "tree_gated_delta_rule_rows",
        lambda *a, **k: called.append(1) or real(*a, **k),
    )
    o2, _ = kernel_module.tree_gated_delta_rule_triton(*args)
    assert called and rel(o, o2) < TOL


def test_strided_views_and_int32_indices():
    """q/k/v as column slices of one fused projection (non-contiguous), int32 parents/depths."""
    gen = torch.Generator().manual_seed(8)
    parents, depths = make_batch([9, 4], 9, gen)
    b, n, hk, hv, d = 2, 9, 2, 4, 16
    fused = torch.randn(b, n, (2 * hk + hv) * d, generator=gen)
    q = fused[..., : hk * d].view(b, n, hk, d)
    k = fused[..., hk * d : 2 * hk * d].view(b, n, hk, d)
    v = fused[..., 2 * hk * d :].view(b, n, hv, d)
    _, _, _, g, beta, s0 = inputs(b, n, hk, hv, d, gen)
    args = [t.to(DEV) for t in (q, k, v, g, beta, parents.int(), depths.int(), s0)]
    assert not args[0].is_contiguous()
    o, st = kernel_module.tree_gated_delta_rule_triton(*args, return_node_states=True)
    ro, rst = tree_gated_delta_rule(*args, return_node_states=True)
    assert rel(o, ro) < TOL and rel(st, rst) < TOL


def test_pool_rows():
    """initial_rows / state_rows: request i reads pool row rows[i] and writes its nodes into row rows[i] of a
    wider node-state pool; other rows and slots past n stay untouched."""
    gen = torch.Generator().manual_seed(9)
    parents, depths = make_batch([6, 4], 6, gen)
    q, k, v, g, beta, s0 = inputs(2, 6, 2, 4, 16, gen, garbage_padding=depths < 0)
    pool = torch.randn(5, 4, 16, 16, generator=gen)
    rows = torch.tensor([4, 1])
    pool[rows] = s0
    buf = torch.full((5, 8, 4, 16, 16), 3.0)
    args = [t.to(DEV) for t in (q, k, v, g, beta, parents, depths)]
    buf_d = buf.to(DEV)
    o, st = kernel_module.tree_gated_delta_rule_triton(
        *args,
        pool.to(DEV),
        return_node_states=True,
        node_states=buf_d,
        initial_rows=rows.to(DEV),
        state_rows=rows.to(DEV),
    )
    ro, rst = tree_gated_delta_rule(*args, s0.to(DEV), return_node_states=True)
    assert st is buf_d
    assert rel(o, ro) < TOL and rel(buf_d[rows.to(DEV), :6], rst) < TOL
    others = torch.tensor([0, 2, 3])
    assert (buf_d[others.to(DEV)] == 3).all() and (buf_d[rows.to(DEV), 6:] == 3).all()


def test_bf16_node_state_buffer():
    """A bf16 node-state buffer: states are stored rounded (children re-read them), outputs stay close."""
    gen = torch.Generator().manual_seed(10)
    parents, depths = make_batch([7, 7], 7, gen)
    args = [
        t.to(DEV)
        for t in (*inputs(2, 7, 2, 4, 16, gen)[:5], parents, depths, inputs(2, 7, 2, 4, 16, gen)[5])
    ]
    buf = torch.zeros(2, 7, 4, 16, 16, dtype=torch.bfloat16, device=DEV)
    o, st = kernel_module.tree_gated_delta_rule_triton(
        *args, return_node_states=True, node_states=buf
    )
    ro, rst = tree_gated_delta_rule(*args, return_node_states=True)
    assert st.dtype == torch.bfloat16 and rel(st, rst) < 2e-2 and rel(o, ro) < 2e-2


@pytest.mark.parametrize(
    "strategy,ssm_dtype",
    [("extra_buffer", "float32"), ("extra_buffer", "bfloat16"), ("no_buffer", "float32")],
)
def test_tree_context_on_the_kernel(monkeypatch, strategy, ssm_dtype):
    """TreeContext.rule through the Triton kernel (forced on, interpreter on CPU) == through the reference,
    stash included: the pool-row plumbing of the engine's verify."""
    from test_gdn_reference import Given

    from ddtree.engine.memory.state_pool import GDNGeometry, HybridStatePool
    from ddtree.kernels.gdn import backend, dispatch
    from ddtree.speculative.tree import DraftTree

    geo = GDNGeometry(2, 2, 16, 4, 16, 4)
    gen = torch.Generator().manual_seed(11)
    parents, _ = make_batch([6, 3], 6, gen)
    tree = DraftTree.from_parents(torch.zeros(2, 6, dtype=torch.long, device=DEV), parents.to(DEV))
    q, k, v, g, beta, _ = inputs(2, 6, 2, 4, 16, gen)
    results = []
    for kernel in (True, False):
        monkeypatch.setattr(dispatch, "use_triton", lambda t, on=kernel: on)
        pool = HybridStatePool(geo, 4, 8, DEV, strategy, ssm_dtype, torch.float32)
        pool.ssm.copy_(torch.randn(pool.ssm.shape, generator=torch.Generator().manual_seed(12)))
        ctx = pool.tree_context([3, 0], tree)
        backend.ran.clear()
        q2, k2, v2, g2, beta2 = (t.to(DEV).flatten(0, 1) for t in (q, k, v, g, beta))
        o = ctx.rule(1, q2, k2, v2, Given(g2, beta2))
        path = "chunk" if strategy == "no_buffer" else "triton"  # one path per strategy
        assert backend.ran == {("tree", path if kernel else "reference"): 1}
        results.append((o, {n: t.clone() for n, t in pool.stash.items()}))
    (o, stash), (ro, rstash) = results
    assert rel(o, ro) < TOL
    valid, rows = tree.valid.cpu(), torch.tensor([3, 0])
    for name in stash:
        got, want = stash[name].cpu(), rstash[name].cpu()
        if name in ("node_g", "node_beta"):  # padding nodes' gates: never read by a commit
            got, want = got[1][rows, :6][valid], want[1][rows, :6][valid]
        assert rel(got, want) < TOL, name


def test_walk_with_padding_one_node_tree_and_chains():
    """The walk issues node i + 1's loads before node i's math: with padding, a one-node tree and
    chains (a parent just before its child stays in registers) it is still the reference."""
    check([8, 1], 8, 16, seed=8, first_branch_is_path=False)
