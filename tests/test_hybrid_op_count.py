"""Regression guard on the kernels a hybrid round launches per decoder layer (`ddtree.bench.op_count`:
aten ops that do work + Triton launches + one per attention call, counted on the CPU with our kernels
in Triton's interpreter, the engine's CUDA-graph path with capture off). Main at 4938d7d counted 17 per
GDN layer and 11 per gated-attention layer in an AR step and a DDTREE verify; the bounds are the
counts after the in_proj GEMM fusion, the row-indexed tree conv and the fused output gate. no_buffer
(the chunk-form tree verify, CUDA's default there) counted 54 per GDN layer with the PyTorch chunk
form: the Triton kernel and the stash written inside the conv / chunk kernels bring it to 11, and its
split form (the default: the solve, then the outputs) to 12."""

import pytest
from engine_utils import make_llm, toy_prompts
from triton_utils import cpu_interpreter_only

from ddtree import envs
from ddtree.bench.op_count import count_round, layer_ops, summarize

pytestmark = [cpu_interpreter_only, pytest.mark.usefixtures("one_torch_thread")]

GDN_MAX, ATTN_MAX = 11, 10  # extra_buffer (the default on CUDA): no stash writes outside kernels


@pytest.fixture
def kernels_on(monkeypatch):
    if not envs.TRITON_INTERPRET.on():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py)")
    monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, "1")
    monkeypatch.setenv(envs.GDN_TREE_CHUNK.name, "1")  # CUDA's auto: the chunk form (no_buffer)
    monkeypatch.delenv(envs.FORCE_REFERENCE_GDN.name, raising=False)


@pytest.mark.parametrize(
    "algorithm,strategy",
    [("NONE", "extra_buffer"), ("DDTREE", "extra_buffer"), ("DDTREE", "no_buffer")],
)
def test_launches_per_layer(toy_hybrid_pair, kernels_on, algorithm, strategy):
    kw = {} if algorithm == "NONE" else dict(speculative_ddtree_budget=4)
    llm = make_llm(
        toy_hybrid_pair,
        algorithm,
        max_running_requests=1,
        mamba_scheduler_strategy=strategy,
        **kw,
    )
    counter = count_round(llm, list(toy_prompts(1)[0]))
    s = summarize(counter)
    gdn, attn = layer_ops(counter, "gdn"), layer_ops(counter, "attn")
    print(algorithm, s, dict(gdn), dict(attn))
    split = strategy == "no_buffer"  # the chunk kernel's default form: two launches
    assert s["gdn"] <= GDN_MAX + split and s["attn"] <= ATTN_MAX, (s, gdn, attn)
    # the kernels the GPU runs really ran (a counter that saw nothing would pass the bounds)
    trees = ["_solve_kernel", "_output_kernel"] if split else ["_tree_gdn_kernel"]
    assert all(gdn[f"triton:{t}"] == 1 for t in trees) and gdn["triton:_tree_conv_kernel"] == 1
    assert gdn["linear"] == 4  # in_proj (one GEMM), out_proj, gate_up, down
    assert attn["attention"] == 1 and attn["triton:_sigmoid_gate_kernel"] == 1
    assert not any(op in gdn for op in ("index", "index_put_", "copy_", "clone"))
