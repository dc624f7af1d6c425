"""The hybrid engine end to end on the GPU code paths, run on the CPU: the Triton tree kernel (interpreter) for
verify with node states (extra_buffer), the tree conv kernel, the chunk-form tree rule's kernel for
verify without them (no_buffer, the gate inside) and no_buffer's commit kernel, and fla's call
signature (a stand-in built from the reference) for prefill. DDTREE stays token-identical to AR
(all-reference) under both commit strategies."""

import pytest
from engine_utils import accepted_prompts, mean_accept, run
from test_gdn_dispatch import _fake_fla
from triton_utils import cpu_interpreter_only, load_kernel_module

from ddtree import SamplingParams

load_kernel_module("ddtree.kernels.gdn.triton_tree")
tree_conv = load_kernel_module("ddtree.kernels.gdn.tree_conv")
load_kernel_module("ddtree.kernels.gdn.tree_chunk_triton")
load_kernel_module("ddtree.kernels.gdn.commit_triton")

from ddtree.engine.memory import state_pool  # noqa: E402
from ddtree.kernels.gdn import backend, dispatch  # noqa: E402

PROMPTS = accepted_prompts(2)  # accepted by the toy drafter (toy_prompts(2): 1.6 a round)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), cpu_interpreter_only]


@pytest.fixture(scope="module")
def ar_tokens(toy_hybrid_pair):
    return [
        o.token_ids
        for o in run(toy_hybrid_pair, PROMPTS, PARAMS, mamba_scheduler_strategy="extra_buffer")
    ]


@pytest.mark.parametrize("strategy", ["extra_buffer", "no_buffer"])
def test_gpu_paths_are_lossless(monkeypatch, toy_hybrid_pair, ar_tokens, strategy):
    calls = []
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(state_pool, "commit_kernel", lambda t: True)
    monkeypatch.setattr(dispatch, "use_fla", lambda t: True)
    monkeypatch.setattr(dispatch, "fla_ops", lambda: _fake_fla(calls))
    monkeypatch.setattr(tree_conv, "use_triton", lambda t: True)
    backend.ran.clear()
    outs = run(
        toy_hybrid_pair,
        PROMPTS,
        PARAMS,
        algorithm="DDTREE",
        mamba_scheduler_strategy=strategy,
        speculative_ddtree_budget=6,
    )
    assert [o.token_ids for o in outs] == ar_tokens
    assert mean_accept(outs) > 2
    tree = "triton" if strategy == "extra_buffer" else "chunk"
    assert (
        backend.ran[("tree", tree)]
        and not backend.ran[("tree", {"triton": "chunk", "chunk": "triton"}[tree])]
    )
    assert backend.ran[("prefill", "fla")] and "chunk" in calls
    assert backend.ran[("tree_conv", "triton")] and not backend.ran[("tree_conv", "reference")]
    assert not any(name == "reference" for _, name in backend.ran)
    if strategy == "no_buffer":
        assert backend.ran[("commit", "triton")]
