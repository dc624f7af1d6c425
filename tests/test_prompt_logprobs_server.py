"""Prompt log-probs and prompt lists over HTTP: `/v1/completions` with `echo` + `logprobs`
(max_tokens 0 too), vLLM's `prompt_logprobs` (completions and chat), SGLang's `return_logprob` with
`logprob_start_len` on `/generate`; a list of prompts (strings or token ids) answered as each alone,
indexed prompt x n + choice, streamed or not, through the `openai` SDK too. Values equal a plain
full forward of the target and a NONE-mode server's, from a cached prefix or not."""

import json

import httpx
import openai
import pytest
import torch
from server_fixtures import build_tiny_pair, server_argv, thread_server

from ddtree.models.loader import load_target
from ddtree.server.limits import MAX_BATCH_REQUESTS

PROMPT = "def add(a, b): return a"  # the char tokenizer: one token per character
ATOL = 1e-5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(str(tmp_path_factory.mktemp("prompt_lp_pair")))


@pytest.fixture(scope="module")
def server(pair):
    with thread_server(server_argv(pair, "DDTREE", "--page-size", "4")) as srv:
        yield srv


@pytest.fixture(scope="module")
def none_server(pair):
    with thread_server(server_argv(pair, "NONE", "--disable-radix-cache")) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    return httpx.Client(base_url=server.base_url, timeout=60)


@pytest.fixture(scope="module")
def reference(pair):
    """prompt ids -> [n - 1, V]: row j the target's log-softmax predicting token j + 1."""
    target = load_target(pair[0], torch.float32)

    def ref(ids):
        with torch.no_grad():
            logits, _ = target.forward_train(torch.tensor([list(ids)]))
        return torch.log_softmax(logits[0, :-1], -1)

    return ref


def ids_of(text: str) -> list[int]:
    from server_fixtures import CHARS

    return [CHARS.index(c) for c in text]


def completion(http, **body) -> dict:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0} | body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(r) -> list:
    lines = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_echo_logprobs_with_max_tokens_zero(http, none_server, reference):
    out = completion(http, echo=True, logprobs=2, max_tokens=0)
    (choice,) = out["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == list(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference(ids_of(PROMPT))
    want = ref.gather(1, torch.tensor(ids_of(PROMPT)[1:])[:, None])[:, 0]
    torch.testing.assert_close(
        torch.tensor(lp["token_logprobs"][1:]), want, rtol=0, atol=ATOL, check_dtype=False
    )
    for j, top in enumerate(lp["top_logprobs"][1:]):  # the top 2 and the prompt token itself
        assert len(top) in (2, 3) and PROMPT[j + 1] in top
        assert max(top.values()) == pytest.approx(ref[j].max().item(), abs=ATOL)
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len(PROMPT)
    # the same numbers as a no-speculation server's
    base = completion(
        httpx.Client(base_url=none_server.base_url, timeout=60), echo=True, logprobs=2, max_tokens=0
    )
    torch.testing.assert_close(
        torch.tensor(lp["token_logprobs"][1:]),
        torch.tensor(base["choices"][0]["logprobs"]["token_logprobs"][1:]),
        rtol=0,
        atol=ATOL,
    )


def test_echo_with_generation(http):
    plain = completion(http, logprobs=1, max_tokens=5, ignore_eos=True)["choices"][0]
    echoed = completion(http, echo=True, logprobs=1, max_tokens=5, ignore_eos=True)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    lp, plp = echoed["logprobs"], plain["logprobs"]
    n = len(PROMPT)
    assert lp["tokens"] == list(PROMPT) + plp["tokens"]
    assert lp["token_logprobs"][n:] == plp["token_logprobs"]
    assert lp["text_offset"][:2] == [0, 1] and lp["text_offset"][n] == n
    assert completion(http, echo=True, max_tokens=2)["choices"][0]["text"].startswith(PROMPT)


def test_echo_streamed(http):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "stream": True}
    chunks = sse(http.post("/v1/completions", json=body | {"temperature": 0, "ignore_eos": True}))
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    whole = completion(http, echo=True, logprobs=1, max_tokens=3, ignore_eos=True)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]
    zero = sse(http.post("/v1/completions", json=body | {"max_tokens": 0}))
    assert zero[0]["choices"][0]["text"] == PROMPT
    assert zero[-1]["choices"][0]["finish_reason"] == "length"


def test_prompt_list_equals_single_sends(http):
    """Strings and token-id lists, n = 2 with a seed: choice p x n + c is prompt p's choice c
    sent alone; usage adds the prompts once each."""
    prompts = [PROMPT, "class A:", "x = 1"]
    body = {"temperature": 0.9, "seed": 7, "n": 2, "max_tokens": 6, "logprobs": 1}
    for batch in (prompts, [ids_of(p) for p in prompts]):
        out = completion(http, **body | {"prompt": batch})
        assert [c["index"] for c in out["choices"]] == list(range(6))
        total = 0
        for p, one in enumerate(batch):
            alone = completion(http, **body | {"prompt": one})
            for c in range(2):
                got, want = out["choices"][p * 2 + c], alone["choices"][c]
                assert got["text"] == want["text"]
                # batched with the others: the same tokens, log-probs to fp32 rounding
                assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
                torch.testing.assert_close(
                    torch.tensor(got["logprobs"]["token_logprobs"]),
                    torch.tensor(want["logprobs"]["token_logprobs"]),
                    rtol=0,
                    atol=ATOL,
                )
            total += alone["usage"]["total_tokens"]
        assert out["usage"]["total_tokens"] == total
        assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_prompt_list_streamed(http):
    prompts = ["class A:", "x = 1"]
    body = {"prompt": prompts, "n": 2, "seed": 3, "max_tokens": 5, "stream": True}
    body |= {"temperature": 1.0}
    body |= {"stream_options": {"include_usage": True}}
    chunks = sse(http.post("/v1/completions", json=body))
    texts = {}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    whole = completion(
        http, **{k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
    )
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize(
    "prompt, param",
    [
        (["a"] * (MAX_BATCH_REQUESTS // 2 + 1), "prompt"),  # x n = 2: over the bound
        (["a", ""], "prompt.1"),
        ([[1, 2], []], "prompt.1"),
        ([[1, 2], [1, 10**6]], "prompt.1"),
    ],
)
def test_prompt_list_bad_input_names_the_field(http, prompt, param):
    r = http.post("/v1/completions", json={"prompt": prompt, "n": 2, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_vllm_prompt_logprobs_with_a_cache_hit(http, reference):
    """The prompt's pages cached first; prompt_logprobs then recompute them (cached_tokens 0):
    the same numbers as a full forward, the prompt token's rank and the top-k ranks 1..k."""
    prompt = PROMPT + " + b  # cached"
    for _ in range(2):
        completion(http, prompt=prompt, max_tokens=1)
    again = completion(http, prompt=prompt, max_tokens=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    out = completion(http, prompt=prompt, max_tokens=1, prompt_logprobs=2)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    entries = out["choices"][0]["prompt_logprobs"]
    ids = ids_of(prompt)
    ref = reference(ids)
    assert entries[0] is None and len(entries) == len(ids)
    for j, pos in enumerate(entries[1:]):
        tok = pos[str(ids[j + 1])]
        assert tok["logprob"] == pytest.approx(ref[j, ids[j + 1]].item(), abs=ATOL)
        assert tok["rank"] == int((ref[j] >= ref[j, ids[j + 1]]).sum())
        assert tok["decoded_token"] == prompt[j + 1]
        ranks = sorted(v["rank"] for k, v in pos.items() if k != str(ids[j + 1]))
        assert ranks in ([1, 2], [1], [2])  # the prompt token may be one of the top 2
    assert out["choices"][0]["text"] == again["choices"][0]["text"]


def test_generate_input_logprobs(http, server, reference):
    """SGLang: from logprob_start_len s, [[None, id, text], [lp, id, text], ...]; a batch of
    token-id lists returns a list; -1 gives the last prompt token alone; a start past the
    prompt is a 400; with s a cached prefix of at most s tokens is taken."""
    ids = ids_of(PROMPT)
    ref = reference(ids)
    body = {"input_ids": ids, "return_logprob": True, "return_text_in_logprobs": True}
    body |= {"top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 0}}
    for s in (0, 9):
        meta = http.post("/generate", json=body | {"logprob_start_len": s}).json()["meta_info"]
        got = meta["input_token_logprobs"]
        assert got[0] == [None, ids[s], PROMPT[s]] and len(got) == len(ids) - s
        assert meta["input_top_logprobs"][0] is None
        for j, (lp, tok, text) in enumerate(got[1:], start=s):
            assert tok == ids[j + 1] and text == PROMPT[j + 1]
            assert lp == pytest.approx(ref[j, tok].item(), abs=ATOL)
            assert meta["input_top_logprobs"][j + 1 - s][0][0] == pytest.approx(
                ref[j].max().item(), abs=ATOL
            )
        assert meta["completion_tokens"] == 0 and meta["cached_tokens"] <= s
    batch = body | {"input_ids": [ids, ids[:5]], "logprob_start_len": 0}
    outs = http.post("/generate", json=batch).json()
    assert isinstance(outs, list) and len(outs[1]["meta_info"]["input_token_logprobs"]) == 5
    meta = http.post("/generate", json=body | {"sampling_params": {"max_new_tokens": 2}}).json()
    assert meta["meta_info"]["input_token_logprobs"] == [[None, ids[-1], PROMPT[-1]]]
    stream = http.post("/generate", json=body | {"logprob_start_len": 3, "stream": True})
    last = sse(stream)[-1]["meta_info"]
    assert last["input_token_logprobs"] == meta_at(http, body | {"logprob_start_len": 3})
    r = http.post("/generate", json=body | {"logprob_start_len": len(ids)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len"


def meta_at(http, body) -> list:
    return http.post("/generate", json=body).json()["meta_info"]["input_token_logprobs"]


def test_chat_prompt_logprobs_and_refusals(http):
    msgs = [{"role": "user", "content": "hi"}]
    r = http.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "prompt_logprobs": 1}
    )
    out = r.json()
    assert r.status_code == 200, r.text
    assert (
        out["prompt_logprobs"][0] is None
        and len(out["prompt_logprobs"]) == out["usage"]["prompt_tokens"]
    )
    for body, param in (
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ):
        r = http.post("/v1/completions", json={"prompt": PROMPT} | body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_openai_sdk_list_prompt_and_echo(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(
        model="m", prompt=["class A:", PROMPT], max_tokens=3, n=2, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: choices of a prompt agree
    scored = client.completions.create(
        model="m", prompt=[PROMPT, "x = 1"], max_tokens=0, echo=True, logprobs=0, temperature=0
    )
    assert [c.text for c in scored.choices] == [PROMPT, "x = 1"]
    assert scored.choices[1].logprobs.token_logprobs[0] is None
    assert all(v < 0 for v in scored.choices[1].logprobs.token_logprobs[1:])
