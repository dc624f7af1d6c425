import itertools
import random

import pytest
import torch

from ddtree.speculative.accept import accept_tree
from ddtree.speculative.tree import DraftTree, build_chain, build_tree
from ddtree.speculative.tree_ref import build_tree_ref


def prefixes(tree: DraftTree, i: int) -> list[tuple[int, ...]]:
    toks, pars, ok = tree.tokens[i].tolist(), tree.parents[i].tolist(), tree.valid[i].tolist()
    out: list[tuple[int, ...]] = []
    for j, p in enumerate(pars):
        out.append(() if j == 0 else (out[p] + (toks[j],) if ok[j] else None))
    return [pfx for j, pfx in enumerate(out) if j > 0 and ok[j]]


def brute_force(logits: torch.Tensor, budget: int, cap: int, shadow: bool, limit: int) -> set:
    D, V = logits.shape
    k = min(cap, budget, V)
    logp = torch.log_softmax(logits.double(), -1)
    top = logp.topk(k, -1).indices.tolist()
    all_pfx = []
    for d in range(1, limit + 1):
        for ranks in itertools.product(range(k), repeat=d):
            toks = tuple(top[i][r] for i, r in enumerate(ranks))
            all_pfx.append((sum(logp[i, t].item() for i, t in enumerate(toks)), toks))
    all_pfx.sort(key=lambda x: -x[0])
    chain = (
        [tuple(top[i][0] for i in range(d)) for d in range(1, min(budget, limit) + 1)]
        if shadow
        else []
    )
    rest = [t for _, t in all_pfx if t not in set(chain)]
    return set(chain) | set(rest[: budget - len(chain)])


def check_structure(tree: DraftTree, logits: torch.Tensor, budget: int, cap: int, D: int):
    b, n = tree.tokens.shape
    assert n == 1 + budget and tree.tree_mask.shape == (b, n, n)
    k = min(cap, budget, logits.shape[-1])
    topk_ids = logits.float().topk(k, -1).indices
    for i in range(b):
        toks, pars, deps, ok = (
            x[i].tolist() for x in (tree.tokens, tree.parents, tree.depths, tree.valid)
        )
        assert ok[0] and pars[0] == -1 and deps[0] == 0
        n_ok = sum(ok)
        assert all(ok[:n_ok]) and not any(ok[n_ok:]), "padding must come last"
        for j in range(1, n):
            if not ok[j]:
                assert pars[j] == -1 and deps[j] == 0
                assert tree.tree_mask[i, j].nonzero().flatten().tolist() == [j]
                continue
            p = pars[j]
            assert 0 <= p < j and ok[p] and deps[j] == deps[p] + 1 and 1 <= deps[j] <= D
            assert toks[j] in topk_ids[i, deps[j] - 1].tolist()
            expect = tree.tree_mask[i, p].clone()
            expect[j] = True
            assert torch.equal(tree.tree_mask[i, j], expect)
        assert deps[:n_ok] == sorted(deps[:n_ok]), "nodes in increasing depth"
        for d in range(1, D + 1):
            at_d = [j for j in range(n) if ok[j] and deps[j] == d]
            assert len({toks[j] for j in at_d}) <= k  # cap: at most K distinct tokens per depth
            for p in set(pars[j] for j in at_d):
                sib = [toks[j] for j in at_d if pars[j] == p]
                assert len(sib) == len(set(sib)), "siblings carry distinct tokens"


CASES = [
    (V, D, budget, cap, shadow)
    for V in (2, 3, 5, 6)
    for D in (1, 2, 4)
    for budget in (1, 2, 5, 13, 30)
    for cap in sorted({1, 2, V})
    for shadow in (False, True)
]


@pytest.mark.parametrize("V,D,budget,cap,shadow", CASES)
def test_matches_brute_force_and_heap(V, D, budget, cap, shadow):
    gen = torch.Generator().manual_seed(hash((V, D, budget, cap, shadow)) % 2**31)
    b = 3
    logits = torch.randn(b, D, V, generator=gen) * 2
    roots = torch.randint(0, V, (b,), generator=gen)
    tree = build_tree(roots, logits, budget, cap, shadow)
    check_structure(tree, logits, budget, cap, D)
    for i in range(b):
        got = prefixes(tree, i)
        assert len(got) == len(set(got))
        want = brute_force(logits[i], budget, cap, shadow, D)
        assert set(got) == want
        assert (
            set(build_tree_ref(int(roots[i]), logits[i], budget, cap, shadow).prefixes()[1:])
            == want
        )
        assert all(p[:-1] in set(got) | {()} for p in got), "prefix-closed"
        assert tree.tokens[i, 0] == roots[i]


def test_node_order_is_depth_then_score():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 8, generator=gen)
    tree = build_tree(torch.zeros(2, dtype=torch.long), logits, 40, 8, False)
    logp = torch.log_softmax(logits, -1)
    for i in range(2):
        pfx = prefixes(tree, i)
        keys = [(len(p), -sum(logp[i, d, t].item() for d, t in enumerate(p))) for p in pfx]
        assert keys == sorted(keys)


def test_padding_when_few_prefixes():
    logits = torch.randn(2, 2, 2)
    tree = build_tree(torch.tensor([0, 1]), logits, 30, 5, False)
    assert tree.valid.sum(1).tolist() == [7, 7]  # root + 2 + 4
    assert not tree.valid[:, 7:].any() and (tree.parents[:, 7:] == -1).all()


def test_max_depth_per_request():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 4, 3, generator=gen)
    limits = torch.tensor([0, 1, 2, 4])
    for shadow in (False, True):
        tree = build_tree(torch.zeros(4, dtype=torch.long), logits, 12, 3, shadow, max_depth=limits)
        check_structure(tree, logits, 12, 3, 4)
        for i, lim in enumerate(limits.tolist()):
            deepest = int(tree.depths[i].max())
            assert deepest == lim if shadow else deepest <= lim
            assert set(prefixes(tree, i)) == brute_force(logits[i], 12, 3, shadow, lim)
            ref = build_tree_ref(0, logits[i], 12, 3, shadow, max_depth=lim)
            assert set(ref.prefixes()[1:]) == brute_force(logits[i], 12, 3, shadow, lim)
    chain = build_chain(torch.zeros(4, dtype=torch.long), logits, max_depth=limits)
    assert chain.valid.sum(1).tolist() == [1, 2, 3, 5]


def test_chain():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, generator=gen).bfloat16()
    chain = build_chain(torch.tensor([4, 5]), logits)
    assert chain.tokens.shape == (2, 6) and chain.valid.all()
    assert torch.equal(chain.tokens[:, 1:], logits.float().argmax(-1))
    assert chain.parents[0].tolist() == [-1, 0, 1, 2, 3, 4]
    assert torch.equal(chain.tree_mask[0], torch.ones(6, 6, dtype=torch.bool).tril())
    tree = build_tree(torch.tensor([4, 5]), logits, 5, 1, False)
    assert torch.equal(tree.tokens, chain.tokens) and torch.equal(tree.tree_mask, chain.tree_mask)


def test_ties_stay_prefix_closed_and_optimal():
    # peaked rows give log-prob exactly 0.0 (child ties parent); integer logits tie siblings
    logits = torch.randint(0, 3, (3, 4, 6)).float()
    logits[:, 1, 2] = 100.0
    logits[2] = 0.0
    for shadow in (False, True):
        tree = build_tree(torch.zeros(3, dtype=torch.long), logits, 20, 4, shadow)
        check_structure(tree, logits, 20, 4, 4)
        again = build_tree(torch.zeros(3, dtype=torch.long), logits, 20, 4, shadow)
        assert torch.equal(tree.tokens, again.tokens) and torch.equal(tree.parents, again.parents)
        logp = torch.log_softmax(logits.double(), -1)
        for i in range(3):
            got = prefixes(tree, i)
            assert all(p[:-1] in set(got) | {()} for p in got)
            if not shadow:
                want = brute_force(logits[i], 20, 4, False, 4)

                def score(ps, i=i):
                    return sorted(sum(logp[i, d, t].item() for d, t in enumerate(p)) for p in ps)

                assert score(got) == pytest.approx(score(want))


def _accept_len(tree: DraftTree, target_of) -> int:
    pfx = [()] + [None] * (tree.num_nodes - 1)
    toks, pars, ok = tree.tokens[0].tolist(), tree.parents[0].tolist(), tree.valid[0].tolist()
    for j in range(1, tree.num_nodes):
        if ok[j]:
            pfx[j] = pfx[pars[j]] + (toks[j],)
    target = torch.tensor([[target_of(p) if p is not None else 0 for p in pfx]])
    return int(accept_tree(tree, target).accept_length[0])


def _shadow_violations(shadow: bool, trials: int) -> int:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    bad = 0
    for _ in range(trials):
        V, D, budget = rng.randint(2, 5), rng.randint(1, 5), rng.randint(1, 12)
        logits = torch.randn(1, D, V, generator=gen) * 1.5
        top1 = logits[0].argmax(-1).tolist()
        table: dict = {}

        def target_of(p):  # a deterministic "target model": the same prefix gets the same token
            if p not in table:
                table[p] = top1[len(p)] if len(p) < D and rng.random() < 0.7 else rng.randrange(V)
            return table[p]

        root = torch.zeros(1, dtype=torch.long)
        tree = build_tree(root, logits, budget, V, shadow)
        bad += _accept_len(tree, target_of) < min(
            _accept_len(build_chain(root, logits), target_of), budget
        )
    return bad


def test_shadow_linear_never_worse_than_chain():
    assert _shadow_violations(shadow=True, trials=600) == 0


def test_without_shadow_chain_can_lose():
    assert _shadow_violations(shadow=False, trials=600) > 0
    # hand-made: two equally likely first tokens; budget 3 cannot afford the depth-3 chain
    logits = torch.full((1, 3, 4), 0.9)
    logits[0, 0] = torch.tensor([1.0, 0.99, -9.0, -9.0])
    logits[0, 1, 2] = logits[0, 2, 3] = 1.0
    root = torch.zeros(1, dtype=torch.long)
    plain = build_tree(root, logits, 3, 4, False)
    assert (0, 2, 3) not in prefixes(plain, 0)
    assert (0, 2, 3) in prefixes(build_tree(root, logits, 3, 4, True), 0)


def test_large_shape_smoke():
    torch.manual_seed(0)
    logits = torch.randn(2, 15, 151936).bfloat16()
    roots = torch.tensor([1, 2])
    tree = build_tree(roots, logits, 256, 256, True)
    assert tree.tokens.shape == (2, 257) and tree.valid.all()
    assert (tree.depths.max(1).values == 15).all()  # shadow chain reaches full depth
    assert torch.equal(
        tree.positions(torch.tensor([10, 20])), torch.tensor([[10], [20]]) + tree.depths
    )


@pytest.mark.parametrize(
    "budget,cap,shadow", [(100, 20, False), (100, 20, True), (64, 64, False), (7, 3, True)]
)
def test_medium_sizes_match_heap(budget, cap, shadow):
    gen = torch.Generator().manual_seed(budget + cap)
    logits = torch.randn(2, 6, 50, generator=gen) * 3
    limits = torch.tensor([6, 4])
    tree = build_tree(
        torch.zeros(2, dtype=torch.long), logits, budget, cap, shadow, max_depth=limits
    )
    check_structure(tree, logits, budget, cap, 6)
    for i in range(2):
        ref = build_tree_ref(0, logits[i], budget, cap, shadow, max_depth=int(limits[i]))
        assert set(prefixes(tree, i)) == set(ref.prefixes()[1:])


@pytest.mark.parametrize("shadow", [False, True])
def test_per_request_budgets_are_the_smaller_trees_packed(shadow):
    """One build at the largest budget, cut per request by the best-first order, equals each
    request's own smaller build (same prefixes, packed first, prefix-closed), and narrowing to the
    largest kept budget + 1 loses no node."""
    gen = torch.Generator().manual_seed(7)
    b, D, V, B = 6, 5, 6, 24
    logits = torch.randn(b, D, V, generator=gen) * 2
    roots = torch.randint(0, V, (b,), generator=gen)
    budgets = torch.tensor([0, 1, 3, 8, 17, 24])
    limits = torch.tensor([5, 5, 2, 5, 3, 5])
    tree = build_tree(roots, logits, B, 4, shadow, max_depth=limits, budgets=budgets)
    check_structure(tree, logits, B, 4, D)
    narrow = tree.narrow(1 + int(budgets.max()))
    for i, bi in enumerate(budgets.tolist()):
        got = prefixes(tree, i)
        assert prefixes(narrow, i) == got
        if bi == 0:
            assert got == [] and tree.valid[i].sum() == 1
            continue
        own = build_tree(roots[i : i + 1], logits[i : i + 1], bi, 4, shadow, limits[i : i + 1])
        assert set(got) == set(prefixes(own, 0)), i
        assert all(p[:-1] in set(got) | {()} for p in got), "prefix-closed"
    assert not torch.equal(tree.valid, build_tree(roots, logits, B, 4, shadow, limits).valid)


def test_path_probs_give_expected_accept_of_every_budget():
    """cumsum(path_probs)[b - 1] = sum of the drafter's path probabilities of the budget-b tree."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 4, 5, generator=gen)
    roots = torch.zeros(3, dtype=torch.long)
    logp = torch.log_softmax(logits.double(), -1)
    full = build_tree(roots, logits, 20, 5, False)
    assert full.path_probs.shape == (3, 20)
    expect = full.path_probs.double().cumsum(1)
    for bi in (1, 2, 7, 20):
        small = build_tree(roots, logits, bi, 5, False)
        for i in range(3):
            q = sum(
                torch.exp(sum(logp[i, d, t] for d, t in enumerate(p))) for p in prefixes(small, i)
            )
            assert abs(float(q) - float(expect[i, bi - 1])) < 1e-5
    assert (full.path_probs[:, :-1] >= full.path_probs[:, 1:] - 1e-7).all(), "best-first"


def test_chain_mask_is_the_ancestor_mask():
    """build_chain writes its lower-triangular mask directly: equal to ancestor_mask of its parents,
    padding past each request's depth limit included."""
    from ddtree.speculative.tree import ancestor_mask

    gen = torch.Generator().manual_seed(0)
    for b, D in ((1, 1), (3, 4), (5, 15)):
        logits = torch.randn(b, D, 50, generator=gen)
        for limit in (None, torch.randint(0, D + 1, (b,), generator=gen)):
            tree = build_chain(torch.randint(0, 50, (b,), generator=gen), logits, limit)
            assert torch.equal(tree.tree_mask, ancestor_mask(tree.parents, D))
