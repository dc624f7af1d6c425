"""Regression guard on the kernels a hybrid round launches per decoder layer (`ddtree.tools.studies.op_count`:
aten ops that do work + Triton launches + one per attention call, counted on the CPU with our kernels
in Triton's interpreter, the engine's CUDA-graph path with capture off). Main at 4938d7d counted 17 per
GDN layer and 11 per gated-attention layer in an AR step and a DDTREE verify; the bounds are the
counts after the in_proj GEMM fusion, the row-indexed tree conv and the fused output gate. no_buffer
(the chunk-form tree verify, CUDA's default there) counted 54 per GDN layer with the PyTorch chunk
form: the Triton kernel (the solve, then the outputs) and the stash written inside the conv / chunk
kernels brought it to 12, and the gate computed inside the solve (no gating launch) to 11. NONE's
one-node rounds step the state in place: the in-place conv and the decode kernel with the gate
inside make 10 per GDN layer under both strategies, and the commit launches nothing for the state
(no_buffer's two replay launches, the copy's ops under extra_buffer)."""

import pytest
from engine_utils import make_llm, toy_prompts
from triton_utils import cpu_interpreter_only

from ddtree import envs
from ddtree.tools.studies.op_count import count_round, layer_ops, summarize

pytestmark = [cpu_interpreter_only, pytest.mark.usefixtures("one_torch_thread")]

GDN_MAX, ATTN_MAX = 11, 10  # both strategies: no stash writes outside kernels
AR_GDN_MAX = 10  # one-node rounds in place: conv + decode kernel (the gate inside), both strategies


@pytest.fixture
def kernels_on(monkeypatch):
    if not envs.TRITON_INTERPRET.on():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py)")
    monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, "1")
    monkeypatch.delenv(envs.REFERENCE.name, raising=False)


@pytest.mark.parametrize(
    "algorithm,strategy",
    [
        ("NONE", "extra_buffer"),
        ("NONE", "no_buffer"),
        ("DDTREE", "extra_buffer"),
        ("DDTREE", "no_buffer"),
    ],
)
def test_launches_per_layer(toy_hybrid_pair, kernels_on, algorithm, strategy):
    kw = {} if algorithm == "NONE" else dict(speculative_ddtree_budget=4)
    llm_kw = dict(max_running_requests=1, mamba_scheduler_strategy=strategy, **kw)
    prompt = list(toy_prompts(1)[0])
    counter = count_round(make_llm(toy_hybrid_pair, algorithm, **llm_kw), prompt)
    s = summarize(counter)
    gdn, attn = layer_ops(counter, "gdn"), layer_ops(counter, "attn")
    print(algorithm, s, dict(gdn), dict(attn))
    chunk = strategy == "no_buffer"  # the chunk kernel: the solve (gating inside), the outputs
    # the kernels the GPU runs really ran (a counter that saw nothing would pass the bounds)
    if algorithm == "NONE":
        assert s["gdn"] <= AR_GDN_MAX and s["attn"] <= ATTN_MAX, (s, gdn, attn)
        assert gdn["triton:_decode_kernel"] == 1 and gdn["triton:_tree_conv_kernel"] == 1
        trees = ("_tree_gdn_kernel", "_solve_kernel", "_output_kernel", "_gating_kernel")
        assert not any(f"triton:{t}" in gdn for t in trees), gdn
        assert not any("_replay_" in op for op in counter.ops["other"])  # no state commit
    else:
        assert s["gdn"] <= GDN_MAX and s["attn"] <= ATTN_MAX, (s, gdn, attn)
        trees = ["_solve_kernel", "_output_kernel"] if chunk else ["_tree_gdn_kernel"]
        assert all(gdn[f"triton:{t}"] == 1 for t in trees) and gdn["triton:_tree_conv_kernel"] == 1
        assert gdn["triton:_gating_kernel"] == (0 if chunk else 1), gdn
    assert gdn["linear"] == 4  # in_proj (one GEMM), out_proj, gate_up, down
    assert attn["attention"] == 1 and attn["triton:_sigmoid_gate_kernel"] == 1
    assert not any(op in gdn for op in ("index", "index_put_", "copy_", "clone"))
