"""The no_buffer tree verify's Triton kernel (ddtree/kernels/gdn/tree_chunk_triton.py: the solve, then
the outputs) against the per-node tree reference and its PyTorch chunk form: random, bushy and chain
trees up to 65 nodes (the kernel's 64-row block + the root), requests with different trees and NaN
padding, GQA, a dk of two chunks, a dv of a partial column tile, pool rows, a strided (narrowed) tree
mask, extra roots, an all-padding request, the stash writes; the raw decay gate gated inside (the
layer's strided in_proj slices); the launch overrides; the dispatch (one path per strategy); and the
hybrid engine (no_buffer DDTREE) token-identical to AR with the kernel in the loop. Without a GPU the
kernel runs in Triton's CPU interpreter."""

import pytest
import torch
from test_gdn_tree_chunk import case, topo_tree
from triton_utils import DEV, cpu_interpreter_only, load_kernel_module, rel

kernel = load_kernel_module("ddtree.kernels.gdn.tree_chunk_triton")

from ddtree import envs  # noqa: E402
from ddtree.kernels.gdn import backend, dispatch  # noqa: E402
from ddtree.kernels.gdn.fused import GateInputs  # noqa: E402
from ddtree.kernels.gdn.reference import gdn_gating, tree_gated_delta_rule  # noqa: E402
from ddtree.kernels.gdn.tree_chunk import tree_ancestor_mask  # noqa: E402
from ddtree.speculative.tree import DraftTree  # noqa: E402

TOL = 1e-5


def run_case(trees, seed, **kw):
    launch = {k: kw.pop(k) for k in ("block_v", "block_k", "num_warps", "solve_warps") if k in kw}
    ins, parents, depths, S0 = case(trees, seed=seed, **kw)
    want, _ = tree_gated_delta_rule(*ins, parents, depths, S0)
    mask = DraftTree.from_parents(torch.zeros_like(parents), parents).tree_mask
    to = [t.to(DEV) for t in (*ins, depths, S0, mask)]
    got = kernel.tree_chunk_triton(*to, **launch).cpu()
    assert torch.isfinite(got).all() and (got[depths < 0] == 0).all()
    assert rel(got, want) < TOL, rel(got, want)


@pytest.mark.parametrize(
    "kind,n",
    [("random", 1), ("bushy", 17), ("chain", 17), ("random", 65), ("bushy", 65), ("chain", 65)],
)
def test_matches_reference(kind, n):
    gen = torch.Generator().manual_seed(n)
    trees = [
        topo_tree(n, kind, gen, max_depth=15),
        topo_tree(max(1, n // 3), kind, gen),
        topo_tree(max(1, n - 1), "random", gen, max_depth=3),
    ]
    # GQA (4 value heads over 2 key heads), dk 32 = two chunks, dv 24 = a full and a partial tile
    run_case(trees, seed=n, Hk=2, Hv=4, dk=32, dv=24)


def test_launch_overrides_same_numbers():
    """Other column tiles, dk chunks and warps (studies/gpu_gdn_tree.py's sweep): the same outputs."""
    gen = torch.Generator().manual_seed(3)
    trees = [topo_tree(33, "bushy", gen, max_depth=15), topo_tree(9, "chain", gen)]
    for launch in (dict(block_v=16, block_k=16, num_warps=2, solve_warps=2), dict(block_v=64)):
        run_case(trees, seed=3, Hk=2, Hv=4, dk=32, dv=24, **launch)


def test_deep_chain_and_branches_off_the_first():
    bushy = ([-1, 0, 0, 2, 3, 1], [0, 1, 1, 2, 3, 2])
    deep = (list(range(-1, 32)), list(range(33)))  # 32 solve rounds
    run_case([bushy, deep], seed=5, Hk=1, Hv=2, dk=16, dv=16)


def _depths(parents):
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def _raw_gate(b, n, Hv, dtype, seed):
    """The layer's raw gate inputs as the engine hands them: a / b strided column slices of one
    [b * n, width] projection output, A_log and dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(b * n, 3 * Hv + 5, generator=gen).to(dtype)
    a, bb = proj[:, 5 : 5 + Hv], proj[:, 5 + 2 * Hv :]
    A_log = torch.empty(Hv).uniform_(0.1, 2.0, generator=gen).log()
    return a, bb, A_log, torch.randn(Hv, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_mask_view_extra_roots_stash_and_raw_gate(dtype):
    """Pool rows, a narrowed mask, a second root, the stash writes; with the raw gate the kernel's
    g / beta (written to the stash) are `gdn_gating`'s to rounding (beta within one ulp of its
    dtype: the CPU interpreter truncates where the GPU rounds to nearest), and its outputs the
    reference's on the gates it used."""
    gen = torch.Generator().manual_seed(11)
    n, N = 20, 33
    trees = [topo_tree(n, "random", gen, max_depth=6), topo_tree(7, "bushy", gen)]
    ins, parents, depths, S0 = case(trees, seed=11)
    parents[0, 9] = -1  # a second root in request 0: node 9's subtree continues from S0
    depths[0] = torch.tensor(_depths(parents[0].tolist()))
    q, k, v = ins[:3]
    raw = _raw_gate(2, n, S0.shape[1], dtype, seed=12)
    g, beta = (t.view(2, n, -1) for t in gdn_gating(*raw))
    valid = depths >= 0
    big = torch.zeros(2, N, N, dtype=torch.bool)  # a wider round's mask, narrowed: row stride N
    big[:, :n, :n] = tree_ancestor_mask(parents, valid)
    pool = torch.randn(5, *S0.shape[1:])
    rows = torch.tensor([3, 0])
    pool[rows] = S0
    node_g = torch.zeros(5, N, S0.shape[1])
    node_beta = torch.zeros(5, N, S0.shape[1], dtype=dtype)
    stash = (node_g, node_beta, rows)
    beta_tol = 1e-6 if dtype == torch.float32 else 2**-7
    for gated in (False, True):
        args = (q, k, v, None, None) if gated else (q, k, v, g, beta.float())
        got = kernel.tree_chunk_triton(
            *args,
            depths,
            pool,
            big[:, :n, :n],
            valid,
            rows,
            stash=stash,
            gate=raw if gated else None,
        )
        used_g, used_beta = node_g[rows, :n], node_beta[rows, :n].float()
        m = valid
        assert rel(used_g[m], g[m]) < 1e-6
        assert ((used_beta[m] - beta[m].float()).abs() <= beta_tol * beta[m].float()).all()
        assert (node_g[[1, 2, 4]] == 0).all()  # rows no request owns are untouched
        want, _ = tree_gated_delta_rule(
            q, k, v, torch.where(m[..., None], used_g, 0), used_beta, parents, depths, S0
        )
        assert rel(got, want) < TOL, (gated, rel(got, want))
        node_g.zero_()
        node_beta.zero_()


def test_all_padding_request_outputs_zeros():
    trees = [([-1, 0, 1], [0, 1, 2]), ([-1], [0])]
    ins, parents, depths, S0 = case(trees, seed=2)
    depths[1] = -1
    for t in ins:
        t[1] = float("nan")
    mask = tree_ancestor_mask(parents, depths >= 0)
    got = kernel.tree_chunk_triton(*ins, depths, S0, mask)
    want, _ = tree_gated_delta_rule(*ins, parents, depths, S0)
    assert (got[1] == 0).all() and rel(got[0], want[0]) < TOL


def test_refuses_what_it_cannot_run():
    ins, parents, depths, S0 = case([topo_tree(66, "chain", torch.Generator())], seed=0)
    mask = tree_ancestor_mask(parents, depths >= 0)
    with pytest.raises(ValueError, match="at most 65"):
        kernel.tree_chunk_triton(*ins, depths, S0, mask)
    with pytest.raises(ValueError, match="precision"):
        kernel.tree_chunk_triton(*(t[:, :3] for t in ins), depths[:, :3], S0, mask, precision="x")


@cpu_interpreter_only
def test_dispatch_one_path_per_strategy(monkeypatch):
    """no_buffer (no node states) takes the chunk kernel up to 65 nodes and gates inside it; node
    states (extra_buffer) or a longer tree take the Triton recurrence; without our kernels (or under
    DDTREE_REFERENCE=gdn) the reference."""
    monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, "1")
    monkeypatch.delenv(envs.REFERENCE.name, raising=False)
    trees = [([-1, 0, 0, 1], [0, 1, 1, 2]), ([-1, 0], [0, 1])]
    ins, parents, depths, S0 = case(trees, seed=3)
    q, k, v = ins[:3]
    raw = _raw_gate(2, 4, S0.shape[1], torch.float32, seed=4)
    g, beta = (t.view(2, 4, -1) for t in gdn_gating(*raw))
    ref, _ = tree_gated_delta_rule(q, k, v, g, beta, parents, depths, S0)
    gate = GateInputs(*raw)
    for kw, want in (
        (dict(gate=gate), "chunk"),
        (dict(gate=gate, return_node_states=True), "triton"),
    ):
        backend.ran.clear()
        o, _ = dispatch.tree_rule(q, k, v, None, None, parents, depths, S0, max_depth=2, **kw)
        assert rel(o, ref) < 1e-4 and backend.ran == {("tree", want): 1}, (kw, backend.ran)
    big = case([topo_tree(70, "random", torch.Generator())], seed=4)
    backend.ran.clear()
    dispatch.tree_rule(*big[0], big[1], big[2], big[3])
    assert backend.ran == {("tree", "triton"): 1}
    monkeypatch.setenv(envs.REFERENCE.name, "gdn")
    backend.ran.clear()
    o, _ = dispatch.tree_rule(q, k, v, None, None, parents, depths, S0, gate=gate)
    assert rel(o, ref) < 1e-5 and backend.ran == {("tree", "reference"): 1}


@cpu_interpreter_only
@pytest.mark.usefixtures("one_torch_thread")
def test_hybrid_no_buffer_lossless_with_kernel(toy_hybrid_pair, monkeypatch):
    """Only the chunk kernel in the interpreter (the rest on the references: seconds, not tens)."""
    from engine_utils import accepted_prompts, mean_accept, run

    from ddtree import SamplingParams

    prompts = accepted_prompts(1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ar = [o.token_ids for o in run(toy_hybrid_pair, prompts, params)]
    monkeypatch.delenv(envs.REFERENCE.name, raising=False)
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
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
    assert backend.ran[("tree", "chunk")] > 0 and not backend.ran[("tree", "reference")]


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
    monkeypatch.delenv(envs.REFERENCE.name, raising=False)
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
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
