"""The chunk-form tree rule as one Triton launch (ddtree/kernels/gdn/tree_chunk_triton.py) against
the per-node tree reference and its PyTorch chunk form: random, bushy and chain trees up to 65 nodes
(the kernel's 64-row block + the root), requests with different trees and NaN padding, GQA, a dk
of two chunks, a dv of a partial column tile, pool rows, a strided (narrowed) tree mask, extra
roots, an all-padding request, the stash writes; the dispatch switch; and the hybrid engine
(no_buffer DDTREE) token-identical to AR with the kernel in the loop. Without a GPU the kernel
runs in Triton's CPU interpreter."""

import pytest
import torch
from test_gdn_tree_chunk import case, topo_tree
from triton_utils import DEV, cpu_interpreter_only, load_kernel_module, rel

kernel = load_kernel_module("ddtree.kernels.gdn.tree_chunk_triton")
split = load_kernel_module("ddtree.kernels.gdn.tree_chunk_split_triton")

from ddtree import envs  # noqa: E402
from ddtree.kernels.gdn import backend, dispatch  # noqa: E402
from ddtree.kernels.gdn.reference import tree_gated_delta_rule  # noqa: E402
from ddtree.kernels.gdn.tree_chunk import tree_ancestor_mask  # noqa: E402
from ddtree.speculative.tree import DraftTree  # noqa: E402

TOL = 1e-5
# both forms of the kernel: one launch, and the solve + outputs split (tree_chunk_split_triton)
FORMS = pytest.mark.parametrize(
    "form", [kernel.tree_chunk_triton, split.tree_chunk_split_triton], ids=["one", "split"]
)


def run_case(form, trees, seed, **kw):
    ins, parents, depths, S0 = case(trees, seed=seed, **kw)
    want, _ = tree_gated_delta_rule(*ins, parents, depths, S0)
    mask = DraftTree.from_parents(torch.zeros_like(parents), parents).tree_mask
    to = [t.to(DEV) for t in (*ins, depths, S0, mask)]
    got = form(*to).cpu()
    assert torch.isfinite(got).all() and (got[depths < 0] == 0).all()
    assert rel(got, want) < TOL, rel(got, want)


@pytest.mark.parametrize(
    "kind,n",
    [("random", 1), ("bushy", 17), ("chain", 17), ("random", 65), ("bushy", 65), ("chain", 65)],
)
@FORMS
def test_matches_reference(form, kind, n):
    gen = torch.Generator().manual_seed(n)
    trees = [
        topo_tree(n, kind, gen, max_depth=15),
        topo_tree(max(1, n // 3), kind, gen),
        topo_tree(max(1, n - 1), "random", gen, max_depth=3),
    ]
    # GQA (4 value heads over 2 key heads), dk 32 = two chunks, dv 24 = a full and a partial tile
    run_case(form, trees, seed=n, Hk=2, Hv=4, dk=32, dv=24)


@FORMS
def test_deep_chain_and_branches_off_the_first(form):
    bushy = ([-1, 0, 0, 2, 3, 1], [0, 1, 1, 2, 3, 2])
    deep = (list(range(-1, 32)), list(range(33)))  # 32 solve rounds
    run_case(form, [bushy, deep], seed=5, Hk=1, Hv=2, dk=16, dv=16)


@FORMS
def test_rows_mask_view_extra_roots_and_stash(form):
    gen = torch.Generator().manual_seed(11)
    n, N = 20, 33
    trees = [topo_tree(n, "random", gen, max_depth=6), topo_tree(7, "bushy", gen)]
    ins, parents, depths, S0 = case(trees, seed=11)
    parents[0, 9] = -1  # a second root in request 0: node 9's subtree continues from S0
    depths[0] = torch.tensor(_depths(parents[0].tolist()))
    want, _ = tree_gated_delta_rule(*ins, parents, depths, S0)
    valid = depths >= 0
    big = torch.zeros(2, N, N, dtype=torch.bool)  # a wider round's mask, narrowed: row stride N
    big[:, :n, :n] = tree_ancestor_mask(parents, valid)
    pool = torch.randn(5, *S0.shape[1:])
    rows = torch.tensor([3, 0])
    pool[rows] = S0
    node_g = torch.zeros(5, N, S0.shape[1])
    node_beta = torch.zeros(5, N, S0.shape[1])
    got = form(*ins, depths, pool, big[:, :n, :n], valid, rows, stash=(node_g, node_beta, rows))
    assert rel(got, want) < TOL, rel(got, want)
    g, beta = ins[3], ins[4]
    for i, r in enumerate(rows.tolist()):
        m = valid[i]
        assert torch.equal(node_g[r, :n][m], g[i][m]) and torch.equal(
            node_beta[r, :n][m], beta[i][m]
        )
    assert (node_g[[1, 2, 4]] == 0).all()  # rows no request owns are untouched


def _depths(parents):
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


@FORMS
def test_all_padding_request_outputs_zeros(form):
    trees = [([-1, 0, 1], [0, 1, 2]), ([-1], [0])]
    ins, parents, depths, S0 = case(trees, seed=2)
    depths[1] = -1
    for t in ins:
        t[1] = float("nan")
    mask = tree_ancestor_mask(parents, depths >= 0)
    got = form(*ins, depths, S0, mask)
    want, _ = tree_gated_delta_rule(*ins, parents, depths, S0)
    assert (got[1] == 0).all() and rel(got[0], want[0]) < TOL


@FORMS
def test_refuses_what_it_cannot_run(form):
    ins, parents, depths, S0 = case([topo_tree(66, "chain", torch.Generator())], seed=0)
    mask = tree_ancestor_mask(parents, depths >= 0)
    with pytest.raises(ValueError, match="at most 65"):
        form(*ins, depths, S0, mask)
    with pytest.raises(ValueError, match="precision"):
        form(*(t[:, :3] for t in ins), depths[:, :3], S0, mask, precision="x")


def _refuse(*a, **kw):
    raise AssertionError("the other form ran")


@cpu_interpreter_only
def test_dispatch_modes(monkeypatch):
    monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, "1")
    monkeypatch.delenv(backend.FORCE_ENV, raising=False)
    trees = [([-1, 0, 0, 1], [0, 1, 1, 2]), ([-1, 0], [0, 1])]
    ins, parents, depths, S0 = case(trees, seed=3)
    ref, _ = tree_gated_delta_rule(*ins, parents, depths, S0)
    for mode, want in (("1", "chunk"), ("torch", "chunk_torch"), ("0", "triton")):
        monkeypatch.setenv(backend.TREE_CHUNK_ENV, mode)
        backend.ran.clear()
        o, _ = dispatch.tree_rule(*ins, parents, depths, S0, max_depth=2)
        assert rel(o, ref) < 1e-4 and backend.ran == {("tree", want): 1}, (mode, backend.ran)
    monkeypatch.setenv(backend.TREE_CHUNK_ENV, "1")  # past the kernel's block: the PyTorch form
    big = case([topo_tree(70, "random", torch.Generator())], seed=4)
    backend.ran.clear()
    dispatch.tree_rule(*big[0], big[1], big[2], big[3])
    assert backend.ran == {("tree", "chunk_torch"): 1}
    # the launch switches act (same numbers) and bad values fail naming the variable
    monkeypatch.setenv(envs.GDN_TREE_CHUNK_BV.name, "16")
    monkeypatch.setenv(envs.GDN_TREE_CHUNK_PRECISION.name, "ieee")
    assert backend.tree_chunk_options() == dict(block_v=16, precision="ieee")
    o, _ = dispatch.tree_rule(*ins, parents, depths, S0)
    assert rel(o, ref) < 1e-4
    # the form switch picks the launches: each form's own call ran (the other raises if called)
    for form, other in (("one", split), ("split", kernel)):
        name = "tree_chunk_split_triton" if other is split else "tree_chunk_triton"
        monkeypatch.setenv(envs.GDN_TREE_CHUNK_FORM.name, form)
        monkeypatch.setattr(other, name, _refuse)
        o, _ = dispatch.tree_rule(*ins, parents, depths, S0)
        assert rel(o, ref) < 1e-4, form
        monkeypatch.undo()  # back to the mode / switches above
        monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, "1")
        monkeypatch.delenv(backend.FORCE_ENV, raising=False)
        monkeypatch.setenv(backend.TREE_CHUNK_ENV, "1")
    for var, bad in (
        (envs.GDN_TREE_CHUNK_FORM.name, "two"),
        (envs.GDN_TREE_CHUNK_BV.name, "48"),
        (envs.GDN_TREE_CHUNK_PRECISION.name, "fp16"),
        (backend.TREE_CHUNK_ENV, "yes"),
    ):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            backend.check_switches()
        monkeypatch.delenv(var)


@cpu_interpreter_only
@pytest.mark.usefixtures("one_torch_thread")
def test_hybrid_no_buffer_lossless_with_kernel(toy_hybrid_pair, monkeypatch):
    """Only the chunk kernel in the interpreter (the rest on the references: seconds, not tens)."""
    from engine_utils import accepted_prompts, mean_accept, run

    from ddtree import SamplingParams

    prompts = accepted_prompts(1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ar = [o.token_ids for o in run(toy_hybrid_pair, prompts, params)]
    monkeypatch.setenv(backend.TREE_CHUNK_ENV, "1")
    monkeypatch.delenv(backend.FORCE_ENV, raising=False)
    monkeypatch.setattr(dispatch, "tree_chunk_kernel", lambda t, n: kernel.supported(n))
    backend.ran.clear()
    outs = run(
        toy_hybrid_pair,
        prompts,
        params,
        algorithm="DDTREE",
        mamba_scheduler_strategy="no_buffer",
        speculative_ddtree_budget=16,
    )
    assert [o.token_ids for o in outs] == ar and mean_accept(outs) > 2
    assert backend.ran[("tree", "chunk")] > 0 and not backend.ran[("tree", "chunk_torch")]


@cpu_interpreter_only
@pytest.mark.usefixtures("one_torch_thread")
def test_graph_path_with_kernel_matches_eager_and_padding_stays_in_scratch(
    toy_hybrid_pair, monkeypatch
):
    """The CUDA-graph path (capture off) of a no_buffer DDTREE round with the kernel: the eager
    path's tokens, and the padded rows' in-kernel stash writes reach only the scratch row."""
    from test_hybrid_graphs import PROMPTS as prompts  # 4 ragged: the live batch shrinks 4 -> 1
    from test_hybrid_graphs import _graphs, _llm, _tokens, _watch

    from ddtree import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (10, 2, 8, 6)]
    monkeypatch.setenv(backend.TREE_CHUNK_ENV, "1")
    monkeypatch.delenv(backend.FORCE_ENV, raising=False)
    monkeypatch.setattr(dispatch, "tree_chunk_kernel", lambda t, n: kernel.supported(n))
    eager = _tokens(_llm(toy_hybrid_pair, "DDTREE", "no_buffer").generate(prompts, params))
    llm = _llm(toy_hybrid_pair, "DDTREE", "no_buffer")
    _graphs(llm)
    log = []
    _watch(llm, log)
    backend.ran.clear()
    outs = _tokens(llm.generate(prompts, params))
    rounds = [n for _, acc in outs for n in acc]
    assert outs == eager and sum(rounds) / len(rounds) > 2 and backend.ran[("tree", "chunk")] > 0
    assert log and all(not illegal for illegal, _, _, _ in log), log
    assert any(wrote for _, wrote, b, bs in log if b < bs), log
