"""speculative/batch_budget.py: the batch-wide verify budget against a host brute force, its
invariants (ancestor-closed, sum <= R, caps), the builders' per-node values, the packed layout, and
the accept walk on the cut tree (lossless: the cut tree accepts the full tree's path whenever that
path lies inside the cut, and otherwise the longest prefix of it that does)."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree.speculative.accept import accept_tree
from ddtree.speculative.batch_budget import allocate, batch_gain, node_values, pack, unpack
from ddtree.speculative.tree import build_chain, build_tree

V, D = 24, 5


def _logits(seed: int, b: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, D, V, generator=g) * 2.5
    # integer logits: many equal path scores (ties across requests, siblings and depths)
    return x.round() if ties else x


def _tree(seed: int, b: int = 5, budget: int = 12, ties: bool = False, shadow: bool = False):
    g = torch.Generator().manual_seed(seed + 1)
    roots = torch.randint(0, V, (b,), generator=g)
    depth = torch.randint(0, D + 1, (b,), generator=g)
    return build_tree(
        roots, _logits(seed, b, ties), budget, 4, shadow, max_depth=depth, node_scores=True
    )


def _host_values(tree) -> list[list[float]]:
    """Each node's least path probability on its root path (node_values' definition), by a walk."""
    probs, parents, valid = tree.node_probs.tolist(), tree.parents.tolist(), tree.valid.tolist()
    out = []
    for p, par, ok in zip(probs, parents, valid):
        row = []
        for j in range(len(p)):
            if j == 0:
                row.append(1.0)
                continue
            if not ok[j]:
                row.append(-1.0)
                continue
            v, k = p[j], j
            while k > 0:
                v, k = min(v, p[k]), par[k]
            row.append(v)
        out.append(row)
    return out


def _brute_force(tree, cap: list[int], total: int) -> tuple[list[int], list[set[int]]]:
    values = _host_values(tree)
    pool, orders = [], []
    for i, row in enumerate(values):
        order = sorted((j for j in range(1, len(row)) if row[j] >= 0), key=lambda j: (-row[j], j))
        orders.append(order)
        pool += [(-row[j], r, i) for r, j in enumerate(order[: cap[i]])]
    cut = [0] * len(values)
    for _, _, i in sorted(pool)[:total]:
        cut[i] += 1
    return cut, [{0, *order[:c]} for order, c in zip(orders, cut)]


@pytest.mark.parametrize("seed", range(12))
def test_allocation_matches_brute_force_and_keeps_invariants(seed):
    rnd = random.Random(seed)
    ties, shadow = seed % 3 == 0, seed % 4 == 1
    tree = _tree(seed, ties=ties, shadow=shadow)
    b = tree.batch_size
    cap = [rnd.choice([0, 1, 3, 12, 99]) for _ in range(b)]
    total = rnd.choice([0, 1, 4, 9, 20, 60])
    alloc = allocate(tree, torch.tensor(cap), total)
    want_cut, want_keep = _brute_force(tree, cap, total)
    assert alloc.cut.tolist() == want_cut
    got_keep = [set(torch.nonzero(k).flatten().tolist()) for k in alloc.keep]
    assert got_keep == want_keep
    assert int(alloc.cut.sum()) <= total
    assert all(c <= k for c, k in zip(alloc.cut.tolist(), cap))
    parents = tree.parents.tolist()
    for i, kept in enumerate(got_keep):  # ancestor-closed, root always kept
        assert 0 in kept and all(parents[i][j] in kept for j in kept if j)
    # a device-scalar budget is the same budget (the round may keep R on the device)
    same = allocate(tree, torch.tensor(cap), torch.tensor(total))
    assert torch.equal(same.cut, alloc.cut) and torch.equal(same.keep, alloc.keep)


@pytest.mark.parametrize("ties", [False, True])
def test_node_probs_are_the_selections_scores_and_never_rise_down_a_path(ties):
    tree = _tree(3, b=6, budget=16, ties=ties)
    for i in range(tree.batch_size):
        ok = tree.valid[i].clone()
        ok[0] = False
        nodes = tree.node_probs[i][ok].sort(descending=True).values
        best_first = tree.path_probs[i][: int(ok.sum())]
        assert torch.equal(nodes, best_first)  # bit for bit: the beam's own additions
        assert (best_first[1:] <= best_first[:-1]).all()  # best-first order is non-increasing
    par = tree.parents.clamp(min=0)
    child = tree.valid & (tree.parents >= 0)
    assert (tree.node_probs.gather(1, par)[child] >= tree.node_probs[child]).all()
    assert torch.equal(node_values(tree)[tree.valid], tree.node_probs[tree.valid].clamp(max=1))


@pytest.mark.parametrize("ties", [False, True])
def test_cut_tree_is_the_builders_tree_of_that_budget(ties):
    """Without shadow_linear the value order is the builder's best-first order: the packed cut
    tree is what build_tree(budgets=cut) builds, node for node."""
    b, budget = 6, 16
    logits = _logits(7, b, ties)
    roots = torch.arange(b)
    full = build_tree(roots, logits, budget, 4, False, node_scores=True)
    alloc = allocate(full, torch.full((b,), budget), 25)
    cut = build_tree(roots, logits, budget, 4, False, budgets=alloc.cut)
    lay = pack(full, alloc.keep, torch.zeros(b, dtype=torch.int64), b + 25)
    for name in ("tokens", "parents", "depths", "valid", "tree_mask"):
        assert torch.equal(getattr(lay.tree, name), getattr(cut, name)), name


def test_chain_budget_keeps_chain_prefixes():
    b = 4
    logits = _logits(11, b, False)
    chain = build_chain(
        torch.arange(b), logits, max_depth=torch.tensor([5, 2, 0, 5]), node_scores=True
    )
    alloc = allocate(chain, torch.tensor([5, 5, 5, 1]), 6)
    for i in range(b):
        c = int(alloc.cut[i])
        assert alloc.keep[i].tolist() == [True] * (c + 1) + [False] * (D - c)
    assert alloc.cut[2] == 0 and alloc.cut[3] <= 1 and int(alloc.cut.sum()) <= 6


def test_packed_layout_rows_and_unpack():
    tree = _tree(5, b=4, budget=10)
    alloc = allocate(tree, torch.tensor([10, 0, 3, 10]), 11)
    seq = torch.tensor([7, 30, 2, 11])
    T = 4 + 11 + 3  # a bucket above b + R
    lay = pack(tree, alloc.keep, seq, T)
    assert lay.q_lens.tolist() == (alloc.cut + 1).tolist()
    assert lay.qo_indptr.tolist() == [0, *torch.cumsum(lay.q_lens, 0).tolist()]
    n = int(lay.q_lens.sum())
    assert lay.row_valid.tolist() == [True] * n + [False] * (T - n)
    for i in range(4):
        kept = torch.nonzero(alloc.keep[i]).flatten().tolist()
        for loc, j in enumerate(kept):
            row = int(lay.qo_indptr[i]) + loc
            assert int(lay.node_row[i, j]) == row == int(lay.local_row[i, loc])
            assert int(lay.local_node[i, loc]) == j
            assert (int(lay.flat_req[row]), int(lay.flat_local[row])) == (i, loc)
            assert int(lay.input_ids[row]) == int(tree.tokens[i, j])
            assert int(lay.positions[row]) == int(seq[i] + tree.depths[i, j])
            assert int(lay.kv_positions[row]) == int(seq[i]) + loc
        assert (lay.node_row[i][~alloc.keep[i]] == -1).all()
        assert (lay.local_node[i, len(kept) :] == -1).all()
    flat = torch.arange(T) * 10
    back = unpack(flat, lay, fill=-1)
    assert torch.equal(back, torch.where(lay.local_row >= 0, lay.local_row * 10, -1))


def _path_set(tree, res, i) -> list[int]:
    return res.path[i, : int(res.accept_length[i]) + 1].tolist()


@pytest.mark.parametrize("seed", range(6))
def test_cut_tree_accepts_the_full_trees_path_inside_the_cut(seed):
    """The target's tokens at the kept nodes are the full verify's (tests/test_packed_verify.py
    checks the logits); given them, the cut tree's accept walk gives the full tree's output
    whenever the full accepted path is kept, and otherwise the longest kept prefix of that path
    with the target's token after it: every emitted token is the target's own, so lossless."""
    g = torch.Generator().manual_seed(100 + seed)
    tree = _tree(seed, b=6, budget=16)
    b, W = tree.tokens.shape
    # a target that mostly follows the tree's first child, else a random token
    first_child = torch.full((b, W), -1, dtype=torch.int64)
    for i in range(b):
        for j in range(W - 1, 0, -1):
            if tree.valid[i, j]:
                first_child[i, tree.parents[i, j]] = tree.tokens[i, j]
    noise = torch.randint(0, V, (b, W), generator=g)
    follow = torch.rand(b, W, generator=g) < 0.75
    target = torch.where(follow & (first_child >= 0), first_child, noise)
    full = accept_tree(tree, target)
    alloc = allocate(tree, torch.randint(0, 17, (b,), generator=g), int(seed * 5))
    lay = pack(tree, alloc.keep, torch.zeros(b, dtype=torch.int64), b + seed * 5)
    # the packed verify's per-row targets, read back into the compact tree's order
    T = b + seed * 5
    rows = torch.where(lay.node_row >= 0, lay.node_row, T).flatten()  # cut nodes: a spill row
    flat = torch.zeros(T + 1, dtype=torch.int64).scatter(0, rows, target.flatten())[:T]
    got = accept_tree(lay.tree, unpack(flat, lay))
    for i in range(b):
        full_path = _path_set(tree, full, i)
        cut_path = [int(lay.local_node[i, x]) for x in _path_set(lay.tree, got, i)]
        inside = [j for j in full_path if alloc.keep[i, j]]
        k = next((n for n, j in enumerate(full_path) if not alloc.keep[i, j]), len(full_path))
        assert cut_path == full_path[:k] == inside[:k]
        out = got.out_tokens[i, : int(got.num_out[i])].tolist()
        if k == len(full_path):
            assert out == full.out_tokens[i, : int(full.num_out[i])].tolist()
        assert out[-1] == int(target[i, cut_path[-1]])


def test_ties_across_requests_go_to_the_shallower_rank_then_the_lower_request():
    """Identical requests tie node for node: the budget goes round-robin by rank (every request
    its best node before any its second), the odd one to the lower request."""
    b = 4
    logits = _logits(2, 1, False).expand(b, D, V).contiguous()
    tree = build_tree(torch.zeros(b, dtype=torch.int64), logits, 8, 4, False, node_scores=True)
    for total, want in ((3, [1, 1, 1, 0]), (6, [2, 2, 1, 1]), (9, [3, 2, 2, 2])):
        assert allocate(tree, torch.full((b,), 8), total).cut.tolist() == want
    # a request's deeper node tying another's first: the first goes first
    chain = build_chain(torch.zeros(2, dtype=torch.int64), _logits(4, 2, False), node_scores=True)
    chain.node_probs = torch.tensor([[1.0, 0.5, 0.5, 0.5, 0.1, 0.1], [1.0, 0.5, 0.1, 0, 0, 0]])
    assert allocate(chain, torch.full((2,), 5), 2).cut.tolist() == [1, 1]
    assert allocate(chain, torch.full((2,), 5), 4).cut.tolist() == [3, 1]


def test_values_rising_down_a_path_still_keep_an_ancestor_closed_set():
    """A producer whose child outscores its parent (a scan's rounding, a grammar's rewrite):
    node_values lowers the child to its parent's value, so the parent is never cut first."""
    chain = build_chain(torch.zeros(1, dtype=torch.int64), _logits(4, 1, False), node_scores=True)
    chain.node_probs = torch.tensor([[1.0, 0.2, 0.9, 0.1, 0.05, 0.01]])
    alloc = allocate(chain, torch.full((1,), 5), 2)
    assert alloc.keep.tolist() == [[True, True, True, False, False, False]]
    assert node_values(chain)[0].tolist() == pytest.approx([1.0, 0.2, 0.2, 0.1, 0.05, 0.01])


def test_no_host_reads_and_launches_independent_of_the_batch():
    """allocate -> pack -> unpack read nothing back to the host (no .item() / .tolist(): a CUDA
    graph can hold them, a device-scalar budget too), in as many launches at any batch size."""
    from ddtree.tools.studies.op_count import LaunchCounter

    counts = []
    for b in (3, 12):
        tree = _tree(1, b=b, budget=16)
        c = LaunchCounter()
        with c:
            alloc = allocate(tree, torch.full((b,), 16), torch.tensor(2 * b))
            lay = pack(tree, alloc.keep, torch.zeros(b, dtype=torch.int64), 3 * b)
            unpack(torch.zeros(3 * b), lay)
        assert c.syncs == 0
        counts.append(c.ops["other"])
    assert counts[0] == counts[1] and sum(counts[0].values()) < 120, counts[0]


def test_batch_gain_is_the_kept_nodes_value_at_every_budget():
    """gain[R] = the summed values of what allocate(R) keeps (the host's throughput choice and
    the allocation see the same nodes)."""
    tree = _tree(8, b=5, budget=12)
    cap = torch.tensor([12, 0, 3, 12, 5])
    gain = batch_gain(tree, cap)
    values = node_values(tree)
    for total in (0, 1, 2, 7, 19, 33, 60):
        keep = allocate(tree, cap, total).keep.clone()
        keep[:, 0] = False
        assert float(gain[total]) == pytest.approx(float(values[keep].sum()), rel=1e-5)
    assert float(gain[-1]) == pytest.approx(float(gain[33]))  # caps reached: flat


def test_node_probs_from_the_drafter_logits_equal_the_builds_own():
    """A tree built without node scores (the draft graphs') gets them from the logits it was
    built on: the same path probabilities `build_tree(node_scores=True)` records, padding 0."""
    from ddtree.speculative.batch_budget import node_probs_from_logits

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 64, generator=g) * 3
    roots = torch.tensor([1, 2, 3])
    tree = build_tree(roots, logits, 12, 4, False, node_scores=True)
    bare = build_tree(roots, logits, 12, 4, False)
    assert bare.node_probs is None
    torch.testing.assert_close(node_probs_from_logits(bare, logits), tree.node_probs)
    chain = build_tree(roots, logits, 12, 1, False)  # top-1: 5 drafted nodes, 7 padding
    assert (
        not chain.valid.all() and (node_probs_from_logits(chain, logits)[~chain.valid] == 0).all()
    )
