"""The production shapes on the GPU: the inflated Qwen3-8B pair (fp32, ~33 GB) computes the embedded
pair's logits and drafter proposals; the Qwen3.6-27B hybrid target (bf16, built in memory) agrees
with it to bf16 rounding, and is served from memory (`inflate:qwen3.6-27b`). Run:
python3 -m pytest -q tests/gpu/test_inflate_production.py"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (H200: 139 GiB)"),
]


def _small():
    from ddtree.assets import default_model_paths
    from ddtree.models.loader import load_target

    t, d = default_model_paths()
    return t, d, load_target(t, torch.float32, "cuda")


@torch.no_grad()
def test_qwen3_8b_fp32_logits_equal_small():
    from ddtree.tools.inflate import inflate_pair

    t, d, small = _small()
    pair = inflate_pair(t, d, "qwen3-8b", "cuda", torch.float32)
    assert sum(p.numel() for p in pair.target.parameters()) > 8e9
    ids = torch.randint(
        3,
        small.config.vocab_size,
        (2, 256),
        device="cuda",
        generator=torch.Generator("cuda").manual_seed(0),
    )
    ref, _ = small.forward_train(ids)
    big, _ = pair.target.forward_train(ids)
    v = small.config.vocab_size
    assert float((big[..., :v] - ref).abs().max() / ref.abs().max()) <= 1e-5
    assert float(big[..., v:].max()) < float(ref.min()) - 1e3
    del pair
    gc.collect()
    torch.cuda.empty_cache()


@torch.no_grad()
def test_qwen36_27b_bf16_builds_and_tracks_small():
    from ddtree.tools.inflate import inflate_pair

    t, d, small = _small()
    pair = inflate_pair(t, d, "qwen3.6-27b", "cuda", torch.bfloat16)
    assert pair.target.config.is_hybrid and len(pair.target.config.linear_layer_ids) == 48
    ids = torch.randint(
        3,
        small.config.vocab_size,
        (1, 128),
        device="cuda",
        generator=torch.Generator("cuda").manual_seed(0),
    )
    ref, _ = small.forward_train(ids)
    big, _ = pair.target.forward_train(ids)
    v = small.config.vocab_size
    agree = (big[..., :v].float().argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree  # bf16 near-ties only
    assert float(big[..., v:].max()) < float(ref.min())
    del pair
    gc.collect()
    torch.cuda.empty_cache()


def test_qwen36_27b_served_from_memory():
    """`--model-path inflate:qwen3.6-27b`: the engine builds the 27B pair on the GPU (nothing on
    disk), its weights are the bytes the plan counted, and DDTREE drafts are accepted."""
    from ddtree import LLM, SamplingParams
    from ddtree.config.memory_plan import memory_plan
    from ddtree.engine.setup import module_bytes

    llm = LLM(
        "inflate:qwen3.6-27b",
        speculative_algorithm="DDTREE",
        speculative_ddtree_budget=16,
        mamba_scheduler_strategy="no_buffer",
        max_running_requests=2,
    )
    runner = llm.engine.runner
    plan = memory_plan(llm.args, torch.cuda.get_device_properties(0).total_memory)
    assert module_bytes(runner.target) == plan.target_weight_bytes
    assert module_bytes(runner.drafter) == plan.drafter_weight_bytes
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(["def fibonacci(n):\n    ", "The history of the printing press"], params)
    assert all(len(o.token_ids) == 32 for o in outs)
    assert max(o.mean_accept_length for o in outs) > 2.0, [o.accept_lengths for o in outs]
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
