"""DFlash2 on the device: the grouped dynamic convolution and the selector-chain kernels against
their references at the production widths (Qwen3-8B 4096, Qwen3.6-27B 5120; rank 256, top-16),
the path-conditioned tree's beam kernel == its PyTorch selection bit for bit on the GPU, and the
GPU build equal to the CPU one, and CUDA graphs vs eager through
the engine (the embedded target with a DFlash2 drafter carried from its DFlash one, perturbed so
its convolutions and selector compute): token-identical in fp32 (bf16: at most one near-tie),
DFLASH and DDTREE, batch 1 and 5, mean accepted length > 2, the fused draft -> tree replayed."""

import pytest
import torch
from engine_utils import mean_accept
from test_cuda_graphs_gpu import _count_replays, _prompts

from ddtree.kernels import dynamic_conv as conv_mod
from ddtree.kernels import selector
from ddtree.kernels.dynamic_conv import dynamic_conv_reference
from ddtree.speculative.markov_tree import (
    MarkovDraft,
    build_markov_tree,
    greedy_chain,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def dflash2_pair(pair, tmp_path_factory):
    """(target dir, DFlash2 drafter dir): the embedded target; the shipped DFlash2 drafter where
    the checkout has one, else one carried from the DFlash drafter with noise."""
    import os

    from ddtree.assets import PACKAGE_PAIR
    from ddtree.tools.train.selector import dflash2_from_dflash

    shipped = os.path.join(PACKAGE_PAIR, "drafter_dflash2")
    if os.path.isdir(shipped):
        return pair[0], shipped
    out = str(tmp_path_factory.mktemp("dflash2"))
    return pair[0], dflash2_from_dflash(pair[1], pair[0], out, noise=0.05)


@pytest.mark.parametrize("H", [4096, 5120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dynamic_conv_kernel(H, dtype):
    g = torch.Generator(device="cuda").manual_seed(H)
    k, group, S, b = 2, 16, 16, 8
    x = torch.randn(b, S, H, generator=g, device="cuda").to(dtype)
    proj = torch.randn(b, S, 2 * k * H // group, generator=g, device="cuda").to(dtype)
    base = torch.randn(k, H, generator=g, device="cuda").to(dtype)
    for dyn in (proj[..., : k * H // group], proj[..., k * H // group :]):
        got = conv_mod.dynamic_conv(x, dyn, base, group, S)
        ref = dynamic_conv_reference(x, dyn, base, group, S)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def _draft(b, D, K, r, V, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(b, D, V, generator=g, device="cuda") * 3
    unary, cand = logits.topk(K, dim=-1)
    edge = torch.randn(b, D, K, r, generator=g, device="cuda") * 0.1
    book = torch.randn(V, r, generator=g, device="cuda").to(torch.bfloat16)
    return MarkovDraft(logits, unary, cand, edge, book)


def test_selector_chain_kernel():
    draft = _draft(8, 15, 16, 256, 151936, 0)
    roots = torch.arange(8, device="cuda") * 1000
    assert selector.use_kernel(draft.unary)
    tok, logq = selector.selector_chain(roots, draft)
    ref_tok, ref_logq = greedy_chain(roots, draft)
    assert torch.equal(tok, ref_tok) and torch.equal(logq, ref_logq)


@pytest.mark.parametrize("budget", [16, 64])
def test_markov_tree_on_the_device_equals_the_cpu_build(budget):
    draft = _draft(4, 15, 16, 64, 1000, budget)
    roots = torch.tensor([1, 2, 3, 4], device="cuda")
    limits = torch.tensor([15, 3, 9, 0], device="cuda")
    gpu = build_markov_tree(roots, draft, budget, budget, True, max_depth=limits)
    fused = build_markov_tree(
        roots, draft, budget, 16, True, max_depth=limits, select=selector.select_markov_nodes
    )
    for f in ("tokens", "parents", "depths", "valid", "tree_mask", "path_probs", "chain_probs"):
        assert torch.equal(getattr(fused, f), getattr(gpu, f)), f  # the kernel: bit for bit
    cpu_draft = MarkovDraft(*(x.cpu() for x in draft))
    cpu = build_markov_tree(roots.cpu(), cpu_draft, budget, budget, True, max_depth=limits.cpu())
    for f in ("tokens", "parents", "depths", "valid", "tree_mask"):
        assert torch.equal(getattr(gpu, f).cpu(), getattr(cpu, f)), f
    torch.testing.assert_close(gpu.path_probs.cpu(), cpu.path_probs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algo,budget", [("DFLASH", None), ("DDTREE", 16)])
def test_graphs_match_eager(dflash2_pair, dtype, algo, budget):
    from ddtree import LLM, SamplingParams
    from ddtree.models.dflash2 import DFlash2Drafter

    target, drafter = dflash2_pair
    kw = dict(
        dtype=dtype,
        device="cuda",
        attention_backend="triton",
        cuda_graph_max_bs=8,
        max_running_requests=8,
        context_length=2048,
        max_total_tokens=8 * (2048 + 80),
        speculative_algorithm=algo,
        speculative_draft_model_path=drafter,
    )
    if budget:
        kw["speculative_ddtree_budget"] = budget
    llm = LLM(target, **kw)
    runner = llm.engine.runner
    assert isinstance(runner.drafter, DFlash2Drafter)
    graphs = runner.graphs
    assert graphs is not None, "CUDA graphs were not enabled (see the log)"
    counts: dict = {}
    _count_replays(graphs, counts)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    try:
        for b in (1, 5):
            prompts = _prompts(llm, b)
            runner.graphs = None
            eager = [o.token_ids for o in llm.generate(prompts, params)]
            runner.graphs = graphs
            counts.clear()
            outs = llm.generate(prompts, params)
            graph = [o.token_ids for o in outs]
            assert counts.get("draft_tree") and counts.get("accept"), f"b={b}: {counts}"
            assert mean_accept(outs) > 2, f"b={b}: {[o.accept_lengths for o in outs]}"
            bad = [i for i, (x, y) in enumerate(zip(eager, graph)) if x != y]
            if dtype == "float32":
                assert not bad, f"b={b}: requests {bad} differ"
            else:
                assert len(bad) <= max(1, b // 5), f"b={b}: requests {bad} differ"
    finally:
        runner.graphs = graphs
        del llm
        torch.cuda.empty_cache()
