import random

import torch

from ddtree.speculative.accept import accept_tree
from ddtree.speculative.tree import DraftTree, build_tree
from ddtree.speculative.tree_ref import accept_ref

# root(100) -> 1:5 -> 4:8
#           -> 2:7 -> 3:9 -> 5:11
#           -> 6:pad
TOKENS = torch.tensor([[100, 5, 7, 9, 8, 11, 0]])
PARENTS = torch.tensor([[-1, 0, 0, 2, 1, 3, -1]])


def hand_tree() -> DraftTree:
    return DraftTree.from_parents(TOKENS, PARENTS, num_depths=3)


def run(target: list[int]):
    return accept_tree(hand_tree(), torch.tensor([target]))


def test_from_parents():
    t = hand_tree()
    assert t.depths.tolist() == [[0, 1, 1, 2, 2, 3, 0]]
    assert t.valid.tolist() == [[True] * 6 + [False]]
    assert t.tree_mask[0, 5].tolist() == [True, False, True, True, False, True, False]
    assert t.tree_mask[0, 6].tolist() == [False] * 6 + [True]


def test_whole_tree_rejected():
    # target at root draws 0: no child has token 0 (padding must not match)
    r = run([0, 1, 2, 3, 4, 5, 6])
    assert r.accept_length.tolist() == [0] and r.num_out.tolist() == [1]
    assert r.path.tolist() == [[0, 0, 0, 0]] and r.last_node.tolist() == [0]
    assert r.out_tokens.tolist() == [[0, -1, -1, -1]]


def test_second_branch_partial():
    r = run([7, 50, 9, 42, 0, 0, 0])  # root -> 7 (node 2) -> 9 (node 3) -> 42 not a child: bonus
    assert r.accept_length.tolist() == [2] and r.num_out.tolist() == [3]
    assert r.path.tolist() == [[0, 2, 3, 3]] and r.last_node.tolist() == [3]
    assert r.out_tokens.tolist() == [[7, 9, 42, -1]]


def test_first_branch():
    r = run([5, 8, 0, 0, 77, 0, 0])
    assert r.path.tolist() == [[0, 1, 4, 4]] and r.out_tokens.tolist() == [[5, 8, 77, -1]]


def test_full_depth():
    r = run([7, 0, 9, 11, 0, 13, 0])
    assert r.accept_length.tolist() == [3] and r.num_out.tolist() == [4]
    assert r.path.tolist() == [[0, 2, 3, 5]] and r.last_node.tolist() == [5]
    assert r.out_tokens.tolist() == [[7, 9, 11, 13]]


def test_batched_hand_trees():
    tree = DraftTree.from_parents(TOKENS.repeat(3, 1), PARENTS.repeat(3, 1), num_depths=3)
    targets = torch.tensor(
        [[0, 1, 2, 3, 4, 5, 6], [7, 50, 9, 42, 0, 0, 0], [7, 0, 9, 11, 0, 13, 0]]
    )
    r = accept_tree(tree, targets)
    assert r.accept_length.tolist() == [0, 2, 3]
    assert r.path.tolist() == [[0, 0, 0, 0], [0, 2, 3, 3], [0, 2, 3, 5]]


def random_tree(rng: random.Random, n: int, V: int) -> tuple[list[int], list[int]]:
    tokens, parents = [rng.randrange(V)], [-1]
    for j in range(1, n):
        if rng.random() < 0.15:
            tokens.append(0)
            parents.append(-1)  # padding slot in the middle: must be ignored
            continue
        p = rng.choice([i for i in range(j) if i == 0 or parents[i] >= 0])
        used = {tokens[i] for i in range(j) if parents[i] == p}
        free = [t for t in range(V) if t not in used]
        if not free:
            tokens.append(0)
            parents.append(-1)
            continue
        tokens.append(rng.choice(free))
        parents.append(p)
    return tokens, parents


def biased_target(
    rng: random.Random, tokens: list[int], parents: list[int], node: int, V: int
) -> int:
    kids = [tokens[i] for i in range(len(tokens)) if parents[i] == node]
    return (
        rng.choice(kids) if kids and rng.random() < 0.7 else rng.randrange(V)
    )  # long walks happen


def check_against_ref(tree: DraftTree, target: torch.Tensor):
    r = accept_tree(tree, target)
    D = tree.depth_bound
    assert r.path.shape == (tree.batch_size, D + 1) and r.out_tokens.shape == (
        tree.batch_size,
        D + 1,
    )
    for i in range(tree.batch_size):
        toks, tgt = tree.tokens[i].tolist(), target[i].tolist()
        path = accept_ref(toks, tree.parents[i].tolist(), tree.valid[i].tolist(), tgt)
        k = len(path) - 1
        assert r.accept_length[i] == k and r.num_out[i] == k + 1 and r.last_node[i] == path[-1]
        assert r.path[i].tolist() == path + [path[-1]] * (D - k)
        assert r.out_tokens[i].tolist() == [toks[j] for j in path[1:]] + [tgt[path[-1]]] + [-1] * (
            D - k
        )


def test_random_hand_trees_vs_reference_walk():
    rng = random.Random(0)
    for _ in range(300):
        b, n, V = rng.randint(1, 4), rng.randint(1, 12), rng.randint(2, 4)
        built = [random_tree(rng, n, V) for _ in range(b)]
        tree = DraftTree.from_parents(
            torch.tensor([t for t, _ in built]), torch.tensor([p for _, p in built])
        )
        target = torch.tensor(
            [[biased_target(rng, t, p, j, V) for j in range(n)] for t, p in built]
        )
        check_against_ref(tree, target)


def test_random_built_trees_vs_reference_walk():
    gen = torch.Generator().manual_seed(0)
    for trial in range(100):
        b, D, V = 3, 1 + trial % 5, 2 + trial % 4
        logits = torch.randn(b, D, V, generator=gen)
        tree = build_tree(
            torch.randint(0, V, (b,), generator=gen), logits, 1 + trial % 17, V, trial % 2 == 0
        )
        target = torch.randint(0, V, tree.tokens.shape, generator=gen)
        check_against_ref(tree, target)
