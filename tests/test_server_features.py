"""What SGLang users reach for, over HTTP: logprobs / top_logprobs on completions and chat
(streaming and not, values equal to a plain full forward of the target), n > 1 (seed + i per choice,
usage summed), any `model` name, SGLang's native /generate and /get_model_info, and their errors and
auth."""

import json

import httpx
import openai
import pytest
import torch
from server_fixtures import build_tiny_pair, server_argv, thread_server, wait_idle

from ddtree.models.loader import load_target

KEY = "sk-feat"
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(str(tmp_path_factory.mktemp("features_pair")))


@pytest.fixture(scope="module")
def server(pair):
    with thread_server(
        server_argv(pair, "DDTREE", "--api-key", KEY, "--served-model-name", "tiny")
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    return httpx.Client(
        base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(pair):
    """(prompt ids, output ids) -> [len(output), V] log-softmax of a plain full target forward."""
    target = load_target(pair[0], torch.float32)

    def ref(prompt_ids, output_ids):
        ids = torch.tensor([list(prompt_ids) + list(output_ids[:-1])])
        with torch.no_grad():
            logits, _ = target.forward_train(ids)
        return torch.log_softmax(logits[0, len(prompt_ids) - 1 :], -1)

    return ref


def sse_events(r: httpx.Response) -> list:
    lines = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


# ---- logprobs ------------------------------------------------------------------------------------
def test_completion_logprobs_match_full_forward(server, client, reference):
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    tok = server.engine.tokenizer
    prompt_ids, out_ids = (
        tok.encode(PROMPT, add_special_tokens=False),
        tok.encode(r.choices[0].text),
    )
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == len(out_ids) == 10
    ref = reference(prompt_ids, out_ids)
    want = ref.gather(1, torch.tensor(out_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), want, rtol=0, atol=1e-4)
    top = ref.topk(2, -1)
    for j, d in enumerate(lp.top_logprobs):
        assert len(d) == 2 and lp.tokens[j] in d  # greedy: the emitted token is the top-1
        torch.testing.assert_close(
            torch.tensor(sorted(d.values(), reverse=True)), top.values[j], rtol=0, atol=1e-4
        )
    assert lp.text_offset == list(range(10))


def test_streamed_completion_logprobs_equal_the_whole(client):
    whole = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=9, temperature=0, logprobs=1
    )
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=9, temperature=0, logprobs=1, stream=True
        )
    )
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.choices[0].logprobs.tokens
    assert [v for p in parts for v in p.token_logprobs] == whole.choices[0].logprobs.token_logprobs
    assert [o for p in parts for o in p.text_offset] == whole.choices[0].logprobs.text_offset


def test_chat_logprobs_streaming_and_not(client):
    kw = dict(
        model="any-name",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert (
        "".join(c.token for c in content) == whole.choices[0].message.content and len(content) == 6
    )
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == c.logprob and bytes(c.bytes).decode() == c.token
    streamed = [
        c
        for ch in client.chat.completions.create(**kw, stream=True)
        if ch.choices and ch.choices[0].logprobs
        for c in ch.choices[0].logprobs.content
    ]
    # the streamed request reuses the first one's prompt KV from the prefix cache: the same tokens,
    # log-probs equal up to float rounding (its last prompt row is computed in a shorter prefill)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = client.chat.completions.create(**(kw | {"logprobs": None, "top_logprobs": None}))
    assert plain.choices[0].logprobs is None


# ---- n > 1 ---------------------------------------------------------------------------------------
def test_n_greedy_choices_are_equal_and_usage_sums(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1
    assert r.usage.completion_tokens == 15 and r.usage.prompt_tokens == len(PROMPT)
    assert r.usage.total_tokens == 15 + len(PROMPT)


def test_n_sampled_choices_use_seed_plus_i(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0)
    r = client.completions.create(**kw, n=4, seed=7)
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1  # independent samples
    for i in (0, 3):
        assert client.completions.create(**kw, seed=7 + i).choices[0].text == texts[i]
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=1.0,
        n=2,
        seed=1,
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_n_streaming_interleaves_choices(server, client):
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, finished = ["", ""], set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and texts[0] == texts[1] and len(texts[0]) == 6
    assert chunks[-1].usage.completion_tokens == 12
    wait_idle(server.base_url)


# ---- model names ---------------------------------------------------------------------------------
def test_any_model_name_is_served_by_the_one_model(client, http):
    for name in ("gpt-17", "tiny"):
        assert client.completions.create(model=name, prompt=PROMPT, max_tokens=2).model == "tiny"
    r = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    )
    assert r.status_code == 200 and r.json()["model"] == "tiny"  # no model named at all


# ---- native /generate ----------------------------------------------------------------------------
def test_generate_text_and_meta_info(http):
    r = http.post(
        "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 7, "temperature": 0}},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 7 and meta["completion_tokens"] == 7
    # earlier tests sent the same prompt: part of it may come from the prefix cache
    assert meta["prompt_tokens"] == len(PROMPT) and 0 <= meta["cached_tokens"] < len(PROMPT)
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert (
        meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1 and meta["e2e_latency"] > 0
    )
    # the same request through the OpenAI route gives the same text
    same = http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 7, "temperature": 0}
    ).json()
    assert same["choices"][0]["text"] == out["text"]


def test_generate_stop_string_and_token(http):
    base = http.post(
        "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    ).json()
    stop = base["text"][3:5]
    r = http.post(
        "/generate",
        json={
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop": stop},
        },
    ).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert r["text"] == base["text"][: base["text"].index(stop)]
    r = http.post(
        "/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    ).json()
    tok = r["output_ids"][1]
    r2 = http.post(
        "/generate",
        json={
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [tok]},
        },
    ).json()
    assert r2["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    assert r2["output_ids"][-1] == tok


def test_generate_batch_n_and_logprobs(http, server, reference):
    r = http.post(
        "/generate",
        json={
            "input_ids": [[1, 2, 3], [4, 5]],
            "return_logprob": True,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2},
        },
    )
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 4 and outs[0]["output_ids"] == outs[1]["output_ids"]
    for prompt, out in zip([[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]], outs):
        meta = out["meta_info"]
        lps = meta["output_token_logprobs"]
        assert [x[1] for x in lps] == out["output_ids"]
        assert "".join(x[2] for x in lps) == out["text"]
        want = reference(prompt, out["output_ids"]).gather(
            1, torch.tensor(out["output_ids"])[:, None]
        )[:, 0]
        torch.testing.assert_close(torch.tensor([x[0] for x in lps]), want, rtol=0, atol=1e-4)
        assert all(
            len(top) == 2 and top[0][1] == x[1] for top, x in zip(meta["output_top_logprobs"], lps)
        )


def test_generate_stream_is_cumulative(http):
    body = {
        "text": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    }
    whole = http.post("/generate", json=body | {"stream": False}).json()
    events = sse_events(http.post("/generate", json=body))
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_generate_stream_interleaves_choices(http):
    sp = {"max_new_tokens": 5, "temperature": 1.0, "n": 2, "sampling_seed": 3, "ignore_eos": True}
    body = {"text": PROMPT, "stream": True, "sampling_params": sp}
    events = sse_events(http.post("/generate", json=body))
    last = {e["index"]: e for e in events}
    assert set(last) == {0, 1}
    assert all(
        e["meta_info"]["finish_reason"] == {"type": "length", "length": 5} for e in last.values()
    )
    whole = http.post("/generate", json=body | {"stream": False}).json()
    assert [w["text"] for w in whole] == [last[0]["text"], last[1]["text"]]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"sampling_params": {"max_new_tokens": 2}}, "text"),
        ({"text": "a", "input_ids": [1], "sampling_params": {}}, "text"),
        ({"text": "", "sampling_params": {}}, "text"),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        ({"text": "a", "sampling_params": {"temperature": -1.0}}, "sampling_params.temperature"),
        ({"text": "a", "sampling_params": {"regex": "(a"}}, "sampling_params.regex"),
        (
            {"text": "a", "sampling_params": {"frequency_penalty": 0.5}},
            "sampling_params.frequency_penalty",
        ),
        ({"text": "a", "sampling_params": {"n": 17}}, "sampling_params.n"),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": "x"}},
            "sampling_params.max_new_tokens",
        ),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": "a", "logprob_start_len": -2}, "logprob_start_len"),
        ({"text": "ab", "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
        ({"text": "a", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
        ({"input_ids": [1, 10**6]}, "input_ids"),
    ],
)
def test_generate_bad_input_is_a_400_naming_the_field(http, server, body, param):
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert (
        http.post(
            "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}}
        ).status_code
        == 200
    )
    wait_idle(server.base_url)


def test_native_routes_need_the_key_and_model_info(server, http, pair):
    assert httpx.post(server.base_url + "/generate", json={"text": "a"}).status_code == 401
    assert httpx.get(server.base_url + "/get_model_info").status_code == 401
    info = http.get("/get_model_info").json()
    assert info["model_path"] == pair[0] and info["tokenizer_path"] == pair[0]
    assert info["is_generation"] is True and info["model_type"] == "qwen3"
    assert info["architectures"] == ["Qwen3ForCausalLM"] and info["served_model_name"] == "tiny"
    assert info["speculative_algorithm"] == "DDTREE"
