"""CUDA graphs for hybrid (Gated DeltaNet) targets without a GPU: the padded static-buffer path
(`CudaGraphRunner(capture=False)`) runs what a replay runs, minus the capture. On the toy hybrid pair
it gives the eager path's tokens and accept lengths for AR / DFLASH / DDTREE under both commit
strategies, and padded rows never touch a real request's state rows (pool snapshots around every
verify and commit), while they do write the scratch row (so the check can fail)."""

import pytest
import torch
from engine_utils import accepted_prompts, make_llm

from ddtree import SamplingParams
from ddtree.engine.graphs.runner import CudaGraphRunner

# ragged lengths: the live batch shrinks 4 -> 1, so rounds pad 3 -> 4
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 2, 20, 12)]
PROMPTS = [list(p) for p in accepted_prompts(4)]  # the toy drafter accepts these (> 2 a round)
ALGOS = ["NONE", "DFLASH", "DDTREE"]
from ddtree.engine.config import MAMBA_STRATEGIES as STRATEGIES  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _llm(pair, algorithm, strategy):
    return make_llm(
        pair,
        algorithm,
        speculative_ddtree_budget=6,
        max_running_requests=4,
        mamba_scheduler_strategy=strategy,
    )


def _graphs(llm, max_bs=4):
    runner, spec = llm.engine.runner, llm.engine.spec
    runner.graphs = CudaGraphRunner(runner, capture=False, max_bs=max_bs)
    runner.set_tree_spec(spec.algorithm, spec.budget, spec.topk_cap, spec.shadow_linear)
    runner.graphs.build()
    return runner.graphs


def _tensors(pool):
    return [pool.conv, pool.ssm, *pool.stash.values()]


def _changed_rows(before, after) -> set[int]:
    """State-pool rows (dim 1 of every pool tensor) whose contents changed."""
    rows = set()
    for x, y in zip(before, after):
        diff = (x != y).transpose(0, 1).flatten(1).any(1)
        rows |= set(diff.nonzero().flatten().tolist())
    return rows


def _watch(llm, log):
    """Wrap the graph verify / commit: log (rows changed outside the live requests' and the scratch
    row, whether the scratch row changed, the live batch, the padded batch)."""
    runner = llm.engine.runner
    g, pool = runner.graphs, runner.state_pool
    verify, commit = g.verify, g.commit

    def watched(fn, live):
        before = [t.clone() for t in _tensors(pool)]
        out = fn()
        changed = _changed_rows(before, _tensors(pool))
        illegal = changed - set(live) - {pool.scratch_row}
        log.append((illegal, pool.scratch_row in changed, len(live), g.bucket(len(live))))
        return out

    def watched_verify(meta, tree):
        last[:] = meta.slots
        return watched(lambda: verify(meta, tree), meta.slots)

    def watched_commit(w, path, k):
        return watched(lambda: commit(w, path, k), last)

    last: list[int] = []
    g.verify, g.commit = watched_verify, watched_commit
    gen = torch.Generator().manual_seed(0)
    for t in _tensors(pool):  # non-zero scratch contents, so a padded row's write shows
        t[:, pool.scratch_row] = torch.randn(t[:, pool.scratch_row].shape, generator=gen)


def _tokens(outs):
    return [(o.token_ids, o.accept_lengths) for o in outs]


@pytest.fixture(scope="module")
def eager(toy_hybrid_pair):
    return {
        (a, s): _tokens(_llm(toy_hybrid_pair, a, s).generate(PROMPTS, PARAMS))
        for a in ALGOS
        for s in STRATEGIES
    }


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("algorithm", ALGOS)
def test_graph_path_matches_eager_and_padding_stays_in_scratch(
    toy_hybrid_pair, eager, algorithm, strategy
):
    llm = _llm(toy_hybrid_pair, algorithm, strategy)
    g = _graphs(llm)
    assert g.commit_graph is not None  # the state commit replays (AR: its KV commit alone)
    log = []
    _watch(llm, log)
    outs = _tokens(llm.generate(PROMPTS, PARAMS))
    assert outs == eager[(algorithm, strategy)]
    assert log and all(not illegal for illegal, _, _, _ in log), log
    padded = [wrote for _, wrote, b, bs in log if b < bs]
    assert any(padded), "padded rows never wrote the scratch row"
    if algorithm != "NONE":
        rounds = [n for _, acc in outs for n in acc]
        assert sum(rounds) / len(rounds) > 2  # the compared rounds accept drafts


def test_padding_check_catches_a_pad_row_on_a_real_row(toy_hybrid_pair):
    """Control: padded rows pointed at request row 1 (its request, max_tokens 2, finishes first)
    instead of the scratch row are caught."""
    llm = _llm(toy_hybrid_pair, "DDTREE", "extra_buffer")
    g = _graphs(llm)
    v = g.verify_graph
    v.pad_state_row = 1
    v.state_rows.fill_(1)
    log = []
    _watch(llm, log)
    llm.generate(PROMPTS, PARAMS)
    assert any(illegal for illegal, _, b, bs in log if b < bs)


def test_hybrid_targets_are_captured(toy_hybrid_pair, monkeypatch, caplog):
    """The hybrid refusal is gone: make_graph_runner builds graphs for a hybrid target whose
    attention plans a kernel (capture itself stubbed: no GPU here)."""
    from ddtree.engine.graphs import runner as cuda_graph

    llm = _llm(toy_hybrid_pair, "DDTREE", "extra_buffer")
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    built = []
    monkeypatch.setattr(cuda_graph.CudaGraphRunner, "__init__", lambda self, r, capture: None)
    monkeypatch.setattr(cuda_graph.CudaGraphRunner, "build", lambda self: built.append(1))
    monkeypatch.setattr(
        type(runner.backend), "launch_plan", lambda self, shape, dev, num_splits=None: _Plan()
    )
    assert cuda_graph.make_graph_runner(runner) is not None and built


class _Plan:
    kernel, fallback = "triton", None
