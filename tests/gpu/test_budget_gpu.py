"""--speculative-ddtree-budget auto on the device, on the embedded pair: verify graphs captured per
ladder width, the startup cost profile measured from real replays (and read back from its cache),
and T=0 output token-identical to eager (fp32) and to AR under budgets that change every round
(a cycling policy stub: AR rounds, every width, mixed budgets in one batch), with the graphs
replayed at several widths."""

import numpy as np
import pytest
import torch
from engine_utils import mean_accept

from ddtree.engine.budget.planner import ScriptedPolicy

pytestmark = pytest.mark.gpu

MAX_TOKENS = 32
# every ladder width is reached (32 -> 33: with 33 instead, no budget fell in (16, 32] and width 33
# never ran); 3, 2 and 1 are built at 8 and cut
CYCLE = (0, 64, 3, 16, 1, 0, 32, 8, 2)


class Cycling(ScriptedPolicy):
    def __init__(self):
        self.k = 0

    def choose(self, slots, owners, caps, ctx, extra_s=0.0):
        from ddtree.engine.budget.policy import Decision

        self.k += 1
        n = len(slots)
        b = np.array([CYCLE[(self.k + 2 * i) % len(CYCLE)] for i in range(n)], dtype=np.int64)
        b = np.minimum(b, np.asarray(caps)) if self.k % 5 else np.zeros(n, dtype=np.int64)
        return Decision(1 + int(b.max()), b, np.zeros(n), 0.0)

    def observe_curves(self, *a, **kw):
        pass

    def observe_accepted(self, pending, accepted):
        pass


def _llm(pair, graphs: bool, **kw):
    from ddtree import LLM

    target, drafter = pair
    return LLM(
        target,
        dtype="float32",
        device="cuda",
        attention_backend="triton",
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=8,
        max_running_requests=8,
        context_length=2048,
        max_total_tokens=8 * (2048 + 80),
        speculative_algorithm="DDTREE",
        speculative_draft_model_path=drafter,
        speculative_ddtree_budget="auto",
        **kw,
    )


def _prompts(llm, n=5):
    import inspect
    import textwrap

    src = inspect.getsource(textwrap)
    return [
        llm.tokenizer.encode(src[300 * i :], add_special_tokens=False)[: 9 + 11 * i]
        for i in range(n)
    ]


def test_auto_graphs_profile_and_lossless(pair, tmp_path, monkeypatch):
    from ddtree import SamplingParams, envs
    from ddtree.engine.budget.policy import CostTable, ServedCost

    pytest.importorskip("triton")
    monkeypatch.setenv(envs.BUDGET_PROFILE_DIR.name, str(tmp_path))
    llm = _llm(pair, True)
    g = llm.engine.runner.graphs
    assert g is not None and g.capture and sorted(g.widths) == [1, 9, 16, 17, 33, 65]
    served = llm.engine.decoder.budgets.policy.cost
    assert isinstance(served, ServedCost)  # the profile, corrected by the rounds served
    cost = served.base
    assert isinstance(cost, CostTable) and (cost.table > 0).all()
    assert len(list(tmp_path.iterdir())) == 1  # cached for the next start
    print("cost table ms (batch x width):", np.round(1e3 * cost.table[:, 0], 3).tolist())
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts(llm)
    outs = llm.generate(prompts, sp)
    auto = [o.token_ids for o in outs]
    assert mean_accept(outs) > 2, [o.accept_lengths for o in outs]
    eager = _llm(pair, False)
    assert [o.token_ids for o in eager.generate(prompts, sp)] == auto
    # the served rounds reached the cost (printed for the record: on this small pair the host's
    # share of a round is large, so served / profiled may sit at the clip, 2)
    ratio = served.correction(len(prompts))
    print("served / profiled round seconds per rung at batch 5:", np.round(ratio, 3).tolist())
    assert (~np.isnan(ratio)).any(), ratio

    # changing budgets every round, through the graphs, vs AR
    widths = []
    verify = g.verify
    g.verify = lambda meta, tree: widths.append(tree.num_nodes) or verify(meta, tree)
    llm.engine.set_budget_policy(Cycling())
    outs = llm.generate(prompts, sp)
    cycled = [o.token_ids for o in outs]
    assert mean_accept(outs) > 2, [o.accept_lengths for o in outs]  # AR rounds included
    from ddtree import LLM

    ar = LLM(pair[0], dtype="float32", device="cuda", attention_backend="triton")
    assert [o.token_ids for o in ar.generate(prompts, sp)] == cycled == auto
    assert {1, 9, 17, 33, 65} <= set(widths), sorted(set(widths))
    torch.cuda.synchronize()


class Packing(ScriptedPolicy):
    """Every round a batch-wide budget (R cycling, one request capped at 0), every fifth dense."""

    ROWS = (1, 7, 40, 3, 300)

    def __init__(self):
        self.k = 0

    def choose(self, slots, owners, caps, ctx, extra_s=0.0):
        from ddtree.engine.budget.policy import Decision

        self.k += 1
        n = len(slots)
        b = np.array([(0, 64, 8, 32)[(self.k + i) % 4] for i in range(n)], dtype=np.int64)
        b = np.minimum(b, np.asarray(caps))
        rows = None if self.k % 5 == 0 else self.ROWS[self.k % len(self.ROWS)]
        return Decision(1 + int(b.max()), b, np.zeros(n), 0.0, rows=rows)

    def observe_curves(self, *a, **kw):
        pass

    def observe_accepted(self, pending, accepted):
        pass


def _packed_equals_ar(pair, llm):
    """Packed rounds (the `Packing` script) of greedy requests and a seeded sampled one among
    them: AR's tokens, token for token; the outputs."""
    from ddtree import LLM, SamplingParams

    llm.engine.set_budget_policy(Packing())
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [sp, sp, seeded, sp, sp]
    prompts = _prompts(llm)
    outs = llm.generate(prompts, params)
    ar = LLM(pair[0], dtype="float32", device="cuda", attention_backend="triton")
    assert [o.token_ids for o in ar.generate(prompts, params)] == [o.token_ids for o in outs]
    assert mean_accept(outs) > 2, [o.accept_lengths for o in outs]
    return outs


def test_packed_rounds_on_the_device_equal_ar(pair):
    """Batch-wide budgets on CUDA, eager (fp32, the Triton kernel reading each request's q_len
    from the packed qo_indptr, given only the lengths' bounds on the host): T=0 output identical
    to AR, a seeded sampled request packed beside the greedy ones too."""
    pytest.importorskip("triton")
    llm = _llm(pair, False)
    runner = llm.engine.runner
    assert not runner.backend.reads_host_q_lens(runner.target.config.head_dim, runner.device)
    assert llm.engine.decoder.budgets.packing
    packed = []
    real = runner.verify_packed
    runner.verify_packed = lambda rnd, tree, keep, n, *a: (
        packed.append(n) or real(rnd, tree, keep, n, *a)
    )
    _packed_equals_ar(pair, llm)
    assert packed


def test_packed_graphs_on_the_device_equal_ar(pair):
    """The packed verify's CUDA graphs (engine/graphs/packed.py) captured and replayed: fp32, the
    Triton kernel reading each request's q_len from the static indptr at every replay; T=0 output
    identical to AR (a seeded sampled request too), rounds replayed at more than one (batch,
    rows) graph."""
    pytest.importorskip("triton")
    llm = _llm(pair, True)
    g = llm.engine.runner.graphs
    assert g is not None and g.packed is not None and g.packed_sets
    replays = []
    for key, gs in g.packed_sets.items():
        gs.run = lambda b, host, run=gs.run, key=key: replays.append(key) or run(b, host)
    _packed_equals_ar(pair, llm)
    assert len(set(replays)) > 1, replays
