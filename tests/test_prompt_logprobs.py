"""Prompt log-probs (`SamplingParams.prompt_logprobs`) equal the target's fp32 log-softmax from a
plain full forward over the prompt, in every decoding mode, chunked or not, from a cached prefix
or not, from any start position, and with max_tokens 0 (prefill only)."""

import dataclasses
import functools

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.assets import default_model_paths
from ddtree.models.loader import load_target

PROMPT = "import json\n\n\ndef dumps(obj, *, indent=None):\n    return json.dumps(obj)\n"
TOP = 3
ATOL = 1e-5  # fp32: paged, chunked prefill vs one dense forward


@functools.lru_cache(maxsize=None)
def reference_target():
    return load_target(default_model_paths()[0], torch.float32)


def reference(prompt_ids) -> torch.Tensor:
    """[n - 1, V]: row j = the target's log-softmax after prompt[: j + 1] (predicting token j + 1)."""
    with torch.no_grad():
        logits, _ = reference_target().forward_train(torch.tensor([list(prompt_ids)]))
    return torch.log_softmax(logits[0, :-1].float(), -1)


@functools.lru_cache(maxsize=None)
def llm(algorithm: str = "DDTREE", **kw):
    return LLM(
        None,
        speculative_algorithm=algorithm,
        device="cpu",
        dtype="float32",
        max_running_requests=4,
        speculative_ddtree_budget=16,
        page_size=4,
        **kw,
    )


def check(out, start: int, k: int) -> None:
    ids = out.prompt_token_ids
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) - start
    assert entries[0] is None  # nothing predicts the first reported position
    ref = reference(ids)[start:]
    want_ids = torch.tensor(ids[start + 1 :])
    got = torch.tensor([e.logprob for e in entries[1:]], dtype=torch.float64)
    want = ref.gather(1, want_ids[:, None])[:, 0].double()
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert [e.token_id for e in entries[1:]] == want_ids.tolist()
    rank = (ref >= ref.gather(1, want_ids[:, None])).sum(-1)
    assert [e.rank for e in entries[1:]] == rank.tolist()
    top = ref.topk(k, -1) if k else None
    for j, e in enumerate(entries[1:]):
        assert len(e.top) == k
        if k:
            torch.testing.assert_close(
                torch.tensor([v for _, v in e.top]), top.values[j], rtol=0, atol=ATOL
            )


@pytest.mark.parametrize("algorithm", ["NONE", "DFLASH", "DDTREE"])
def test_prompt_logprobs_equal_a_full_forward(algorithm, one_torch_thread):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP)
    (out,) = llm(algorithm).generate([PROMPT], params)
    check(out, 0, TOP)
    assert len(out.token_ids) == 4  # generation goes on as without them


def test_max_tokens_zero_prefills_only(one_torch_thread):
    (out,) = llm().generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert out.token_ids == [] and out.finish_reason == "length" and out.text == ""
    check(out, 0, 0)


def test_chunked_prefill_and_a_start_position(one_torch_thread):
    """Chunks of 5 tokens (rows cross every chunk edge); from position 7 on (SGLang's
    logprob_start_len): entry 7 is None, then tokens 8.."""
    engine = llm(chunked_prefill_size=5)
    (out,) = engine.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    )
    check(out, 0, 2)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, prompt_logprobs_start=7)
    (out,) = engine.generate([PROMPT], params)
    check(out, 7, 2)
    last = SamplingParams(
        temperature=0,
        max_tokens=1,
        prompt_logprobs=0,
        prompt_logprobs_start=len(out.prompt_token_ids) - 1,
    )
    (out,) = engine.generate([PROMPT], last)
    assert out.prompt_logprobs == [None]


def test_a_cached_prefix_keeps_its_logprobs(one_torch_thread):
    """The prompt's pages are cached by a first request; one asking for prompt log-probs from
    position s takes at most s cached tokens and recomputes the rest: the same numbers as from
    an empty cache; one that asks for none takes the whole prefix."""
    engine = llm(algorithm="DDTREE", disable_radix_cache=False)
    prompt = PROMPT + "# the same prefix\n"
    (first,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    n = len(first.prompt_token_ids)
    (plain,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    assert plain.cached_tokens >= n - 4  # all but the last (partial) page
    (out,) = engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP)
    )
    assert out.cached_tokens == 0
    check(out, 0, TOP)
    params = SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=TOP, prompt_logprobs_start=10
    )
    (out,) = engine.generate([prompt], params)
    assert 0 < out.cached_tokens <= 10
    check(out, 10, TOP)
    assert out.token_ids == plain.token_ids


def test_not_computed_unless_asked(one_torch_thread):
    (out,) = llm().generate([PROMPT], SamplingParams(max_tokens=2))
    assert out.prompt_logprobs is None


@pytest.mark.parametrize(
    "kw",
    [
        {"prompt_logprobs": 21},
        {"prompt_logprobs": -1},
        {"prompt_logprobs_start": -1},
        {"max_tokens": -1},
    ],
)
def test_params_validate(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_a_start_past_the_prompt_is_refused(one_torch_thread):
    params = SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=10**6
    )
    with pytest.raises(ValueError, match="prompt_logprobs_start"):
        llm().engine.add_request(PROMPT, params)


def test_hybrid_target_with_chunks_and_a_checkpointed_prefix(tmp_path, one_torch_thread):
    """A hybrid (Gated DeltaNet) target: chunks end on page boundaries and a cached prefix restores
    a recurrent-state checkpoint; the rows still equal a full forward."""
    from server_fixtures import build_tiny_hybrid_pair

    target, drafter = build_tiny_hybrid_pair(str(tmp_path))
    engine = LLM(
        target,
        speculative_algorithm="DDTREE",
        speculative_draft_model_path=drafter,
        speculative_ddtree_budget=6,
        device="cpu",
        dtype="float32",
        page_size=4,
        chunked_prefill_size=6,
    )
    ref_model = load_target(target, torch.float32)
    prompt = list(range(3, 40))
    with torch.no_grad():
        logits, _ = ref_model.forward_train(torch.tensor([prompt]))
    ref = torch.log_softmax(logits[0, :-1], -1)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    (plain,) = engine.generate([prompt], greedy)
    for start in (0, 13):
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
        params = dataclasses.replace(params, prompt_logprobs_start=start)
        (out,) = engine.generate([prompt], params)
        assert out.cached_tokens <= start and out.token_ids == plain.token_ids
        got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
        want = ref[start:].gather(1, torch.tensor(prompt[start + 1 :])[:, None])[:, 0]
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    (again,) = engine.generate([prompt], greedy)
    assert again.cached_tokens > 13  # the plain request still takes the whole cached prefix


def test_rows_are_reduced_in_bounded_slices(monkeypatch):
    """At most ROW_ELEMENTS logits exist at once (here 3 rows of a 50-token vocabulary); the
    slices give the numbers one pass over every row gives."""
    from ddtree.engine.round import prompt_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden, targets = torch.randn(10, 8), torch.randint(0, 50, (10,))
    seen = []

    def logits_of(h):
        seen.append(h.shape[0])
        return head(h)

    whole = prompt_logprobs.row_logprobs(hidden, targets, logits_of, 4, 50)
    monkeypatch.setattr(prompt_logprobs, "ROW_ELEMENTS", 3 * 50)
    seen.clear()
    sliced = prompt_logprobs.row_logprobs(hidden, targets, logits_of, 4, 50)
    assert seen == [3, 3, 3, 1]
    torch.testing.assert_close(sliced, whole, rtol=0, atol=1e-6)  # fp32 matmuls of other sizes
    lp = torch.log_softmax(head(hidden), -1).double()
    torch.testing.assert_close(sliced[:, 0], lp.gather(1, targets[:, None])[:, 0])
    assert sliced[:, 1].tolist() == (lp >= lp.gather(1, targets[:, None])).sum(-1).tolist()


def test_a_batch_that_asks_runs_eager_the_others_graphed(one_torch_thread):
    """With extend graphs (the padded static-buffer path without a capture, as on a GPU): a prefill
    batch with prompt log-prob rows runs the eager extend (the graphs keep only the last row's
    logits), a later one without any replays; the rows equal a full forward."""
    from ddtree.engine.graphs.runner import CudaGraphRunner

    engine = llm("NONE")  # its CPU runner, with the graphs' static-buffer path for this test
    runner = engine.engine.runner
    g = runner.graphs = CudaGraphRunner(runner, capture=False, max_bs=2, extend_widths=(16,))
    try:
        g.build()
        run, calls = g.extend.run, []
        g.extend.run = lambda width, host, lens: (calls.append(width), run(width, host, lens))[1]
        plain = SamplingParams(temperature=0, max_tokens=2)
        asking = dataclasses.replace(plain, prompt_logprobs=1)
        short = "def f(x):"  # one extend pass
        (out, other) = engine.generate([short, short + " pass"], [asking, plain])
        assert calls == []  # the batch asked: eager
        check(out, 0, 1)
        engine.generate([short + " return"], plain)
        assert calls  # none asked: graphed
    finally:
        runner.graphs = None
