"""Auto rounds at their rung's own cost (issue 20): a round whose requests all get budget b drafts
with the fixed B=b server's tree spec and verifies at its width (not the cap's build, cut), mixed
budgets build at the round's largest rung, the DFLASH chain is a rung of its own; all T=0
token-identical to AR. On the CPU through the padded graph path (capture off)."""

import numpy as np
import pytest
from engine_utils import GREEDY, make_llm, toy_prompts

from ddtree.engine.budget.planner import ScriptedPolicy
from ddtree.engine.budget.policy import Decision

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = toy_prompts(3)
CAP = 16


class Fixed(ScriptedPolicy):
    """A policy stub: every round the same per-request budgets (or the chain)."""

    def __init__(self, budgets, chain=False):
        self.budgets, self.chain, self.seen = budgets, chain, []

    def choose(self, slots, owners, caps, ctx, extra_s=0.0):
        n = len(slots)
        b = np.asarray((self.budgets * n)[:n], dtype=np.int64)
        return Decision(1 + int(b.max()), b, np.zeros(n), 0.0, self.chain)

    def observe_curves(self, slots, budgets, curves, chain=None, full=None):
        self.seen.append((None if curves is None else curves.shape, np.asarray(chain).shape))

    def observe_accepted(self, pending, accepted):
        pass


def run(pair, algorithm="DDTREE", policy=None, max_tokens=12, **kw):
    """(tokens, [(draft spec, live batch)], [verify widths]) through capture-off graphs."""
    from test_cuda_graph import attach_graphs

    from ddtree import SamplingParams

    llm = make_llm(pair, algorithm, max_running_requests=4, **kw)
    if policy is not None:
        llm.engine.set_budget_policy(policy)
    g = attach_graphs(llm, 4)
    drafts, widths = [], []
    draft_tree, verify = g.draft_tree, g.verify

    def record_draft(rnd, limits, budgets=None, spec=None):
        drafts.append((spec or g.tree_spec, budgets))
        return draft_tree(rnd, limits, budgets, spec)

    g.draft_tree = record_draft
    g.verify = lambda rnd, tree: widths.append(tree.num_nodes) or verify(rnd, tree)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([list(p) for p in PROMPTS], sp)
    return [o.token_ids for o in outs], drafts, widths


@pytest.fixture(scope="module")
def ar(toy_pair):
    llm = make_llm(toy_pair, "NONE")
    sp = GREEDY.__class__(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.token_ids for o in llm.generate([list(p) for p in PROMPTS], sp)]


AUTO = dict(speculative_ddtree_budget="auto", speculative_ddtree_max_budget=CAP)


def test_uniform_round_drafts_and_verifies_as_the_fixed_tree(toy_pair, ar):
    fixed, f_drafts, f_widths = run(toy_pair, speculative_ddtree_budget=8)
    auto, a_drafts, a_widths = run(toy_pair, policy=Fixed([8]), **AUTO)
    assert fixed == auto == ar
    assert {s for s, _ in a_drafts} == {s for s, _ in f_drafts} == {("DDTREE", 8, 8, False)}
    assert all(cut is None for _, cut in a_drafts)  # no per-request cut: the spec's budget
    assert set(a_widths) == set(f_widths) == {9}


def test_uniform_round_accepts_as_the_fixed_server_round_for_round(toy_pair):
    """auto with every round at rung b is the fixed B=b server, round for round: the same accept
    length for every request of every round (so a rung's realised τ in auto's mix differs from
    the fixed server's only by where its rounds fall: studies/rung_mix_tau.py)."""
    from ddtree import SamplingParams

    def lengths(**kw) -> list[tuple[int, ...]]:
        policy = kw.pop("policy", None)
        llm = make_llm(toy_pair, "DDTREE", max_running_requests=3, **kw)
        if policy is not None:
            llm.engine.set_budget_policy(policy)
        eng, out, seen = llm.engine, [], None
        for p in PROMPTS:
            eng.add_request(list(p), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
            rec = eng.last_round
            if rec is not None and rec is not seen:
                seen = rec
                out.append(tuple(rec.accepted))
        return out

    fixed = lengths(speculative_ddtree_budget=8)
    assert fixed == lengths(policy=Fixed([8]), **AUTO)
    assert sum(map(sum, fixed)) > len(fixed)  # drafts really accepted
    assert fixed != lengths(policy=Fixed([4]), **AUTO)  # the check can fail


def test_mixed_budgets_build_at_the_rounds_largest_rung(toy_pair, ar):
    tokens, drafts, widths = run(toy_pair, policy=Fixed([3, 8, 5]), **AUTO)
    assert tokens == ar
    assert {s[1] for s, _ in drafts} == {8} and set(widths) == {9}  # not the cap's 16
    assert any(cut is not None and max(cut) == 8 for _, cut in drafts)
    tokens, drafts, _ = run(toy_pair, policy=Fixed([3, 12]), **AUTO)
    assert tokens == ar and 16 in {s[1] for s, _ in drafts}
    # every round builds at the smallest rung holding its largest budget
    assert all(s[1] == (8 if cut is not None and max(cut) <= 8 else 16) for s, cut in drafts)


def test_chain_rung_drafts_the_dflash_chain(toy_pair, ar):
    llm = make_llm(toy_pair, "DDTREE", **AUTO)
    D = llm.engine.spec.block_size - 1
    assert llm.engine.spec.chain_rung == D and 1 + D in llm.engine.spec.verify_widths
    pol = Fixed([D], chain=True)
    tokens, drafts, widths = run(toy_pair, policy=pol, **AUTO)
    assert tokens == ar
    assert {s for s, _ in drafts} == {("DFLASH", 0, 0, False)} and set(widths) == {1 + D}
    # a chain round reads back the chain's gain only (no tree curve)
    assert pol.seen and all(c is None and ch[0] > 0 for c, ch in pol.seen)


def test_tree_rounds_read_back_the_chain_gain(toy_pair):
    """A tree's top-1 spine is the chain: the policy learns the chain's gain from tree rounds."""
    llm = make_llm(toy_pair, "DDTREE", max_running_requests=4, **AUTO)
    llm.generate([list(p) for p in PROMPTS], GREEDY.__class__(temperature=0, max_tokens=12))
    pol = llm.engine.decoder.budgets.policy
    assert pol.prior_chain is not None and 0 < pol.prior_chain <= llm.engine.spec.block_size - 1
    assert pol.chain_known.any()
