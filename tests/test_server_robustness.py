"""Bad input, disconnects and engine failures: each gets a 4xx/5xx OpenAI-style error naming the field, the
server stays up (the next request succeeds), and no KV page or request slot is left behind."""

import json
import re
import time

import httpx
import openai
import pytest
from server_fixtures import (
    build_tiny_pair,
    server_argv,
    server_info,
    thread_server,
    wait_idle,
    wait_running,
)

MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(str(tmp_path_factory.mktemp("robust_pair")))


@pytest.fixture(scope="module")
def server(pair):
    with thread_server(
        server_argv(pair, "DDTREE", "--api-key", "sk-test"), max_body_bytes=MAX_BODY
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    return httpx.Client(
        base_url=server.base_url, timeout=60, headers={"Authorization": "Bearer sk-test"}
    )


def ok_request(http, pair):
    r = http.post(
        "/v1/completions",
        json={"model": pair[0], "prompt": "ok", "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def assert_error(r, status, param, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param:
        assert param in err["message"]
    if code:
        assert err["code"] == code


CONTEXT = 512
BAD_COMPLETIONS = {  # name: (body patch, status, param, code)
    "wrong type max_tokens": ({"max_tokens": "many"}, 400, "max_tokens", "invalid_type"),
    "wrong type temperature": ({"temperature": "hot"}, 400, "temperature", "invalid_type"),
    "wrong type prompt": ({"prompt": 123}, 400, "prompt", None),
    "wrong type stop": ({"stop": 5}, 400, "stop", None),
    "wrong type stream": ({"stream": "sometimes"}, 400, "stream", "invalid_type"),
    "bool as max_tokens": ({"max_tokens": True}, 400, "max_tokens", "invalid_type"),
    "fractional max_tokens": ({"max_tokens": 2.5}, 400, "max_tokens", "invalid_type"),
    "string as top_p": ({"top_p": "0.5"}, 400, "top_p", "invalid_type"),
    "wrong type stop_token_ids": (
        {"stop_token_ids": ["x"]},
        400,
        "stop_token_ids.0",
        "invalid_type",
    ),
    "wrong type stream_options": (
        {"stream_options": {"include_usage": "yes"}},
        400,
        "stream_options.include_usage",
        "invalid_type",
    ),
    "missing prompt": ({"prompt": None}, 400, "prompt", None),
    "empty prompt": ({"prompt": ""}, 400, "prompt", "invalid_value"),
    "empty token prompt": ({"prompt": []}, 400, "prompt", "invalid_value"),
    "token out of vocab": ({"prompt": [1, 2, 100000]}, 400, "prompt", "invalid_value"),
    "empty prompt in a list": ({"prompt": ["a", ""]}, 400, "prompt.1", "invalid_value"),
    "prompt too long": ({"prompt": "x" * (CONTEXT + 10)}, 400, "prompt", "context_length_exceeded"),
    "max_tokens zero": ({"max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    "max_tokens negative": ({"max_tokens": -5}, 400, "max_tokens", "invalid_value"),
    "max_tokens too large": ({"max_tokens": 10**6}, 400, "max_tokens", "context_length_exceeded"),
    "temperature negative": ({"temperature": -0.1}, 400, "temperature", "invalid_value"),
    "top_p zero": ({"top_p": 0}, 400, "top_p", "invalid_value"),
    "top_p above one": ({"top_p": 1.5}, 400, "top_p", "invalid_value"),
    "top_k below -1": ({"top_k": -3}, 400, "top_k", "invalid_value"),
    "n above the limit": ({"n": 17}, 400, "n", "invalid_value"),
    "n zero": ({"n": 0}, 400, "n", "invalid_value"),
    "best_of": ({"best_of": 3}, 400, "best_of", "unsupported_parameter"),
    "logprobs above the limit": ({"logprobs": 21}, 400, "logprobs", "invalid_value"),
    "logprobs negative": ({"logprobs": -1}, 400, "logprobs", "invalid_value"),
    "empty stop string": ({"stop": ["", "x"]}, 400, "stop", "invalid_value"),
    "negative seed": ({"seed": -1}, 400, "seed", "invalid_value"),
}


@pytest.mark.parametrize("case", list(BAD_COMPLETIONS))
def test_bad_completion_request(http, pair, case):
    patch, status, param, code = BAD_COMPLETIONS[case]
    body = {"model": pair[0], "prompt": "hello", "max_tokens": 4} | patch
    body = {k: v for k, v in body.items() if v is not None}
    assert_error(http.post("/v1/completions", json=body), status, param, code)
    ok_request(http, pair)


BAD_CHATS = {
    "messages not a list": ({"messages": "hi"}, 400, "messages", None),
    "message without role": (
        {"messages": [{"content": "hi"}]},
        400,
        "messages.0.role",
        "missing_required_parameter",
    ),
    "unknown role": (
        {"messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages.0.role",
        "invalid_type",
    ),
    "image content part": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages.0.content",
        "invalid_type",
    ),
    "empty messages": ({"messages": []}, 400, "messages", "invalid_value"),
    "chat n above the limit": ({"n": 17}, 400, "n", "invalid_value"),
    "chat top_logprobs above the limit": (
        {"logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "invalid_value",
    ),
    "chat top_logprobs without logprobs": (
        {"top_logprobs": 2},
        400,
        "top_logprobs",
        "invalid_value",
    ),
    "chat max_tokens zero": ({"max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    "chat too long": (
        {"messages": [{"role": "user", "content": "y" * CONTEXT}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CHATS))
def test_bad_chat_request(http, pair, case):
    patch, status, param, code = BAD_CHATS[case]
    body = {
        "model": pair[0],
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    } | patch
    assert_error(http.post("/v1/chat/completions", json=body), status, param, code)
    ok_request(http, pair)


@pytest.mark.parametrize(
    "raw", [b"{not json", b'{"prompt": "x", ', b"[1, 2, 3]", b"", b"\xff\xfe", b"null"]
)
def test_malformed_json(http, pair, raw):
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok_request(http, pair)


def test_oversized_body(http, pair):
    r = http.post("/v1/completions", json={"model": pair[0], "prompt": "z" * (MAX_BODY + 1)})
    assert_error(r, 413, None, "request_too_large")

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024

    assert_error(http.post("/v1/completions", content=chunks()), 413, None, "request_too_large")
    ok_request(http, pair)


def test_api_key_and_unknown_route(server, http, pair):
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"})
    assert_error(r, 401, None, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=server.base_url + "/v1", api_key="wrong", max_retries=0
        ).models.list()
    assert_error(http.get("/v1/nothing-here"), 404, None)
    assert httpx.get(server.base_url + "/health").status_code == 200  # health needs no key
    ok_request(http, pair)


def generated_tokens(http) -> float:
    return float(
        re.search(r"^ddtree_generation_tokens_total (\S+)$", http.get("/metrics").text, re.M).group(
            1
        )
    )


def aborted(http) -> float:
    m = re.search(
        r'^ddtree_requests_total\{finish_reason="abort"\} (\S+)$', http.get("/metrics").text, re.M
    )
    return float(m.group(1)) if m else 0.0


def assert_pools_idle(base_url):
    info = wait_idle(base_url, timeout=10)
    assert info["kv_pages_free"] == info["kv_pages_total"]
    assert info["request_slots_free"] == info["request_slots_total"]
    assert info["state_pool_slots_free"] == info["state_pool_slots_total"]
    assert info["kv_integrity"] == "ok"


def test_client_disconnect_mid_stream_frees_kv(server, http, pair):
    idle = server_info(server.base_url)
    before_abort, before_tokens = aborted(http), generated_tokens(http)
    body = {
        "model": pair[0],
        "prompt": "stream me",
        "max_tokens": 480,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        busy = wait_running(server.base_url)
        assert busy["kv_pages_free"] < idle["kv_pages_free"]
    t0 = time.monotonic()
    assert_pools_idle(server.base_url)
    freed_after = time.monotonic() - t0
    assert aborted(http) == before_abort + 1
    assert generated_tokens(http) - before_tokens < 480, (
        "the request ran to completion instead of aborting"
    )
    assert freed_after < 5
    ok_request(http, pair)


def test_client_disconnect_non_streaming_frees_kv(server, http, pair):
    before = aborted(http)
    body = {
        "model": pair[0],
        "prompt": "wait for me",
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=0.3)
    assert_pools_idle(server.base_url)
    assert aborted(http) == before + 1
    ok_request(http, pair)


def test_engine_exception_fails_requests_not_the_server(server, http, pair, monkeypatch):
    decoder = server.engine.decoder
    real = decoder.round
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("injected verify failure")
        return real(*a, **kw)

    monkeypatch.setattr(decoder, "round", flaky)
    body = {"model": pair[0], "prompt": "boom", "max_tokens": 8, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert_error(r, 500, None, "engine_error")
    assert "injected verify failure" in r.json()["error"]["message"]
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
        events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert s.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert_pools_idle(server.base_url)
    ok_request(http, pair)
    assert server.async_engine.alive
