"""One-node rounds stepping the GDN state in place (`HybridStatePool.in_place`) through the real
engine on the toy hybrid pair (fp32, CPU): NONE at T=0 gives DFLASH's tokens (its one-token root
goes through the tree verify + stash + commit), under both strategies, batch 1 and 4; no stash row
is ever written and no state commit runs (the verify already left the root's state). On the padded
static graph path (capture off) the verify steps exactly the live rows (+ the scratch row for
padded ones) and the commit writes no state at all. With our Triton kernels in the interpreter (the
GPU's sequence: the in-place conv and the decode kernel) the engine's tokens equal the references'.
A commit that still ran after an in-place verify (the state stepped twice) is caught: a NONE server
stepping in place keeps no stash (and plans none)."""

import pytest
import torch
from engine_utils import GREEDY, make_llm, toy_prompts
from triton_utils import cpu_interpreter_only

from ddtree import SamplingParams, envs
from ddtree.engine.config import MAMBA_STRATEGIES as STRATEGIES  # noqa: E402
from ddtree.engine.graphs.runner import attach_uncaptured
from ddtree.kernels.gdn import backend

PROMPTS = [list(p) for p in toy_prompts(4)]  # lengths 5..20
# ragged: the live batch shrinks 4 -> 1, so graph rounds pad
RAGGED = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 3, 14, 8)]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _generate(pair, strategy, prompts=PROMPTS, params=GREEDY, graphs=False, algorithm="NONE"):
    llm = make_llm(pair, algorithm, mamba_scheduler_strategy=strategy, max_running_requests=4)
    if graphs:
        attach_uncaptured(llm.engine, max_bs=4)
    backend.ran.clear()
    return llm, [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ar_in_place_equals_the_tree_path(toy_hybrid_pair, strategy, batch):
    prompts = PROMPTS[:batch]
    dflash, tree = _generate(toy_hybrid_pair, strategy, prompts, algorithm="DFLASH")
    assert backend.ran[("tree", "reference")]
    llm, on = _generate(toy_hybrid_pair, strategy, prompts)
    assert on == tree and all(len(t) == GREEDY.max_tokens for t in on)
    ran = set(backend.ran)
    assert ("decode_step", "reference") in ran and not any(op == "tree" for op, _ in ran)
    assert not any(op in ("replay", "commit") for op, _ in ran)  # no_buffer's replay: none
    # a NONE server stepping in place keeps no stash at all (it would never be written), and plans
    # none: the memory goes to KV and state rows
    from ddtree.engine.config import GDNGeometry

    pool = llm.engine.runner.state_pool
    assert pool.stash and all(t.shape[2] == 0 for t in pool.stash.values())
    geo = GDNGeometry.from_config(llm.engine.runner.target.config)
    assert pool.stash_bytes == 0 == geo.stash_bytes(1, strategy, "float32", "float32")
    assert dflash.engine.runner.state_pool.stash_bytes > 0  # the tree path's stash
    assert geo.stash_bytes(16, strategy, "float32", "float32") > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_commit_after_the_in_place_verify_is_caught(toy_hybrid_pair, monkeypatch, strategy):
    """Control: a commit told nothing of the verify's width would replay the root from the stash,
    over the state the verify already stepped. A NONE server stepping in place keeps no stash, so
    that commit cannot run at all: every request fails on it (engine/faults.py fails them one by
    one, each with the IndexError)."""
    from ddtree.engine.memory.state_pool import HybridStatePool

    commit = HybridStatePool.commit
    monkeypatch.setattr(
        HybridStatePool, "commit", lambda self, s, p, a, nodes=None: commit(self, s, p, a)
    )
    llm = make_llm(toy_hybrid_pair, "NONE", mamba_scheduler_strategy=strategy)
    outs = llm.generate(PROMPTS, GREEDY)
    assert outs and all(o.error and "IndexError" in o.error for o in outs), outs


def _tensors(pool):
    return [pool.conv, pool.ssm, *pool.stash.values()]


def _changed_rows(before, after) -> set[int]:
    rows = set()
    for x, y in zip(before, after):
        rows |= set((x != y).transpose(0, 1).flatten(1).any(1).nonzero().flatten().tolist())
    return rows


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_graph_path_steps_live_rows_at_verify_and_commits_no_state(
    toy_hybrid_pair, monkeypatch, strategy
):
    _, want = _generate(toy_hybrid_pair, strategy, params=RAGGED)
    llm = make_llm(toy_hybrid_pair, "NONE", mamba_scheduler_strategy=strategy)
    g = attach_uncaptured(llm.engine, max_bs=4)
    pool = llm.engine.runner.state_pool
    gen = torch.Generator().manual_seed(0)
    for t in _tensors(pool):  # non-zero scratch contents, so a padded row's write shows
        t[:, pool.scratch_row] = torch.randn(t[:, pool.scratch_row].shape, generator=gen)
    verify, commit, log = g.verify, g.commit, []

    def watched_verify(meta, tree):
        before = [t.clone() for t in _tensors(pool)]
        out = verify(meta, tree)
        live = set(meta.slots)
        changed = _changed_rows(before, _tensors(pool))
        log.append(("verify", changed - live - {pool.scratch_row}, live <= changed))
        log.append(("padded", len(live) < g.bucket(len(live)), pool.scratch_row in changed))
        return out

    def watched_commit(w, path, k):
        before = [t.clone() for t in _tensors(pool)]
        commit(w, path, k)
        log.append(("commit", _changed_rows(before, _tensors(pool)), True))

    g.verify, g.commit = watched_verify, watched_commit
    got = [o.token_ids for o in llm.generate(PROMPTS, RAGGED)]
    assert got == want
    assert [e for e in log if e[0] != "padded" and (e[1] or not e[2])] == []
    assert sum(e[0] == "commit" for e in log) == sum(e[0] == "verify" for e in log) > 0
    padded = [wrote for kind, was_padded, wrote in log if kind == "padded" and was_padded]
    assert padded and all(padded)  # padded rows stepped the scratch row, and only it


@cpu_interpreter_only
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kernels_in_the_engine_loop(toy_hybrid_pair, monkeypatch, strategy):
    """Every kernel of the GPU's round in the interpreter (graph path, capture off): the in-place
    conv and the decode kernel give the references' tokens."""
    if not envs.TRITON_INTERPRET.on():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py)")
    prompts, params = PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    _, want = _generate(toy_hybrid_pair, strategy, prompts, params, graphs=True)
    monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, "1")
    monkeypatch.delenv(envs.REFERENCE.name, raising=False)
    _, on = _generate(toy_hybrid_pair, strategy, prompts, params, graphs=True)
    assert on == want
    assert backend.ran[("decode_step", "triton")] and backend.ran[("tree_conv", "triton")]
    assert not any(name == "reference" for op, name in backend.ran if op != "prefill")


def test_budget_profile_replays_touch_no_request_row(toy_hybrid_pair, monkeypatch):
    """auto's startup profile replays every width's verify + commit outside any round; the width-1
    verify steps the rows its static buffers hold, so they go back to the padding state first:
    after rounds (AR ones among them) the profile changes no request's row."""
    from test_budget_engine import AUTO, CyclingPolicy

    from ddtree.engine.budget import profile as budget_profile

    llm = make_llm(
        toy_hybrid_pair,
        "DDTREE",
        max_running_requests=4,
        mamba_scheduler_strategy="no_buffer",
        **AUTO,
    )
    planner = llm.engine.decoder.budgets
    planner.policy = CyclingPolicy()
    planner.policy.k = 3  # its all-AR round first: how many rounds come depends on acceptance
    attach_uncaptured(llm.engine, max_bs=4)
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    widths = planner.policy.widths
    assert widths[0] == 1 and max(widths) > 1, widths  # AR, then tree rounds (<= 4 tokens so far)
    pool = llm.engine.runner.state_pool
    before = [t.clone() for t in _tensors(pool)]
    budget_profile.measure(llm.engine.runner, llm.engine.spec, replays=1)
    assert _changed_rows(before, _tensors(pool)) <= {pool.scratch_row}


def test_budget_profile_key_names_the_state_path(toy_hybrid_pair):
    """A cached round-cost table is per strategy (their commits cost differently): a table
    measured on another is never read back."""
    from test_budget_engine import AUTO

    from ddtree.engine.budget import profile as budget_profile

    keys = set()
    for strategy in STRATEGIES:
        llm = make_llm(toy_hybrid_pair, "DDTREE", mamba_scheduler_strategy=strategy, **AUTO)
        attach_uncaptured(llm.engine, max_bs=1)
        keys.add(budget_profile.profile_key(llm.engine.runner, llm.engine.spec))
    assert len(keys) == 2
