"""The one-launch tree-build kernel (ddtree/kernels/tree_build) against the PyTorch node selection
(`speculative.tree.select_nodes`): every DraftTree field bit for bit (tokens, parents, depths,
valid, tree_mask, path_probs, chain_probs) on random logits, exact ties (integer and bf16
logits, log-probs of exactly 0), -inf log-probs, depth limits (0 included), shadow-linear on and
off, per-request budget cuts (0 included), K below the budget, the engine's budgets (its ladder
8..64 at D = 15, the top-k cap), budgets that are not powers of two, and batch 1 and many; the
dispatch and its switch; the launch count; and the toy pair's DDTREE decode with the kernel in
the loop (eager and the draft graph's path), every build checked against the reference and the
tokens equal to AR. Without a GPU the kernel runs in Triton's CPU interpreter."""

import random

import pytest
import torch
from triton_utils import DEV, cpu_interpreter_only

pytest.importorskip("triton")

from ddtree import envs  # noqa: E402
from ddtree.engine.config import budget_ladder  # noqa: E402
from ddtree.kernels import tree_build  # noqa: E402
from ddtree.speculative.tree import build_tree  # noqa: E402
from ddtree.tools.studies.op_count import LaunchCounter  # noqa: E402

FIELDS = ("tokens", "parents", "depths", "valid", "tree_mask", "path_probs", "chain_probs")


def kernel(*args):
    return tree_build._triton().select_nodes_triton(*args)


def assert_same(got, ref):
    for f in FIELDS:
        x, y = getattr(got, f), getattr(ref, f)
        assert x.dtype == y.dtype and x.shape == y.shape, f
        if x.is_floating_point():  # bit for bit (-0.0 / +0.0 and NaN payloads included)
            x, y = x.view(torch.int32), y.view(torch.int32)
        assert torch.equal(x, y), f
    assert got.num_depths == ref.num_depths


def both(roots, logits, B, cap, shadow, limits=None, budgets=None):
    ref = build_tree(roots, logits, B, cap, shadow, limits, budgets)
    got = build_tree(roots, logits, B, cap, shadow, limits, budgets, select=kernel)
    assert_same(got, ref)
    return ref


def inputs(seed, b, D, V, kind="randn", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # integer logits: exact ties between siblings, depths and candidates
        logits = torch.randint(-2, 2, (b, D, V), generator=g).float()
    else:
        logits = torch.randn(b, D, V, generator=g) * 2
    if kind == "neg_inf":  # fewer finite tokens than K: -inf log-probs and -inf beam entries
        logits[:, :, : V - 3] = float("-inf")
    roots = torch.randint(0, V, (b,), generator=g)
    limits = torch.randint(0, D + 1, (b,), generator=g)
    return roots.to(DEV), logits.to(dtype).to(DEV), limits.to(DEV), g


CASES = [  # (b, D, V, budget, cap, kind)
    (3, 4, 12, 8, 8, "randn"),
    (1, 3, 9, 13, 4, "randn"),
    (4, 2, 7, 30, 7, "ties"),
    (2, 5, 6, 16, 3, "ties"),
    (3, 4, 10, 8, 8, "neg_inf"),
    (2, 3, 12, 21, 12, "neg_inf"),
    (2, 1, 5, 1, 1, "randn"),
    (1, 6, 3, 5, 2, "ties"),
]


@pytest.mark.parametrize("shadow", [False, True])
@pytest.mark.parametrize("b,D,V,B,cap,kind", CASES)
def test_matches_reference(b, D, V, B, cap, kind, shadow):
    roots, logits, limits, g = inputs(hash((b, D, V, B, cap, kind)) % 2**31, b, D, V, kind)
    budgets = torch.randint(0, B + 1, (b,), generator=g).to(DEV)
    both(roots, logits, B, cap, shadow)
    both(roots, logits, B, cap, shadow, limits, budgets)


@pytest.mark.parametrize("B", [b for b in budget_ladder(64) if b])
def test_engine_ladder_at_the_drafters_depth(B):
    """The engine's budgets (auto's ladder up to the default 64; K = min(cap, B) = B) at D = 15,
    bf16 logits (many exact ties after the top-k), mixed depth limits and budget cuts; B = 64
    at batch 1 (the measured round) and 3."""
    for b in (1, 3) if B == 64 else (3,):
        roots, logits, limits, g = inputs(B + b, b, 15, 512, dtype=torch.bfloat16)
        limits[0] = 15
        budgets = torch.randint(0, B + 1, (b,), generator=g).to(DEV)
        both(roots, logits, B, B, True, limits, budgets)
        both(roots, logits, B, B, False)


@pytest.mark.parametrize("B,cap,D", [(48, 48, 3), (100, 20, 2), (128, 128, 2), (256, 8, 2)])
def test_other_budgets(B, cap, D):
    """--speculative-ddtree-budget / -topk-cap need not be powers of two; 128 and 256 take the
    8-warp launch."""
    roots, logits, limits, g = inputs(B, 2, D, 300)
    budgets = torch.randint(0, B + 1, (2,), generator=g).to(DEV)
    both(roots, logits, B, cap, True, limits, budgets)


def test_the_cases_exercise_each_feature():
    """The comparisons above would miss a kernel that ignored a feature if the feature changed
    nothing on these inputs: each one changes the reference's tree here."""
    roots, logits, limits, g = inputs(5, 3, 4, 12, "ties")
    budgets = torch.tensor([2, 0, 5], device=DEV)
    base = build_tree(roots, logits, 8, 8, False)
    for other in (
        build_tree(roots, logits, 8, 8, True),
        build_tree(roots, logits, 8, 8, False, limits),
        build_tree(roots, logits, 8, 8, False, budgets=budgets),
        build_tree(roots, logits, 8, 3, False),
    ):
        assert not torch.equal(base.tokens, other.tokens) or not torch.equal(
            base.valid, other.valid
        )


def test_random_sweep():
    rng = random.Random(3)
    for trial in range(16):
        b, D, V = rng.randint(1, 4), rng.randint(1, 5), rng.randint(2, 30)
        B, cap = rng.randint(1, 40), rng.randint(1, 40)
        kind = ("randn", "ties", "neg_inf")[trial % 3]
        roots, logits, limits, g = inputs(trial, b, D, V, "randn" if V <= 3 else kind)
        budgets = torch.randint(0, B + 1, (b,), generator=g).to(DEV)
        both(roots, logits, B, cap, trial % 2 == 0, limits, budgets if trial % 4 else None)


@cpu_interpreter_only
def test_dispatch_and_switch(monkeypatch):
    roots, logits, limits, _ = inputs(0, 2, 3, 10)
    ran = []
    real = tree_build._triton().select_nodes_triton
    monkeypatch.setattr(
        tree_build._triton(), "select_nodes_triton", lambda *a: ran.append(1) or real(*a)
    )
    monkeypatch.delenv(envs.REFERENCE.name, raising=False)
    monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, "1")
    ref = build_tree(roots, logits, 8, 8, True, limits)
    assert_same(build_tree(roots, logits, 8, 8, True, limits, select=tree_build.select_nodes), ref)
    assert ran == [1]
    monkeypatch.setenv(envs.REFERENCE.name, "tree_build")  # the switch wins
    assert not tree_build.use_kernel(logits, 8, 3)
    assert_same(build_tree(roots, logits, 8, 8, True, limits, select=tree_build.select_nodes), ref)
    monkeypatch.delenv(envs.REFERENCE.name)
    monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, "0")  # CPU tensors, no interpreter
    assert not tree_build.use_kernel(logits, 8, 3)
    monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, "1")
    assert tree_build.use_kernel(logits, 8, 3)
    # larger trees keep the PyTorch form
    assert tree_build.use_kernel(logits, tree_build.MAX_BUDGET, 15)
    assert not tree_build.use_kernel(logits, tree_build.MAX_BUDGET + 1, 1)
    assert not tree_build.use_kernel(logits, 64, tree_build.MAX_PREFIXES // 64 + 1)
    assert ran == [1]


@cpu_interpreter_only
def test_one_launch_and_no_host_sync(monkeypatch):
    """The build's launches (CPU count: aten ops that do work + Triton launches): ~200 with the
    PyTorch selection at B = 64, D = 15 (17 sorts), a dozen with the kernel, and no read-back."""
    from ddtree.tools.studies.op_count import _triton_launches

    roots, logits, limits, g = inputs(1, 1, 15, 256, dtype=torch.bfloat16)
    budgets = torch.full((1,), 64)
    counts = {}
    for name, select in (("torch", None), ("kernel", kernel)):
        c = LaunchCounter()
        with _triton_launches(c), c:
            build_tree(roots, logits, 64, 64, True, limits, budgets, select=select)
        counts[name] = c.ops["other"]
        assert c.syncs == 0
    assert sum(counts["torch"].values()) > 150 and counts["torch"]["sort"] == 17
    assert counts["kernel"]["triton:_tree_build_kernel"] == 1 and "sort" not in counts["kernel"]
    assert sum(counts["kernel"].values()) <= 15, counts["kernel"]


@cpu_interpreter_only
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "draft_graph"])
def test_engine_ddtree_through_the_kernel(toy_pair, monkeypatch, graphs):
    """The toy pair's greedy DDTREE decode with the kernel building every tree (eager:
    `SpecDecoder._build`; draft_graph: the capture-off draft graph, padded rows included), each
    build checked against the reference, depth limits at max_tokens' edge and a per-request
    budget: the tokens and accept lengths equal the PyTorch build's, and the tokens AR's."""
    from engine_utils import accepted_prompts, make_llm, mean_accept

    from ddtree import SamplingParams
    from ddtree.engine.graphs.runner import attach_uncaptured
    from ddtree.speculative.tree import select_nodes as reference

    prompts = [list(p) for p in accepted_prompts(3)]
    lengths = (24, 9, 16)
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, ddtree_budget=bud)
        for m, bud in zip(lengths, (None, 3, None))
    ]
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    ar = [o.token_ids for o in make_llm(toy_pair).generate(prompts, greedy)]

    def decode():
        llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16, max_running_requests=4)
        if graphs:
            attach_uncaptured(llm.engine, max_bs=4)
        return llm.generate(prompts, params)

    plain = decode()
    builds, launches = [], []
    select, mod = tree_build.select_nodes, tree_build._triton()
    launch = mod.select_nodes_triton

    def checked(*args):
        got, ref = select(*args), reference(*args)
        for name, x, y in zip(ref._fields, got, ref):
            assert torch.equal(x, y), name
        builds.append(args[1].shape[0])
        return got

    monkeypatch.setattr(tree_build, "use_kernel", lambda t, b, d: tree_build.supported(b, d))
    monkeypatch.setattr(tree_build, "select_nodes", checked)
    monkeypatch.setattr(mod, "select_nodes_triton", lambda *a: launches.append(1) or launch(*a))
    outs = decode()
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain] == ar
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in plain]
    assert mean_accept(outs) > 2
    assert builds and len(launches) == len(builds)
    if graphs:
        assert 4 in builds, "the draft graph's padded batch never built a tree"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_logsumexp_in_chunks_is_the_whole_tensor_logsumexp(monkeypatch, dtype):
    """The draft's log Z in chunks of rows (bounded temporaries at any batch) equals the
    whole-tensor logsumexp row for row, and the trees built on it are the same trees."""
    import ddtree.speculative.tree as tree_mod

    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(5, 7, 300, generator=g) * 4).to(dtype)
    whole = logits.float().logsumexp(-1, keepdim=True)
    assert torch.equal(tree_mod.row_logsumexp(logits), whole)  # one chunk: the same call
    monkeypatch.setattr(tree_mod, "LSE_CHUNK_ELEMS", 300 * 4)  # 4 rows a chunk, 9 chunks
    chunked = tree_mod.row_logsumexp(logits)
    assert chunked.shape == (5, 7, 1) and chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)
    roots = torch.arange(5)
    a = tree_mod.build_chain(roots, logits)
    monkeypatch.setattr(tree_mod, "LSE_CHUNK_ELEMS", 1 << 25)
    b = tree_mod.build_chain(roots, logits)
    assert torch.equal(a.tokens, b.tokens)
