"""The packed (ragged) verify of a batch-wide budget (`ModelRunner.verify_packed`): the target
forward over only the kept nodes (request i's q_len = 1 + cut[i], the compact tree's padded mask,
flat slot mapping, padding rows on a scratch slot) gives the dense [b, W] verify's logits at those
nodes, in fp32, for the torch reference and the Triton kernel (Triton's interpreter on the CPU,
given only the lengths' bounds on the host)."""

from __future__ import annotations

import pytest
import torch

from ddtree.attention.backend import get_backend
from ddtree.bench.random_pair import SMOKE, build_pair, pair_configs
from ddtree.engine.graphs import packed as packed_graphs
from ddtree.engine.model_runner import ModelRunner, RunnerConfig
from ddtree.engine.scheduling.request import Req, SamplingParams
from ddtree.speculative.accept import accept_tree
from ddtree.speculative.batch_budget import allocate
from ddtree.speculative.tree import build_tree

PAGE, DEPTHS, BUDGET = 4, 4, 10
CONTEXTS = (5, 12, 3, 9)


@pytest.fixture(scope="module")
def runner_and_reqs():
    tcfg, dcfg = pair_configs(SMOKE, 1, DEPTHS + 1, "float32")
    target, _ = build_pair(tcfg, dcfg, "cpu", torch.float32, seed=3)
    cfg = RunnerConfig(
        page_size=PAGE,
        num_pages=64,
        max_running_requests=len(CONTEXTS) + 1,
        max_context=64,
        block_size=DEPTHS + 1,
        max_verify_width=BUDGET + 1,
    )
    runner = ModelRunner(target, None, cfg, "cpu", torch.float32)
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0, ignore_eos=True)
    reqs = [
        Req(prompt_ids=torch.randint(0, 500, (n,), generator=g).tolist(), params=params)
        for n in CONTEXTS
    ]
    runner.prefill(reqs, list(CONTEXTS))
    for r in reqs:
        r.output_ids.append(int(torch.randint(0, 500, (1,), generator=g)))
        runner.bm.allocate(r, r.kv_len + BUDGET + 1)  # the dense verify's pages
    scratch = Req(prompt_ids=[1], params=params)  # padding rows write its page, read by no one
    runner.bm.allocate(scratch, 1)
    return runner, reqs, scratch


def _tree(b: int):
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(b, DEPTHS, 500, generator=g) * 3
    # a confident top token per depth: deep chain nodes outrank the depth-1 runners-up, so the
    # kept nodes are no prefix of the node order (the compact mask and rows are exercised)
    logits.scatter_add_(
        2, torch.randint(0, 500, (b, DEPTHS, 1), generator=g), torch.full((b, DEPTHS, 1), 9.0)
    )
    roots = torch.randint(0, 500, (b,), generator=g)
    return build_tree(roots, logits, BUDGET, 3, False, node_scores=True)


def _logits(runner, ids, positions, meta, backend):
    with torch.inference_mode():
        hidden, _ = runner.target_forward(ids, positions, meta, backend=backend)
        return runner.target.logits(hidden).float()


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
@pytest.mark.parametrize("pad", [0, 3])
def test_runner_verify_packed_equals_dense(runner_and_reqs, backend_name, pad, monkeypatch):
    """`ModelRunner.verify_packed` (what a batch-wide budget's round runs: the Triton kernel given
    only the lengths' bounds on the host, the torch reference the exact host lengths) against the
    runner's dense verify: the same logits and greedy tokens at every kept node, the taps at the
    kept nodes' flat rows, padding rows on the scratch slot."""
    if backend_name == "triton":
        pytest.importorskip("triton")
    runner, reqs, _ = runner_and_reqs
    monkeypatch.setattr(runner, "backend", get_backend(backend_name))
    # the Triton kernel (its interpreter here) is given only the lengths' bounds
    exact = runner.backend.reads_host_q_lens(runner.target.config.head_dim, runner.device)
    assert exact == (backend_name == "torch")
    b = len(reqs)
    tree = _tree(b)
    dense = runner.verify(runner.begin(reqs), tree)
    # unequal cuts in one round: a deep tree, an AR row (cap 0), a short one
    total = 9
    alloc = allocate(tree, torch.tensor([BUDGET, 0, 2, BUDGET]), total)
    assert alloc.cut[1] == 0 and int(alloc.cut.sum()) == total
    assert not (alloc.keep.int().diff(dim=1) <= 0).all(), "some request's kept nodes skip a node"
    rnd = runner.begin(reqs)
    every = torch.arange(b)
    pv = runner.verify_packed(rnd, tree, alloc.keep, b + total + pad, every)
    rnd2 = runner.begin(reqs)  # a packed round of greedy rows: the LM head in chunks, tokens only
    monkeypatch.setattr(packed_graphs, "LOGIT_CHUNK_ELEMS", 5 * pv.logits.shape[-1])  # 5 rows
    chunked = runner.verify_packed(rnd2, tree, alloc.keep, b + total + pad)
    assert chunked.logits is None and chunked.greedy_tokens.equal(pv.greedy_tokens)
    rnd3 = runner.begin(reqs)  # the logits of some requests only (those that sample, say)
    some = torch.tensor([2, 0])
    part = runner.verify_packed(rnd3, tree, alloc.keep, b + total + pad, some)
    assert part.greedy_tokens.equal(pv.greedy_tokens)
    # the LM head over fewer rows: equal up to the GEMM's row blocking, as elsewhere here
    torch.testing.assert_close(part.logits, pv.logits.index_select(0, some), rtol=1e-5, atol=1e-5)
    lay = rnd.packed
    assert lay is not None and pv.logits.shape[:2] == lay.local_node.shape
    got = pv.logits  # [b, W, V] fp32 in each request's local order
    assert got.dtype == torch.float32
    for i, q in enumerate(lay.q_lens.tolist()):
        kept = lay.local_node[i, :q]
        torch.testing.assert_close(got[i, :q], dense.logits[i, kept], rtol=1e-5, atol=1e-5)
        assert pv.greedy_tokens[i, :q].tolist() == dense.logits[i, kept].argmax(-1).tolist()
    # the accept walk on the compact tree takes the dense walk's path
    res = accept_tree(lay.tree, pv.greedy_tokens)
    full = accept_tree(tree, dense.logits.argmax(-1))
    for i in range(b):
        path = lay.local_node[i].gather(0, res.path[i, : int(res.accept_length[i]) + 1])
        assert path.tolist() == full.path[i, : len(path)].tolist()


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_packed_graph_path_equals_eager(runner_and_reqs, backend_name, monkeypatch):
    """The packed verify's graph family (engine/graphs/packed.py) on its static path, uncaptured
    (the CPU test of everything but the capture), against the eager packed verify: the same
    greedy tokens and the same logits for the requests asked (the taps: the engine tests, with a
    drafter: tests/test_batch_budget_engine.py), the rows
    padded up to the graph's bs x w (the padding rows own no request); a smaller round after a
    larger one returns the larger one's requests and rows to the padding state."""
    if backend_name == "triton":
        pytest.importorskip("triton")
    from ddtree.engine.graphs.runner import CudaGraphRunner

    runner, reqs, _ = runner_and_reqs
    monkeypatch.setattr(runner, "backend", get_backend(backend_name))
    graphs = CudaGraphRunner(runner, capture=False)
    graphs.enable_packing()
    graphs.build()
    assert graphs.packed is not None
    # at batch 4 (4 + E rows): 8, 16, 32 drafted rows, then every node of 4 trees of width 11
    assert graphs.packed_rows(3) == [12, 20, 36, 44] and graphs.packed_rows(4) == [12, 20, 36, 44]
    # the second round: 3 requests in the batch-4 graph (a padding request owning no rows)
    for part, total, caps in ((reqs, 9, [BUDGET, 0, 2, BUDGET]), (reqs[:3], 4, [3, BUDGET, 0])):
        b = len(part)
        tree = _tree(b)
        alloc = allocate(tree, torch.tensor(caps), total)
        sub = torch.tensor([b - 1, 0])
        monkeypatch.setattr(runner, "graphs", None)
        rnd = runner.begin(part)
        eager = runner.verify_packed(rnd, tree, alloc.keep, b + total, sub)
        monkeypatch.setattr(runner, "graphs", graphs)
        rnd_g = runner.begin(part)
        assert rnd_g.graphed and not rnd.graphed
        replay = runner.verify_packed(rnd_g, tree, alloc.keep, b + total, sub)
        rows = rnd_g.packed.input_ids.shape[0]
        assert rows in graphs.packed_rows(b) and rows > b + total  # the graph's, padded
        assert replay.greedy_tokens.equal(eager.greedy_tokens)
        torch.testing.assert_close(replay.logits, eager.logits, rtol=1e-5, atol=1e-5)
        assert replay.taps is None and eager.taps is None  # no drafter here: the engine tests'
        ptr = graphs.packed.indptr
        assert ptr[b:].eq(int(alloc.keep.sum())).all()  # padding requests own no rows (q_len 0)
    assert graphs.packed.live == 3 and graphs.packed.kv_lens[3:].eq(0).all()
    assert graphs.packed.slots[graphs.packed.live_rows :].equal(
        graphs.packed.pad_slots[graphs.packed.live_rows :]
    )
