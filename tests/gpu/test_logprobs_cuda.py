"""On CUDA with the Triton backend and CUDA graphs (the verify graph's logits buffer, the in-graph
greedy walk): emitted-token log-probs equal a plain full forward of the target. Run on the H200:
`python3 -m pytest -q tests/gpu/test_logprobs_cuda.py`."""

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.assets import default_model_paths
from ddtree.models.loader import load_target

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [
    "import json\n\n\ndef dumps(obj, *, indent=None):\n    ",
    "class Stack:\n    def push(self, x):\n",
]


# bf16: the engine (paged Triton attention, fused layers, graphs) and the plain forward round
# differently; on the H200 their top-4 log-probs differed by up to 0.185 (3 bf16 steps at logits
# of 8-16) in 2 of 160 entries, so the bound is 4 steps
@pytest.mark.parametrize("dtype, atol", [("float32", 2e-3), ("bfloat16", 0.25)])
@pytest.mark.parametrize("algorithm", ["NONE", "DFLASH", "DDTREE"])
def test_cuda_graph_logprobs_equal_full_forward(algorithm, dtype, atol):
    llm = LLM(
        None,
        speculative_algorithm=algorithm,
        device="cuda",
        dtype=dtype,
        attention_backend="triton",
        max_running_requests=4,
        speculative_ddtree_budget=16,
    )
    assert llm.engine.runner.graphs is not None, "CUDA graphs must be on for this test"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, top_logprobs=4)
    outs = llm.generate(PROMPTS, params)
    target = load_target(default_model_paths()[0], getattr(torch, dtype), "cuda")
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids + out.token_ids[:-1]], device="cuda")
        with torch.no_grad():
            logits, _ = target.forward_train(ids)
        ref = torch.log_softmax(logits[0, len(out.prompt_token_ids) - 1 :].float(), -1).cpu()
        got = torch.tensor([e.logprob for e in out.logprobs])
        want = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
        tops = torch.tensor([[v for _, v in e.top] for e in out.logprobs])
        torch.testing.assert_close(tops, ref.topk(4, -1).values, rtol=0, atol=atol)
    if algorithm != "NONE":
        assert sum(o.mean_accept_length for o in outs) / len(outs) > 2
