"""The tree-build kernel (ddtree/kernels/tree_build) on the device against the PyTorch node
selection at the real drafter's logit shape (vocab 248320, D = 15, bf16): every DraftTree field
bit for bit at B = 64, batch 1 and 8, eagerly and inside a CUDA graph replayed on new logits (as
the draft graph runs it); the engine's other ladder budgets, peaked rows (log-probs of exactly
0: ties across depths) and depth limits / budget cuts. The CPU tests (tests/test_tree_build.py)
run the same comparisons in Triton's interpreter on small shapes."""

import pytest
import torch

pytestmark = pytest.mark.gpu

V, D = 248320, 15
FIELDS = ("tokens", "parents", "depths", "valid", "tree_mask", "path_probs", "chain_probs")


def _inputs(b, seed, peaked=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(b, D, V, generator=gen, device="cuda") * 3
    if peaked:  # one dominant token per depth on half the rows: log-prob 0.0, child ties parent
        logits[: (b + 1) // 2, :, 7] = 200.0
    roots = torch.randint(0, V, (b,), generator=gen, device="cuda")
    limits = torch.randint(1, D + 1, (b,), generator=gen, device="cuda")
    limits[0] = D
    return roots, logits.bfloat16(), limits


def _assert_same(got, ref):
    for f in FIELDS:
        x, y = getattr(got, f), getattr(ref, f)
        assert x.dtype == y.dtype and x.shape == y.shape, f
        if x.is_floating_point():
            x, y = x.view(torch.int32), y.view(torch.int32)
        assert torch.equal(x, y), f


def _builds(roots, logits, B, shadow, limits=None, budgets=None):
    from ddtree.kernels import tree_build
    from ddtree.speculative.tree import build_tree

    assert tree_build.use_kernel(logits, B, D), "the kernel does not take CUDA tensors here"
    ref = build_tree(roots, logits, B, B, shadow, limits, budgets)
    got = build_tree(roots, logits, B, B, shadow, limits, budgets, select=tree_build.select_nodes)
    return got, ref


@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("shadow", [False, True])
def test_b64_matches_reference(b, shadow):
    pytest.importorskip("triton")
    roots, logits, limits = _inputs(b, seed=b, peaked=shadow)
    budgets = (64 - torch.arange(b, device="cuda") * 9) % 65  # 64, 55, ..., 1
    _assert_same(*_builds(roots, logits, 64, shadow))
    _assert_same(*_builds(roots, logits, 64, shadow, limits, budgets))


@pytest.mark.parametrize("B", [8, 16, 32, 128])
def test_other_budgets_match_reference(B):
    pytest.importorskip("triton")
    roots, logits, limits = _inputs(8, seed=B, peaked=True)
    budgets = torch.arange(8, device="cuda") * (B // 4) % (B + 1)
    _assert_same(*_builds(roots, logits, B, True, limits, budgets))


def _capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # the first call compiles: never inside the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("b", [1, 8])
def test_b64_in_a_cuda_graph_replay(b):
    """Captured once on static buffers, replayed on new logits, depth limits and budgets: equal
    to the eager reference of the new inputs (the kernel reads its inputs at replay, allocates
    nothing outside the graph's pool and syncs nothing)."""
    pytest.importorskip("triton")
    from ddtree.kernels import tree_build
    from ddtree.speculative.tree import build_tree

    roots, logits, limits = _inputs(b, seed=10 + b)
    budgets = torch.full((b,), 64, device="cuda")

    def build():
        return build_tree(roots, logits, 64, 64, True, limits, budgets, tree_build.select_nodes)

    graph, out = _capture(build)
    for seed in (20, 21):
        new_roots, new_logits, new_limits = _inputs(b, seed=seed, peaked=seed % 2 == 1)
        roots.copy_(new_roots)
        logits.copy_(new_logits)
        limits.copy_(new_limits)
        budgets.copy_((64 - torch.arange(b, device="cuda") * 7) % 65)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(out, build_tree(roots, logits, 64, 64, True, limits, budgets))
