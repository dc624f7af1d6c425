"""Auto's rungs on the device (issue 20), embedded pair, fp32, CUDA graphs captured: every rung has
its own captured draft graphs (the tree built at the rung, and the DFLASH chain), a round forced
to one budget replays exactly the fixed B=b server's draft spec and verify width, and the chain
rung replays the chain's; all T=0 token-identical to AR.

    python3 -m pytest -m gpu tests/gpu/test_budget_rungs_gpu.py -q
"""

import numpy as np
import pytest

from ddtree.engine.budget.planner import ScriptedPolicy

pytestmark = pytest.mark.gpu


class Forced(ScriptedPolicy):
    def __init__(self, budget: int, chain: bool = False):
        self.budget, self.chain = budget, chain

    def choose(self, slots, owners, caps, ctx, extra_s=0.0):
        from ddtree.engine.budget.policy import Decision

        b = np.full(len(slots), self.budget, dtype=np.int64)
        return Decision(1 + self.budget, b, np.zeros(len(slots)), 0.0, self.chain)

    def observe_curves(self, *a, **kw):
        pass

    def observe_accepted(self, pending, accepted):
        pass


def _llm(pair, algorithm="DDTREE", **kw):
    from ddtree import LLM

    target, drafter = pair
    return LLM(
        target,
        dtype="float32",
        device="cuda",
        attention_backend="triton",
        cuda_graph_max_bs=4,
        max_running_requests=4,
        context_length=2048,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=drafter,
        **kw,
    )


def _run(llm, prompts):
    from ddtree import SamplingParams

    g = llm.engine.runner.graphs
    replays = []
    for spec, gs in g.draft_sets.items():
        run = gs.run
        gs.run = lambda b, lens, spec=spec, run=run: replays.append(spec) or run(b, lens)
    widths = []
    verify = g.verify
    g.verify = lambda meta, tree: widths.append(tree.num_nodes) or verify(meta, tree)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, sp)], set(replays), set(widths)


def test_rungs_replay_their_own_draft_graphs(pair, tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from ddtree import envs

    monkeypatch.setenv(envs.BUDGET_PROFILE_DIR.name, str(tmp_path))
    auto = _llm(pair, speculative_ddtree_budget="auto")
    spec, g = auto.engine.spec, auto.engine.runner.graphs
    assert g is not None and g.capture
    want = {spec.tree_spec(b) for b in (8, 16, 32, 64)} | {spec.tree_spec(chain=True)}
    assert want <= set(g.draft_sets), sorted(g.draft_sets)
    assert all(
        gs.graphs and all(x[0] is not None for x in gs.graphs.values())
        for s, gs in g.draft_sets.items()
        if s in want
    )  # captured, not run eagerly
    tok = auto.tokenizer
    prompts = [tok.encode("def f(x):\n    return x" + " + 1" * i) for i in range(3)]
    ar = _llm(pair, "NONE")
    from ddtree import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ar_tokens = [o.token_ids for o in ar.generate(prompts, sp)]
    fixed = _llm(pair, speculative_ddtree_budget=16)
    f_tokens, f_specs, f_widths = _run(fixed, prompts)
    auto.engine.set_budget_policy(Forced(16))
    a_tokens, a_specs, a_widths = _run(auto, prompts)
    assert a_tokens == f_tokens == ar_tokens
    assert a_specs == f_specs == {spec.tree_spec(16)} and a_widths == f_widths == {17}
    D = spec.block_size - 1
    auto.engine.set_budget_policy(Forced(D, chain=True))
    c_tokens, c_specs, c_widths = _run(auto, prompts)
    assert c_tokens == ar_tokens
    assert c_specs == {spec.tree_spec(chain=True)} and c_widths == {1 + D}
