"""On CUDA with the Triton backend, CUDA graphs and extend graphs: prompt log-probs (a batch that
asks runs the eager extend, one that does not keeps its graphs) equal a plain full forward of the
target, chunked and from a cached prefix. Run on the device:
`python3 -m pytest -q tests/gpu/test_prompt_logprobs_cuda.py`."""

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
    "import json\n\n\ndef dumps(obj, *, indent=None):\n    return json.dumps(obj, indent=indent)\n",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
]


# fp32: the same tolerance as the emitted tokens' (tests/gpu/test_logprobs_cuda.py); bf16: 4 steps
@pytest.mark.parametrize("dtype, atol", [("float32", 2e-3), ("bfloat16", 0.25)])
@pytest.mark.parametrize("algorithm", ["NONE", "DDTREE"])
def test_prompt_logprobs_equal_full_forward_on_cuda(algorithm, dtype, atol):
    llm = LLM(
        None,
        speculative_algorithm=algorithm,
        device="cuda",
        dtype=dtype,
        attention_backend="triton",
        max_running_requests=4,
        speculative_ddtree_budget=16,
        chunked_prefill_size=16,
    )
    assert llm.engine.runner.graphs is not None, "CUDA graphs must be on for this test"
    plain = SamplingParams(temperature=0, max_tokens=8)
    asking = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=4)
    llm.generate(PROMPTS, plain)  # the prompts' pages cached
    outs = llm.generate(PROMPTS + PROMPTS, [asking, asking, plain, plain])
    target = load_target(default_model_paths()[0], getattr(torch, dtype), "cuda")
    for out in outs[:2]:
        assert out.cached_tokens == 0
        ids = torch.tensor([out.prompt_token_ids], device="cuda")
        with torch.no_grad():
            logits, _ = target.forward_train(ids)
        ref = torch.log_softmax(logits[0, :-1].float(), -1).cpu()
        entries = out.prompt_logprobs
        assert entries[0] is None and len(entries) == len(out.prompt_token_ids)
        got = torch.tensor([e.logprob for e in entries[1:]])
        want = ref.gather(1, torch.tensor(out.prompt_token_ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
        tops = torch.tensor([[v for _, v in e.top] for e in entries[1:]])
        torch.testing.assert_close(tops, ref.topk(4, -1).values, rtol=0, atol=atol)
    assert all(o.cached_tokens > 0 for o in outs[2:])
    if dtype == "float32":  # generation is the same with or without prompt log-probs
        assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in outs[2:]]
