"""Log-probs of emitted tokens equal the target's log-softmax from a plain full forward over prompt
+ output (no paging, no tree), in AR, DFLASH and DDTREE modes, on the embedded pair whose drafts are
really accepted, so tokens emitted from accepted nodes and bonus tokens are both checked."""

import functools

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.assets import default_model_paths
from ddtree.engine.round import logprobs
from ddtree.models.loader import load_target

PROMPTS = [
    "import json\n\n\ndef dumps(obj, *, indent=None):\n    ",
    "class Stack:\n    def push(self, x):\n",
]
TOP = 3


@functools.lru_cache(maxsize=None)
def reference_target():
    return load_target(default_model_paths()[0], torch.float32)


def reference_logprobs(prompt_ids, output_ids) -> torch.Tensor:
    """[len(output_ids), V]: row j = the target's log-softmax after prompt + output[:j]."""
    ids = torch.tensor([list(prompt_ids) + list(output_ids[:-1])])
    with torch.no_grad():
        logits, _ = reference_target().forward_train(ids)
    return torch.log_softmax(logits[0, len(prompt_ids) - 1 :].float(), -1)


@functools.lru_cache(maxsize=None)
def llm(algorithm: str):
    return LLM(
        None,
        speculative_algorithm=algorithm,
        device="cpu",
        dtype="float32",
        max_running_requests=2,
        speculative_ddtree_budget=16,
    )


def check_against_reference(out, k: int):
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    ref = reference_logprobs(out.prompt_token_ids, out.token_ids)
    got = torch.tensor([e.logprob for e in out.logprobs], dtype=torch.float64)
    want = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0].double()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert [e.token_id for e in out.logprobs] == out.token_ids
    top = ref.topk(k, -1)
    for j, e in enumerate(out.logprobs):
        assert len(e.top) == k
        if not k:
            continue
        torch.testing.assert_close(
            torch.tensor([v for _, v in e.top]), top.values[j], rtol=0, atol=1e-4
        )
        # ids may swap only between (near-)ties
        assert e.top[0][0] == top.indices[j, 0].item() or e.top[0][1] - e.top[1][1] < 1e-4


@pytest.mark.parametrize("algorithm", ["NONE", "DFLASH", "DDTREE"])
def test_greedy_logprobs_equal_full_forward(algorithm, one_torch_thread):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, top_logprobs=TOP)
    outs = llm(algorithm).generate(PROMPTS, params)
    for out in outs:
        check_against_reference(out, TOP)
        # at T=0 the emitted token is the most likely one
        assert all(e.top[0][0] == e.token_id for e in out.logprobs)
    if algorithm != "NONE":
        assert (
            sum(o.mean_accept_length for o in outs) / len(outs) > 2
        )  # accepted nodes' tokens were checked


@pytest.mark.parametrize("algorithm", ["NONE", "DDTREE"])
def test_sampled_logprobs_are_the_raw_target_distribution(algorithm, one_torch_thread):
    """At T>0 the values are the target's before temperature / top-k / top-p (vLLM's default)."""
    params = SamplingParams(
        temperature=0.7, top_k=2, max_tokens=24, ignore_eos=True, seed=3, logprobs=True
    )
    for out in llm(algorithm).generate(PROMPTS, params):
        ref = reference_logprobs(out.prompt_token_ids, out.token_ids)
        got = torch.tensor([e.logprob for e in out.logprobs])
        torch.testing.assert_close(
            got, ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], rtol=0, atol=1e-4
        )
        assert all(e.top == () for e in out.logprobs)
        # top-k=2 sampling only ever emits one of the two most likely tokens
        assert (ref.topk(2, -1).indices == torch.tensor(out.token_ids)[:, None]).any(-1).all()


def test_logprobs_follow_a_stop_inside_a_round(one_torch_thread):
    """A length limit inside an accepted block drops the block's tail and its log-probs."""
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=True)
    for out in llm("DDTREE").generate(PROMPTS, params):
        assert len(out.token_ids) == 7 and len(out.logprobs) == 7
        check_against_reference(out, 0)


def test_no_logprobs_unless_asked(one_torch_thread):
    out = llm("DDTREE").generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.logprobs is None
    req = type("R", (), {"params": SamplingParams()})()
    assert (
        logprobs.node_logprobs(
            [req],
            torch.zeros(1, 2, 5),
            torch.zeros(1, 2, dtype=torch.int64),
            torch.zeros(1, 2, dtype=torch.int64),
        )
        is None
    )


def test_params_validate_top_logprobs():
    assert SamplingParams(top_logprobs=2).logprobs
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=logprobs.MAX_TOP_LOGPROBS + 1)


def test_a_wrong_row_is_caught():
    """Meta-test: taking each token's log-prob at the next node instead of its own is caught."""
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 11)
    req = type("R", (), {"params": SamplingParams(logprobs=True)})()
    tokens = torch.tensor([[3, 5, 7]])
    right = logprobs.node_logprobs([req], logits, torch.tensor([[0, 1, 2]]), tokens)
    wrong = logprobs.node_logprobs([req], logits, torch.tensor([[1, 2, 3]]), tokens)
    want = torch.log_softmax(logits[0, :3], -1).gather(1, tokens[0][:, None])[:, 0].double()
    torch.testing.assert_close(right[0, :, 0], want)
    assert not torch.allclose(wrong[0, :, 0], want)


@pytest.mark.parametrize("algorithm", ["NONE", "DDTREE"])
def test_logprobs_from_the_graph_buffers(algorithm, one_torch_thread):
    """The CUDA-graph path (static buffers, greedy walk in the graph; here capture=False on the
    CPU) hands back its logits buffer: log-probs read from it equal the full forward too."""
    from ddtree.engine.graphs.runner import CudaGraphRunner

    eng = LLM(
        None,
        speculative_algorithm=algorithm,
        device="cpu",
        dtype="float32",
        max_running_requests=2,
        speculative_ddtree_budget=8,
    )
    runner, spec = eng.engine.runner, eng.engine.spec
    runner.graphs = CudaGraphRunner(runner, capture=False, max_bs=2)
    runner.set_tree_spec(spec.algorithm, spec.budget, spec.topk_cap, spec.shadow_linear)
    runner.graphs.build()
    replays = []
    verify = runner.graphs.verify
    runner.graphs.verify = lambda rnd, tree: replays.append(1) or verify(rnd, tree)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, top_logprobs=2)
    for out in eng.generate(PROMPTS, params):
        check_against_reference(out, 2)
    assert replays


@pytest.mark.parametrize("text", ["aé日b", "hello wörld\n    def f():", "naïve — ok"])
def test_token_bytes_and_offsets_of_split_characters(text):
    """Issue 54: each token's own bytes (byte-level BPE splits `é` into 0xC3, 0xA9) join to the
    text's UTF-8, and the character offsets, fed in any chunking, index the decoded text (a token
    ending inside a character at that character)."""
    from transformers import AutoTokenizer

    from ddtree.server.logprob_format import LogprobEntry, TextOffsets, TokenBytes

    tok = AutoTokenizer.from_pretrained(default_model_paths()[0])
    table = TokenBytes(tok)
    ids = tok.encode(text, add_special_tokens=False)
    own = [table(i) for i in ids]
    assert b"".join(own) == text.encode() and any(
        len(b.decode("utf-8", "replace")) != len(b.decode("utf-8", "ignore")) for b in own
    )
    entries = [LogprobEntry(tok.decode([i]), i, 0.0, (), table(i)) for i in ids]
    whole = TextOffsets().take(entries)
    for j, (o, b) in enumerate(zip(whole, own)):
        before = b"".join(own[:j])
        assert o == len(before.decode("utf-8", "ignore"))  # complete characters before it
    for cut in range(len(entries) + 1):
        offsets = TextOffsets()
        assert offsets.take(entries[:cut]) + offsets.take(entries[cut:]) == whole
