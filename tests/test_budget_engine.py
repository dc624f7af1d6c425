"""Load-aware budgets through the real engine (toy pairs, CPU): T=0 token-identical to AR (on
prompts the toy drafters accept, mean accepted length > 2) with the policy on and with budgets
that change every round and per request (a cycling policy stub, widths 1 = AR .. the cap), eager
and on the padded static graph path, dense and hybrid, batch 1 and many; T>0 keeps the target's
distribution."""

import numpy as np
import pytest
from engine_utils import GREEDY, accepted_prompts, make_llm, mean_accept
from test_engine_sampling import first_tokens, same_distribution

from ddtree.engine.budget.planner import ScriptedPolicy
from ddtree.engine.budget.policy import Decision

AUTO = dict(speculative_ddtree_budget="auto", speculative_ddtree_max_budget=16)
CYCLE = (0, 16, 3, 8, 1, 0, 5, 16, 2)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class CyclingPolicy(ScriptedPolicy):
    """Budgets that change every round and differ between requests; every fourth round is all-AR."""

    def __init__(self):
        self.k, self.widths = 0, []

    def choose(self, slots, owners, caps, ctx, extra_s=0.0):
        self.k += 1
        n = len(slots)
        if self.k % 4 == 0:
            b = np.zeros(n, dtype=np.int64)
        else:
            b = np.array([CYCLE[(self.k + 3 * i) % len(CYCLE)] for i in range(n)], dtype=np.int64)
        b = np.minimum(b, np.asarray(caps))
        self.widths.append(1 + int(b.max()))
        return Decision(1 + int(b.max()), b, np.zeros(n), 0.0)

    def observe_accepted(self, pending, accepted):
        pass

    def observe_curves(self, slots, budgets, curves, chain=None, full=None):
        assert curves.shape == (len(slots), 16) and (np.diff(curves, axis=1) >= -1e-6).all()
        assert full is None or (len(full) == len(slots) and not all(full))  # depth-limited rows


def generate(pair, prompts, params=GREEDY, stub=True, graphs=False, **kw):
    llm = make_llm(pair, "DDTREE", max_running_requests=8, **AUTO, **kw)
    planner = llm.engine.decoder.budgets
    if stub:
        llm.engine.set_budget_policy(CyclingPolicy())
    if graphs:
        from test_cuda_graph import attach_graphs

        attach_graphs(llm, 4)
    outs = llm.generate([list(p) for p in prompts], params)
    return outs, planner


def tokens_of(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def ar_tokens(toy_pair):
    llm = make_llm(toy_pair, "NONE")
    return [o.token_ids for o in llm.generate([list(p) for p in accepted_prompts()], GREEDY)]


@pytest.mark.parametrize("graphs", [False, True])
def test_changing_budgets_are_lossless(toy_pair, ar_tokens, graphs):
    outs, planner = generate(toy_pair, accepted_prompts(), graphs=graphs)
    # every fourth round is AR and budgets drop to 0-3 in between: still > 2 tokens a round
    assert tokens_of(outs) == ar_tokens and mean_accept(outs) > 2
    assert {1, 4, 9, 17} <= set(planner.policy.widths)  # AR rounds and every other width ran


def test_changing_budgets_batch_of_one(toy_pair, ar_tokens):
    for i in (0, 3):
        outs, _ = generate(toy_pair, accepted_prompts()[i : i + 1])
        assert tokens_of(outs) == ar_tokens[i : i + 1] and mean_accept(outs) > 2


def test_changing_budgets_check_can_fail(toy_pair, ar_tokens, monkeypatch):
    """A narrowed tree whose nodes no longer see their ancestors (identity mask) must change the
    tokens under the same schedule: the comparison above can fail."""
    import torch

    from ddtree.speculative.tree import DraftTree

    narrow = DraftTree.narrow

    def blind(self, n):
        t = narrow(self, n)
        eye = torch.eye(n, dtype=torch.bool).expand_as(t.tree_mask)
        return DraftTree(t.tokens, t.parents, t.depths, t.valid, eye, t.num_depths, t.path_probs)

    monkeypatch.setattr(DraftTree, "narrow", blind)
    # the accept walk reads the ancestors from the mask too: keep it on the true tree (the parents),
    # so only the verify's attention is blind
    from ddtree.engine.graphs import buffers as graph_buffers
    from ddtree.engine.round import decoder
    from ddtree.speculative import accept

    def by_parents(tree, target):
        return accept.accept_tree(
            DraftTree.from_parents(tree.tokens, tree.parents, tree.num_depths), target
        )

    monkeypatch.setattr(decoder, "accept_tree", by_parents)
    monkeypatch.setattr(graph_buffers, "accept_tree", by_parents)
    outs, _ = generate(toy_pair, accepted_prompts())
    assert tokens_of(outs) != ar_tokens


def test_auto_policy_is_lossless_and_learns(toy_pair, ar_tokens, monkeypatch):
    from ddtree.engine.budget.policy import BudgetPolicy

    carried = []  # decisions carried to a batch that changed (requests finishing)
    real = BudgetPolicy.carry
    monkeypatch.setattr(
        BudgetPolicy, "carry", lambda self, *a: carried.append(real(self, *a)) or carried[-1]
    )
    outs, planner = generate(toy_pair, accepted_prompts(), stub=False)
    assert tokens_of(outs) == ar_tokens and mean_accept(outs) > 2
    assert any(d is not None for d in carried)  # lossless with the carried decisions too
    pol = planner.policy
    assert (
        pol.shape.head is not None and pol.prior_chain > 1
    )  # the toy drafter's drafts are accepted
    # the served rounds' seconds reach the policy's cost (engine.step times each round)
    assert any(pol.cost.served(b, r) for b in range(1, 9) for r in range(len(pol.rung_budget)))
    rec = planner.last
    # the ladder's widths (1, 9, 17) and the chain's (block 8: 7 drafts, width 8)
    assert planner.cfg.verify_widths == (1, 8, 9, 17)
    assert rec.width in planner.cfg.verify_widths and len(rec.predicted) == len(rec.budgets)


def test_per_request_caps_verify_narrow_without_padding(toy_pair, ar_tokens):
    """Fixed budget 16, every request asking 4: the round verifies 1 + 4 rows, not 17."""
    from ddtree import SamplingParams

    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16)
    widths = []
    verify = llm.engine.runner.verify
    llm.engine.runner.verify = lambda rnd, tree: widths.append(tree.num_nodes) or verify(rnd, tree)
    sp = SamplingParams(
        temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, ddtree_budget=4
    )
    outs = llm.generate([list(p) for p in accepted_prompts()], sp)
    assert [o.token_ids for o in outs] == ar_tokens and mean_accept(outs) > 2
    assert set(widths) == {17}  # fixed mode keeps its one captured width ...
    assert max(max(o.accept_lengths) for o in outs) <= 5  # ... with 4 drafted nodes per request


@pytest.mark.parametrize("graphs", [False, True])
def test_hybrid_changing_budgets_are_lossless(toy_hybrid_pair, graphs, monkeypatch):
    """Width-1 rounds step the GDN state in place at verify (eager, or the width-1 verify graph)
    and commit none; the wider rounds stash and commit. On the graph path every round's commit
    replays its own width's commit graph (width 1: the KV and drafter-context writes)."""
    from ddtree.engine.graphs.runner import CudaGraphRunner

    commits = []
    real = CudaGraphRunner.commit
    monkeypatch.setattr(
        CudaGraphRunner,
        "commit",
        lambda self, w, path, k: commits.append(w) or real(self, w, path, k),
    )
    prompts = accepted_prompts(4)
    ar = make_llm(toy_hybrid_pair, "NONE").generate([list(p) for p in prompts], GREEDY)
    for strategy in ("extra_buffer", "no_buffer"):
        outs, planner = generate(
            toy_hybrid_pair, prompts, graphs=graphs, mamba_scheduler_strategy=strategy
        )
        assert tokens_of(outs) == tokens_of(ar) and mean_accept(outs) > 2, strategy
        assert 1 in planner.policy.widths
        assert (1 in commits) == graphs and (len(set(commits)) > 1) == graphs


def test_changing_budgets_keep_the_sampling_distribution(toy_pair):
    ar = first_tokens(make_llm(toy_pair, "NONE", max_running_requests=256), seed0=1000, n=800)
    llm = make_llm(toy_pair, "DDTREE", max_running_requests=256, **AUTO)
    llm.engine.set_budget_policy(CyclingPolicy())
    dd = first_tokens(llm, seed0=100_000, n=800)
    assert same_distribution(ar, dd) > 1e-3


def test_cost_profile_measures_every_width_and_caches(toy_pair, tmp_path, monkeypatch):
    """The startup profile replays (here: runs) draft + verify + commit per batch bucket and width;
    with a profile directory the second start reads the file instead of measuring."""
    from test_cuda_graph import attach_graphs

    from ddtree import envs
    from ddtree.engine.budget import profile as budget_profile
    from ddtree.engine.budget.policy import AnalyticCost, CostTable

    llm = make_llm(toy_pair, "DDTREE", max_running_requests=4, **AUTO)
    runner, spec = llm.engine.runner, llm.engine.spec
    fitted = budget_profile.round_cost(runner, spec)  # no graphs: the fitted roofline
    assert isinstance(fitted, AnalyticCost) and fitted.bandwidth == float("inf")
    assert (np.diff(fitted.seconds(4, 100)[1:]) > 0).all()
    g = attach_graphs(llm, 2)
    table = budget_profile.measure(runner, spec, replays=1)
    assert table.table.shape == (len(g.buckets), 1, 4) and (table.table > 0).all()
    g.capture = True  # round_cost measures only captured graphs; the runs stand in for replays
    monkeypatch.setenv(envs.BUDGET_PROFILE_DIR.name, str(tmp_path))
    monkeypatch.setattr(budget_profile, "measure", lambda r, s: table)
    first = budget_profile.round_cost(runner, spec)
    assert len(list(tmp_path.iterdir())) == 1
    monkeypatch.setattr(budget_profile, "measure", lambda r, s: pytest.fail("re-measured"))
    again = budget_profile.round_cost(runner, spec)
    assert isinstance(again, CostTable) and np.array_equal(again.table, first.table)


def test_detokenisation_is_deferred_without_stop_strings():
    """Requests without stop strings append ids only; `flush` (the server's publish, or the
    finish) brings the text up to date, equal to decoding the ids; stop strings still detokenise
    in the step."""
    from ddtree import LLM, SamplingParams

    llm = LLM(None, max_running_requests=2)
    eng = llm.engine
    plain = eng.add_request("def f(x):", SamplingParams(temperature=0, max_tokens=12))
    stops = eng.add_request("def f(x):", SamplingParams(temperature=0, max_tokens=12, stop=["@@"]))
    for _ in range(3):
        eng.step()
    assert eng.emitter.lag.get(plain.rid, 0) > 0 and plain.text == ""
    assert stops.rid not in eng.emitter.lag and stops.text
    eng.emitter.flush(plain)
    assert plain.text == stops.text[: len(plain.text)] and plain.rid not in eng.emitter.lag
    while eng.has_unfinished():
        eng.step()
    assert plain.text == stops.text == eng.tokenizer.decode(plain.output_ids)


def test_policy_trace_records_every_auto_round(toy_pair, ar_tokens, tmp_path, monkeypatch):
    """DDTREE_POLICY_TRACE: one line per auto round with every rung's rating as the policy
    compared them (rate = expected tokens / (seconds + host time)) and the round before's
    realised accept; the choice is the best rated rung except on exploration rounds."""
    import json

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("DDTREE_POLICY_TRACE", str(path))
    outs, planner = generate(toy_pair, accepted_prompts(), stub=False)
    planner.trace.close()
    assert tokens_of(outs) == ar_tokens
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rounds = max(len(o.accept_lengths) for o in outs)
    assert rounds <= len(rows) <= sum(len(o.accept_lengths) for o in outs)
    names = rows[0]["rungs"]
    assert names[0] == "ar" and "chain" in names and len(rows[0]["rate"]) == len(names)
    for r in rows:
        assert r["rung"] in names and 1 <= r["bs"] <= 8
        for tok, ms, rate in zip(r["tokens"], r["ms"], r["rate"]):
            if rate >= 0:
                assert rate == pytest.approx(tok / (ms + r["host_ms"]) * 1e3, rel=1e-2, abs=0.2)
    best = [r for r in rows if not r["explore"] and r["rate"][names.index(r["rung"])] >= 0]
    agree = sum(r["rate"][names.index(r["rung"])] >= max(r["rate"]) - 0.11 for r in best)
    assert agree >= 0.8 * len(best)  # proposed under the round before: its state moved since
    last = [r["last"] for r in rows[1:]]
    assert all(x["bs"] >= 1 and x["round_ms"] > 0 for x in last)
    assert any(x["accepted"] > 0 for x in last)
