"""The path-conditioned (Markov) DDTree build for DFlash2 against a brute-force oracle: enumerate
every path of the selector's per-parent top-k children, score it by the sum of log q along it, keep
the best B (shadow-linear: the greedy chain first). Random drafts, every budget / top-k cap /
shadow-linear / depth-limit combination below. ~4 s."""

import itertools

import pytest
import torch

from ddtree.speculative.markov_tree import (
    MarkovDraft,
    build_markov_chain,
    build_markov_tree,
    child_scores,
)
from ddtree.speculative.tree import ancestor_mask

V, R = 40, 5


def random_draft(b, D, K, seed=0, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, D, V, generator=g) * 2
    unary, cand = logits.topk(K, dim=-1)
    edge = torch.randn(b, D, K, R, generator=g) * sharp
    codebook = torch.randn(V, R, generator=g)
    return MarkovDraft(logits, unary, cand, edge, codebook)


def oracle(draft, i, root, budget, cap, shadow, limit):
    """[(prefix tuple of tokens, score)] of request i's tree, best-first (chain first if shadow)."""
    D, K = draft.unary.shape[1:]
    k = min(cap, budget, K)
    nodes = []  # (prefix, score)

    def expand(prefix, last, score, d):
        if d == limit:
            return
        row = child_scores(_one(draft, i), d, torch.tensor([[last]]))[0, 0]
        order = row.sort(descending=True, stable=True).indices[:k]
        mass = draft.unary[i, d].logsumexp(0) - draft.logits[i, d].logsumexp(0)
        logq = row - row.logsumexp(0) + mass  # q times the candidates' unary mass
        for r in order.tolist():
            tok = int(draft.cand[i, d, r])
            sc = score + float(logq[r])
            nodes.append((prefix + (tok,), sc))
            expand(prefix + (tok,), tok, sc, d + 1)

    expand((), root, 0.0, 0)
    chain, cur = [], ()
    for d in range(limit):
        kids = [n for n in nodes if len(n[0]) == d + 1 and n[0][:d] == cur]
        best = max(kids, key=lambda n: n[1])
        chain.append(best)
        cur = best[0]
    spine = chain[: min(budget, limit)] if shadow else []
    rest = sorted((n for n in nodes if n not in spine), key=lambda n: -n[1])
    return spine + rest[: budget - len(spine)], chain


def _one(draft, i):
    return MarkovDraft(*(x[i : i + 1] if j < 4 else x for j, x in enumerate(draft)))


def prefixes(tree, i):
    out = {0: ()}
    for n in range(1, tree.num_nodes):
        if tree.valid[i, n]:
            out[n] = out[int(tree.parents[i, n])] + (int(tree.tokens[i, n]),)
    return out


CASES = list(itertools.product([1, 3, 8, 20], [1, 2, 6], [False, True]))


@pytest.mark.parametrize("budget,cap,shadow", CASES)
def test_tree_is_the_best_budget_nodes(budget, cap, shadow):
    b, D, K = 3, 4, 6
    draft = random_draft(b, D, K, seed=budget * 31 + cap)
    roots = torch.tensor([3, 7, 11])
    limits = torch.tensor([4, 2, 3])
    tree = build_markov_tree(roots, draft, budget, cap, shadow, max_depth=limits)
    for i in range(b):
        want, chain = oracle(draft, i, int(roots[i]), budget, cap, shadow, int(limits[i]))
        got = prefixes(tree, i)
        assert sorted(got.values())[1:] == sorted(p for p, _ in want)
        assert int(tree.valid[i].sum()) == 1 + len(want)
        # best-first path probabilities of the selected nodes
        n = len(want)
        torch.testing.assert_close(
            tree.path_probs[i, :n], torch.tensor([s for _, s in want]).exp(), rtol=1e-5, atol=1e-7
        )
        assert (tree.path_probs[i, n:] == 0).all()
        torch.testing.assert_close(
            tree.chain_probs[i, : len(chain)],
            torch.tensor([s for _, s in chain]).exp(),
            rtol=1e-5,
            atol=1e-7,
        )
        assert (tree.chain_probs[i, len(chain) :] == 0).all()
    # a well-formed DraftTree: parents precede children, depth = parent's + 1, the mask its ancestors
    ok = tree.valid & (tree.parents >= 0)
    par = tree.parents.clamp(min=0)
    assert (tree.parents < torch.arange(tree.num_nodes)).all()
    assert (tree.depths[ok] == tree.depths.gather(1, par)[ok] + 1).all()
    assert torch.equal(tree.tree_mask, ancestor_mask(tree.parents, D))


def test_chain_is_the_greedy_path_and_the_shadow_spine():
    b, D, K = 4, 5, 6
    draft = random_draft(b, D, K, seed=5, sharp=2.0)
    roots = torch.tensor([1, 2, 3, 4])
    limits = torch.tensor([5, 0, 3, 4])
    chain = build_markov_chain(roots, draft, limits)
    tree = build_markov_tree(roots, draft, 8, 3, True, max_depth=limits)
    for i in range(b):
        _, greedy = oracle(draft, i, int(roots[i]), 8, 3, True, int(limits[i]))
        n = len(greedy)
        assert chain.tokens[i, 1 : 1 + n].tolist() == [p[-1] for p, _ in greedy]
        assert not chain.valid[i, 1 + n :].any()
        # shadow-linear keeps the whole chain (it counts toward the budget)
        assert {p for p, _ in greedy} <= set(prefixes(tree, i).values())
    torch.testing.assert_close(chain.chain_probs, tree.chain_probs)
    # and the selector really conditions: the chain is not the per-position unary argmax
    assert (chain.tokens[:, 1:] != draft.logits.argmax(-1)).any()


def test_budget_cut_equals_the_smaller_tree():
    """One build at B cut per request to budgets[i] equals the B = budgets[i] build (its top-k cap
    included: a node of the best b has fewer than b better siblings)."""
    b, D, K = 3, 5, 6
    draft = random_draft(b, D, K, seed=9)
    roots = torch.tensor([5, 6, 7])
    cut = torch.tensor([3, 12, 7])
    for shadow in (False, True):
        whole = build_markov_tree(roots, draft, 12, 4, shadow, budgets=cut)
        for i in range(b):
            alone = build_markov_tree(roots, draft, int(cut[i]), 4, shadow)
            assert sorted(prefixes(whole, i).values()) == sorted(prefixes(alone, i).values())


def test_the_oracle_can_fail():
    """A marginal (unconditioned) selection differs from the path-conditioned one on these drafts:
    the comparison above would catch a build that ignored the parent's token."""
    b, D, K = 3, 4, 6
    draft = random_draft(b, D, K, seed=1, sharp=2.0)
    roots = torch.tensor([3, 7, 11])
    flat = MarkovDraft(draft.logits, draft.unary, draft.cand, draft.edge, draft.codebook * 0)
    a = build_markov_tree(roots, draft, 8, 6, False)
    c = build_markov_tree(roots, flat, 8, 6, False)
    assert any(sorted(prefixes(a, i).values()) != sorted(prefixes(c, i).values()) for i in range(b))
