"""Batch-wide budgets through the real engine (toy pairs, CPU): rounds that verify only the batch's
R most valuable drafted nodes, packed (`ModelRunner.verify_packed`), are T=0 token-identical to
AR on prompts the toy drafter accepts (mean accepted length > 2): unequal shares within a round,
requests capped at 0 (an AR row) beside deep trees, R from 1 to past every node, eager and on the
padded static graph path (the draft replays; the verify is packed), batch 1 and many, and
sampled, log-prob and grammar requests packed beside greedy ones. The check can fail: a packed verify
whose requests see each other's rows changes the tokens."""

import numpy as np
import pytest
from engine_utils import GREEDY, accepted_prompts, make_llm, mean_accept

from ddtree import SamplingParams
from ddtree.engine.budget.planner import BudgetPlanner, ScriptedPolicy
from ddtree.engine.budget.policy import Decision

AUTO = dict(speculative_ddtree_budget="auto", speculative_ddtree_max_budget=16)
ROWS = (1, 5, 40, 3, 200, 12)  # 200: past every drafted node of the batch
CAPS = (16, 0, 4, 16, 9)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class PackingPolicy(ScriptedPolicy):
    """Every round packed: R cycles through ROWS, each request's cap through CAPS (a 0: its
    root alone beside the others' trees); every fifth round dense (the same engine moves between
    the two)."""

    def __init__(self):
        self.k = 0

    def choose(self, slots, owners, caps, ctx, extra_s=0.0):
        self.k += 1
        n = len(slots)
        b = np.array([CAPS[(self.k + i) % len(CAPS)] for i in range(n)], dtype=np.int64)
        b = np.minimum(b, np.asarray(caps))
        rows = None if self.k % 5 == 0 else ROWS[self.k % len(ROWS)]
        return Decision(1 + int(b.max()), b, np.zeros(n), 0.0, rows=rows)


def generate(pair, prompts, params=GREEDY, graphs=False, **kw):
    llm = make_llm(pair, "DDTREE", max_running_requests=8, **AUTO, **kw)
    llm.engine.set_budget_policy(PackingPolicy())
    runner = llm.engine.runner
    packed = []
    verify_packed = runner.verify_packed
    runner.verify_packed = lambda rnd, tree, keep, n, sub=None: (
        packed.append((int(keep.sum()), n, keep.sum(1).tolist()))
        or verify_packed(rnd, tree, keep, n, sub)
    )
    planner = llm.engine.decoder.budgets
    observe, llm.shares = planner.observe, []  # each packed round's shares, as the policy saw them
    planner.observe = lambda plan, n, emitted, curves=None: (
        (llm.shares.append(list(plan.budgets)) if plan.rows is not None else None)
        or observe(plan, n, emitted, curves)
    )
    llm.packed_replays = []  # (batch, rows) of each packed verify that ran its graph's path
    if graphs:
        from test_cuda_graph import attach_graphs

        g = attach_graphs(llm, 4)
        for w, gs in g.packed_sets.items():
            gs.run = lambda b, host, run=gs.run, w=w: (
                llm.packed_replays.append((b, g.bucket(b) * w)) or run(b, host)
            )
    outs = llm.generate([list(p) for p in prompts], params)
    return outs, packed, llm


@pytest.fixture(scope="module")
def ar_tokens(toy_pair):
    llm = make_llm(toy_pair, "NONE")
    return [o.token_ids for o in llm.generate([list(p) for p in accepted_prompts()], GREEDY)]


@pytest.mark.parametrize("graphs", [False, True])
def test_packed_rounds_are_lossless(toy_pair, ar_tokens, graphs):
    outs, packed, llm = generate(toy_pair, accepted_prompts(), graphs=graphs)
    assert [o.token_ids for o in outs] == ar_tokens and mean_accept(outs) > 2
    assert packed, "no round was packed"
    # the shares read back beside the curves are the verified ones (the root aside)
    assert llm.shares == [[q - 1 for q in qs] for _, _, qs in packed]
    shares = [q for _, _, qs in packed for q in qs]
    assert 1 in shares and max(shares) > 5  # root-only rows beside deep trees in one round
    assert any(kept < n for kept, n, _ in packed)  # R past the drafted nodes: padding rows
    assert any(len(set(qs)) > 2 for _, _, qs in packed)  # unequal shares within a round
    if graphs:  # the packed graphs' path, at more than one batch and row count
        assert len(set(llm.packed_replays)) > 2, llm.packed_replays


def test_packed_rounds_batch_of_one(toy_pair, ar_tokens):
    for i in (0, 3):
        outs, packed, _ = generate(toy_pair, accepted_prompts()[i : i + 1])
        assert [o.token_ids for o in outs] == ar_tokens[i : i + 1] and mean_accept(outs) > 2
        assert packed


def test_packed_check_can_fail(toy_pair, ar_tokens, monkeypatch):
    """Every packed row attending to the whole flat batch's tree mask of request 0 (each request's
    rows reading another's tree) must change the tokens: the comparison above can fail."""
    from ddtree.engine import model_runner

    real = model_runner.pack_layout

    def leaky(tree, keep, lens, n):
        lay = real(tree, keep, lens, n)
        lay.tree.tree_mask = lay.tree.tree_mask[:1].expand_as(lay.tree.tree_mask).clone()
        return lay

    monkeypatch.setattr(model_runner, "pack_layout", leaky)
    outs, packed, _ = generate(toy_pair, accepted_prompts())
    assert packed and [o.token_ids for o in outs] != ar_tokens


def test_sampled_log_prob_and_grammar_rows_pack_beside_greedy_ones(toy_pair):
    """One packed round carries every kind of request: greedy, seeded sampling, log-probs, a
    grammar, a grammar with seeded sampling. Each gets AR's tokens (the seeded ones token for
    token: the sampler's noise is keyed by position, whatever tree the round verified) and AR's
    log-probs; the grammar bites. Those rows get their nodes' logits back from the packed verify,
    the greedy rows only their argmax."""
    from ddtree.grammar import GrammarSpec

    no_zero = GrammarSpec.regex(r"[1-9]*")  # toy tokens are "4".."63": forbids 10, 20, ...
    kw = dict(max_tokens=24, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, **kw),
        SamplingParams(temperature=0.8, seed=3, top_p=0.95, **kw),
        SamplingParams(temperature=0, logprobs=True, top_logprobs=2, **kw),
        SamplingParams(temperature=0, grammar=no_zero, **kw),
        SamplingParams(temperature=1.2, seed=9, grammar=no_zero, **kw),
    ]
    prompts = [list(accepted_prompts(6)[i]) for i in (0, 1, 3, 4, 5)]  # 4, 5: the grammar bites
    ar = make_llm(toy_pair, "NONE").generate(prompts, params)
    free = make_llm(toy_pair, "NONE").generate(prompts[3:4], params[:1])
    assert free[0].token_ids != ar[3].token_ids, "the grammar must bite"
    outs, packed, llm = generate(toy_pair, prompts, params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    assert packed and mean_accept(outs[:1]) > 2
    assert any(len(qs) == len(params) for _, _, qs in packed), "no round packed every kind"
    got, want = outs[2].logprobs, ar[2].logprobs
    assert len(got) == len(want) == 24
    for g, w in zip(got, want):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]


def test_hybrid_targets_never_pack(toy_hybrid_pair):
    llm = make_llm(toy_hybrid_pair, "DDTREE", max_running_requests=4, **AUTO)
    assert not llm.engine.decoder.budgets.packing


def test_planner_packs_where_rows_are_dear():
    """The planner's own rating (BudgetPolicy): at a batch whose rounds cost rows (the rung
    table's seconds grow with the rows), a batch of one confident request and many hopeless ones
    packs: the confident request's deep tree and the others' roots beat any one rung for all; at
    a batch where rows are free the dense tree wins."""
    from ddtree.engine.budget.policy import BudgetPolicy, rung_widths
    from ddtree.engine.config import SpecConfig, budget_ladder
    from ddtree.engine.graphs.packed import packed_extras

    cfg = SpecConfig(algorithm="DDTREE", budget=16, block_size=8, adaptive=True)

    class RowsCost:  # seconds: fixed + per row (rows = bs x width)
        def __init__(self, per_row):
            self.per_row = per_row

        def seconds(self, bs, ctx):
            w = rung_widths(budget_ladder(16), cfg.chain_rung)
            return 0.01 + self.per_row * bs * w

    def planner(per_row, graph_rows=None):
        p = BudgetPlanner(cfg, 64, RowsCost(per_row))
        p.enable_packing(graph_rows)
        pol = p.policy
        assert isinstance(pol, BudgetPolicy)
        return p, pol

    from ddtree.engine.scheduling.request import Req

    reqs = [Req(prompt_ids=[1], params=SamplingParams(temperature=0)) for _ in range(32)]
    for i, r in enumerate(reqs):
        r.slot = i

    def graphs(b):  # the packed graphs' rows at batch 32 (engine/graphs/packed.py)
        return [b + e for e in packed_extras(b, 17)]

    for per_row, packs, rows in ((2e-4, True, None), (0.0, False, None), (2e-4, True, graphs)):
        p, pol = planner(per_row, rows)
        pol._claim(np.arange(32), reqs)
        pol.prior_chain = 1.0
        curve = np.zeros((32, 16))
        curve[0] = np.cumsum(0.97 ** np.arange(1, 17))  # request 0: confident
        curve[1:] = np.cumsum(np.full((31, 16), 0.02), 1)  # the others: hopeless
        pol.curve[:32], pol.n_read[:32] = curve, 16
        pol.chain[:32], pol.chain_known[:32] = curve[:, 6], True  # the chain: 7 of the tree's
        pol.prior_chain = None  # rate each request's own curve
        plan = p.plan(reqs, 64)
        assert (plan.rows is not None) == packs, plan
        if rows is not None:  # graphed: the round fills one packed graph's rows
            assert 32 + plan.rows in rows(32), plan


def test_packed_candidates_fill_the_graphs():
    """Eager, every R from 1 to the drafted nodes (b + R rows); graphed, one R per packed graph
    above the batch, filling its rows with the next nodes, never past the drafted ones."""
    from ddtree.engine.budget.planner import _candidates

    r, rows = _candidates(10, 25, [])
    assert r.tolist() == list(range(1, 26)) and rows.tolist() == list(range(11, 36))
    r, rows = _candidates(10, 25, [10, 20, 30, 50])
    assert rows.tolist() == [20, 30, 50] and r.tolist() == [10, 20, 25]


def test_packed_rounds_correct_their_cost_per_batch_bucket():
    """A packed round that took longer than modelled raises the model's seconds for its batch
    bucket only (clipped: one round that compiled a kernel does not close the bucket), and the
    warm-up's reset forgets it."""
    from ddtree.engine.budget.planner import PACKED_CLIP, RoundRecord
    from ddtree.engine.config import SpecConfig

    cfg = SpecConfig(algorithm="DDTREE", budget=16, block_size=8, adaptive=True)

    class Flat:
        def seconds(self, bs, ctx):
            return np.full(5, 0.01)

    p = BudgetPlanner(cfg, 64, Flat())
    for b, served in ((24, 0.02), (3, 1.0)):
        rec = RoundRecord(9, [1] * b, [], [0] * b, "packed", raw_s=0.01)
        rec.timing.round_s = served
        p.last = rec
        p._catch_up()
    assert p.packed_scale[32] == pytest.approx(1 + 0.2 * (2 - 1))
    assert p.packed_scale[4] == pytest.approx(1 + 0.2 * (PACKED_CLIP - 1))
    assert 8 not in p.packed_scale
    p.reset()
    assert p.packed_scale == {}


def test_a_packed_round_is_priced_between_the_tree_rungs():
    """Linear between the tree rungs' (rows, seconds), along the first segment below the first
    rung (the draft's and the forward's fixed cost stay), never below an AR round; past the last
    rung, the last rung's seconds (np.interp's edge: the policy never asks past b x (1 + B))."""
    from ddtree.engine.budget.planner import _priced

    at, secs = np.array([90.0, 170.0]), np.array([0.020, 0.028])  # 10 requests, B = 8 and 16
    got = _priced(np.array([10.0, 50.0, 90.0, 130.0, 170.0]), at, secs, floor=0.015)
    np.testing.assert_allclose(got, [0.015, 0.016, 0.020, 0.024, 0.028])
