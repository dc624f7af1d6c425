"""The chunk-form tree rule (ddtree/kernels/gdn/tree_chunk.py) against the per-node tree reference: outputs
and the post-state of a chosen node (the commit without per-node states) on chains, bushy and random trees
(depth up to 15, up to 65 nodes, requests with different trees and padding); the dispatch off our kernels;
and the hybrid engine's no_buffer strategy staying lossless with the chunk form in the loop on the CPU."""

import pytest
import torch
from test_gdn_reference import chain, pad_trees, rel, rule_inputs

from ddtree import envs
from ddtree.engine.memory import state_contexts
from ddtree.kernels.gdn import backend, dispatch
from ddtree.kernels.gdn.reference import replay_path, tree_gated_delta_rule
from ddtree.kernels.gdn.tree_chunk import tree_ancestor_mask, tree_chunk_gated_delta_rule

TOL = 1e-5


def topo_tree(n, kind, gen, max_depth=None):
    """Parents/depths in topological flat order (parent < child): chain, bushy (parent among the last few
    nodes) or random, optionally with a depth cap."""
    parents, depths = [-1], [0]
    for c in range(1, n):
        if kind == "chain":
            p = c - 1
        elif kind == "bushy":
            p = max(0, c - 1 - int(torch.randint(0, 9, (1,), generator=gen)))
        else:
            p = int(torch.randint(0, c, (1,), generator=gen))
        if max_depth is not None:
            while depths[p] >= max_depth:
                p = parents[p]
        parents.append(p)
        depths.append(depths[p] + 1)
    return parents, depths


def case(trees, Hk=2, Hv=4, dk=16, dv=8, seed=0):
    n = max(len(p) for p, _ in trees)
    parents, depths = pad_trees(trees, n)
    q, k, v, g, beta, S0 = rule_inputs(len(trees), n, Hk, Hv, dk, dv, seed=seed)
    for t in (q, k, v, g, beta):  # padding carries garbage
        t[depths < 0] = float("nan")
    return (q, k, v, g, beta), parents, depths, S0


def check(trees, lasts, seed=0, **kw):
    ins, parents, depths, S0 = case(trees, seed=seed, **kw)
    o, states = tree_gated_delta_rule(*ins, parents, depths, S0, return_node_states=True)
    last = torch.tensor(lasts)
    for max_depth in (None, int(depths.max())):
        oc, Sc = tree_chunk_gated_delta_rule(
            *ins, parents, depths, S0, max_depth=max_depth, last=last
        )
        assert torch.isfinite(oc).all() and (oc[depths < 0] == 0).all()
        assert rel(oc, o) < TOL, rel(oc, o)
        assert rel(Sc, states[torch.arange(len(trees)), last]) < TOL
    return ins, parents, depths, S0, states


@pytest.mark.parametrize("kind", ["chain", "bushy", "random"])
@pytest.mark.parametrize("n", [1, 2, 9, 17, 65])
def test_matches_reference(kind, n):
    gen = torch.Generator().manual_seed(n)
    trees = [
        topo_tree(n, kind, gen, max_depth=15),
        topo_tree(max(1, n // 3), kind, gen),
        topo_tree(max(1, n - 1), "random", gen, max_depth=3),
    ]
    lasts = [int(torch.randint(len(p), (1,), generator=gen)) for p, _ in trees]
    check(trees, lasts, seed=n)


def test_gqa_and_deep_chain_and_off_first_branch():
    # request 0: two branches from the root; the accepted path 0 -> 2 -> 3 -> 4 leaves the first branch
    # (node 1, then node 5 under 1 sits after the accepted path in flat order); request 1: a 16-node chain
    bushy = ([-1, 0, 0, 2, 3, 1], [0, 1, 1, 2, 3, 2])
    deep = (list(range(-1, 15)), list(range(16)))
    for Hk, Hv in ((2, 2), (2, 6)):
        check([bushy, deep], [4, 15], Hk=Hk, Hv=Hv, seed=Hv)
        check([bushy, deep], [5, 0], Hk=Hk, Hv=Hv, seed=Hv + 1)


def test_path_state_equals_replay_and_pool_rows():
    gen = torch.Generator().manual_seed(7)
    trees = [topo_tree(30, "random", gen, max_depth=6) for _ in range(2)]
    lasts = [29, 17]
    ins, parents, depths, S0, _ = check(trees, lasts, seed=7)
    paths = [chain(trees[r][0], lasts[r]) for r in range(2)]
    P = max(len(p) for p in paths)
    path = torch.tensor([p + [-1] * (P - len(p)) for p in paths])
    _, Sc = tree_chunk_gated_delta_rule(*ins, parents, depths, S0, last=torch.tensor(lasts))
    assert rel(Sc, replay_path(*ins, path, S0)) < TOL
    pool = torch.randn(5, *S0.shape[1:])
    rows = torch.tensor([4, 1])
    pool[rows] = S0
    oc, Sp = tree_chunk_gated_delta_rule(
        *ins, parents, depths, pool, initial_rows=rows, last=torch.tensor(lasts)
    )
    o0, S00 = tree_chunk_gated_delta_rule(*ins, parents, depths, S0, last=torch.tensor(lasts))
    assert torch.equal(oc, o0) and torch.equal(Sp, S00)


def test_ancestor_mask():
    parents = torch.tensor([[-1, 0, 0, 2, 3, 1, -1]])
    depths = torch.tensor([[0, 1, 1, 2, 3, 2, -1]])
    M = tree_ancestor_mask(parents, depths >= 0)[0]
    want = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 2, 3], 4: [0, 2, 3, 4], 5: [0, 1, 5], 6: []}
    for i, anc in want.items():
        assert M[i].nonzero().flatten().tolist() == anc


def test_dispatch_off_the_kernels_is_the_reference(monkeypatch):
    """Where our Triton kernels do not run (this CPU, not interpreting) every tree verify takes the
    reference, node states or not; the chunk form is only the kernel's reference (tests)."""
    ins, parents, depths, S0 = case([([-1, 0, 0, 1], [0, 1, 1, 2]), ([-1, 0], [0, 1])], seed=3)
    ref, _ = tree_gated_delta_rule(*ins, parents, depths, S0)
    monkeypatch.delenv(envs.REFERENCE.name, raising=False)
    monkeypatch.delenv("DDTREE_FUSED_KERNELS_INTERPRET", raising=False)
    for states in (False, True):
        backend.ran.clear()
        o, st = dispatch.tree_rule(*ins, parents, depths, S0, return_node_states=states)
        assert (st is not None) == states and rel(o, ref) < TOL
        assert backend.ran == {("tree", "reference"): 1}
    assert backend.describe("cpu")["tree_no_states"] == "reference"


@pytest.fixture
def chunk_forced(monkeypatch):
    """The no_buffer verify through the PyTorch chunk form (the kernel's reference) in the engine:
    its algebra, lossless end to end on the CPU at any budget (the kernel's block stops at 65)."""
    from ddtree.kernels.gdn.tree_chunk import tree_chunk_gated_delta_rule

    calls = []

    def chunk_rule(q, k, v, g, beta, parents, depths, initial_state, return_node_states=False,
                   valid=None, max_depth=None, node_states=None, initial_rows=None, state_rows=None,
                   tree_mask=None, stash=None, gate=None):  # fmt: skip
        assert not return_node_states and node_states is None  # no_buffer
        if gate is not None:
            g, beta = (t.view(*v.shape[:2], -1) for t in gate.values())
        dispatch._write_stash(stash, g, beta)
        calls.append(1)
        o = tree_chunk_gated_delta_rule(
            q, k, v, g, beta, parents, depths, initial_state, valid, max_depth, initial_rows,
            mask=tree_mask,
        )[0]  # fmt: skip
        return o, None

    monkeypatch.setattr(state_contexts, "tree_rule", chunk_rule)
    yield
    assert calls


@pytest.fixture(scope="module")
def ar_tokens(toy_hybrid_pair):
    from test_hybrid_engine import _run

    return [o.token_ids for o in _run(toy_hybrid_pair)]


@pytest.mark.usefixtures("one_torch_thread", "chunk_forced")
@pytest.mark.parametrize("budget", [16, 48])
def test_hybrid_no_buffer_lossless_with_chunk_tree(toy_hybrid_pair, ar_tokens, budget):
    from engine_utils import mean_accept
    from test_hybrid_engine import _run

    outs = _run(
        toy_hybrid_pair,
        "DDTREE",
        "no_buffer",
        speculative_ddtree_budget=budget,
        speculative_ddtree_topk_cap=budget,
    )
    assert [o.token_ids for o in outs] == ar_tokens and mean_accept(outs) > 2


@pytest.mark.usefixtures("one_torch_thread", "chunk_forced")
def test_hybrid_no_buffer_off_first_branch_with_chunk_tree(toy_hybrid_pair, ar_tokens, monkeypatch):
    from engine_utils import mean_accept
    from test_hybrid_engine import _record_walks, _run

    rounds = _record_walks(monkeypatch)
    outs = _run(toy_hybrid_pair, "DDTREE", "no_buffer", speculative_ddtree_budget=16)
    assert [o.token_ids for o in outs] == ar_tokens and mean_accept(outs) > 2
    off_first = [k for k, off, _ in rounds if off]
    assert off_first and max(off_first) >= 2
