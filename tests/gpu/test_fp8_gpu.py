"""Block-FP8 on the device: the kernels against the reference at the served shapes and row counts
(the group quantization bit for bit, the GEMMs to bf16 output rounding), a linear replayed from a CUDA
graph bit for bit equal to eager, and the toy pairs quantized at load served with CUDA graphs emitting
the eager run's tokens and, with DFLASH / DDTREE, the FP8 AR tokens (fp32 activations; mean accepted
length > 2 asserted)."""

from dataclasses import replace

import pytest
import torch
from engine_utils import GREEDY, accepted_prompts, mean_accept

from ddtree.kernels import fp8
from ddtree.kernels.fp8 import reference as R
from ddtree.kernels.fp8 import triton as T
from ddtree.kernels.fp8.tuning import auto_split, gemm_config, sm_count

pytestmark = pytest.mark.gpu
SHAPES = [(6144, 4096), (4096, 12288), (34816, 5120)]  # 8B qkv, 8B down, 27B gate|up
ROWS = [1, 16, 65, 520, 1040]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for N, K in SHAPES:
        w = 0.02 * torch.randn(N, K, generator=gen, device="cuda")
        out[(N, K)] = R.quantize_weight(w, (128, 128))
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_kernels_match_reference(weights, shape, m):
    wq, ws = weights[shape]
    x = torch.randn(m, shape[1], device="cuda").to(torch.bfloat16)
    q, s = T.group_quant(x, 128)
    rq, rs = R.group_quant(x, 128)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    ref = R.block_matmul(rq, rs, wq, ws, 128, 128, torch.float32)
    config = gemm_config(m, shape[0])
    got = T.gemm(q, s, wq, ws, 128, 128, torch.bfloat16, config)
    assert _rel(got, ref) < 3e-3  # the bf16 output's rounding: ~1.7e-3 (bf16 F.linear's too)
    split = auto_split(m, *shape, config, sm_count(0))  # the studies' split, at <= 16 rows
    if split > 1:
        got = T.gemm(q, s, wq, ws, 128, 128, torch.bfloat16, replace(config, split_k=split))
        assert _rel(got, ref) < 3e-3
    assert fp8.cublas_ok(wq, 128, 128)  # torch 2.11 + CUDA 13 on sm_90 run it
    mp = -(-m // 4) * 4
    q4, s4 = T.group_quant(x, 128, rows=mp, column_major=True)
    y = torch._scaled_mm(q4, wq.t(), s4, fp8.cublas_scale(ws), out_dtype=torch.bfloat16)[:m]
    assert _rel(y, ref) < 3e-3
    auto = fp8.linear(x, wq, ws, 128, 128, scale_t=fp8.cublas_scale(ws))
    assert _rel(auto, ref) < 3e-3


def test_linear_in_a_graph_is_eager(weights):
    from ddtree.models.quant import Fp8Linear

    wq, ws = weights[SHAPES[0]]
    lin = Fp8Linear(SHAPES[0][1], SHAPES[0][0], False, (128, 128), 128, torch.bfloat16, "cuda")
    with torch.no_grad():
        lin.weight.copy_(wq)
        lin.weight_scale_inv.copy_(ws)
    lin.prepare()
    for m in (1, 65, 520):
        x = torch.randn(m, SHAPES[0][1], device="cuda").to(torch.bfloat16)
        eager = lin(x)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            lin(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            out = lin(x)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def toy(request, tmp_path_factory):
    import os

    from ddtree import envs
    from ddtree.tools.train.toy import build_toy_hybrid_pair, build_toy_pair

    build = build_toy_pair if request.param == "dense" else build_toy_hybrid_pair
    name = "toy_pair" if request.param == "dense" else "toy_hybrid_pair"
    root = envs.CACHE.get()
    return build(os.path.join(root, name) if root else str(tmp_path_factory.mktemp(name)))


def _run(pair, algo, graphs):
    from ddtree import LLM

    kw = {"speculative_draft_model_path": pair[1]} if algo != "NONE" else {}
    if algo == "DDTREE":
        kw["speculative_ddtree_budget"] = 16
    llm = LLM(
        pair[0],
        speculative_algorithm=algo,
        dtype="float32",
        device="cuda",
        quantization="fp8",
        speculative_draft_quantization="fp8" if algo != "NONE" else None,
        max_running_requests=5,
        max_total_tokens=4096,
        disable_cuda_graph=not graphs,
        **kw,
    )
    prompts = [list(p) for p in accepted_prompts(5)]
    return llm.generate(prompts, GREEDY)


def test_fp8_graphs_match_eager_and_ar(toy):
    ar = [o.token_ids for o in _run(toy, "NONE", graphs=False)]
    assert [o.token_ids for o in _run(toy, "NONE", graphs=True)] == ar
    for algo in ("DFLASH", "DDTREE"):
        outs = _run(toy, algo, graphs=True)
        assert [o.token_ids for o in outs] == ar, algo
        assert mean_accept(outs) > 2
        assert [o.token_ids for o in _run(toy, algo, graphs=False)] == ar, algo
