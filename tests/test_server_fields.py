"""Issue 39 item 5: no silently ignored fields. On every route (completions, chat, /generate) a
vLLM / SGLang field that changes the output is honoured or refused with a 400 naming it
(server/request_fields.py); a field nobody knows is ignored with a warning. HEAD answers where GET
does, a trailing slash is served without a redirect (none echoes the Host header), and two
Authorization headers are a 401. In-process requests (the served app, no socket); ~10 s."""

import logging

import httpx
import pytest
from fastapi.testclient import TestClient
from server_fixtures import build_tiny_pair, server_argv, thread_server, wait_idle

from ddtree.server import request_fields

KEY = "sk-fields"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "def add(a, b):"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(str(tmp_path_factory.mktemp("fields_pair")))


@pytest.fixture(scope="module")
def server(pair):
    with thread_server(server_argv(pair, "DDTREE", "--api-key", KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def asgi(server):
    return TestClient(server.app, raise_server_exceptions=False, headers=AUTH)


def completion(asgi, **body):
    r = asgi.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4} | body)
    return r


def chat(asgi, **body):
    return asgi.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 4} | body)


def generate(asgi, sp=None, **body):
    return asgi.post("/generate", json={"text": PROMPT, "sampling_params": sp or {}} | body)


def assert_refused(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "unsupported_parameter", err
    assert param in err["message"]


# ---- refused: output-changing fields of vLLM's and SGLang's request models
# vLLM CompletionRequest / ChatCompletionRequest and SGLang's, with a value that changes the output
REFUSED_SAMPLING = {
    "use_beam_search": True,
    "length_penalty": 0.5,
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "logits_processors": ["pkg.proc"],
    "custom_logit_processor": "{}",
    "custom_params": {"a": 1},
    "stop_regex": "a+",
    "watermarking": True,
    "repetition_detection": {"max_pattern_size": 4},
    "truncate_prompt_tokens": 5,
    "prompt_embeds": "AAAA",
    "cache_salt": "salt",
    "logprob_token_ids": [3],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "return_hidden_states": True,
    "return_routed_experts": True,
    "return_cached_tokens_details": True,
    "lora_path": "adapter",
    "session_params": {"id": "s"},
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"k": 1},
    "bootstrap_host": "h",
    "priority": 1,
}
REFUSED_CHAT_ONLY = {
    "echo": True,
    "chat_template": "{{ messages }}",
    "documents": [{"title": "t", "text": "x"}],
    "mm_processor_kwargs": {"a": 1},
    "input_ids": [1, 2, 3],
    "return_prompt_text": True,
}


def test_the_refusal_tables_cover_the_cases():
    assert set(REFUSED_SAMPLING) <= set(request_fields.SAMPLING_REFUSED)
    assert set(REFUSED_CHAT_ONLY) <= set(request_fields.CHAT_REFUSED)
    # and the grammar / tool / reasoning fields stay with the grammar work (issue 41)
    for name in ("guided_json", "structured_outputs", "response_format", "tools", "regex"):
        assert name not in request_fields.CHAT_REFUSED and name not in request_fields.HARMLESS


@pytest.mark.parametrize("name", list(REFUSED_SAMPLING))
def test_output_changing_completion_field_is_refused(server, asgi, name):
    assert_refused(completion(asgi, **{name: REFUSED_SAMPLING[name]}), name)
    assert_refused(chat(asgi, **{name: REFUSED_SAMPLING[name]}), name)


@pytest.mark.parametrize("name", list(REFUSED_CHAT_ONLY))
def test_output_changing_chat_field_is_refused(server, asgi, name):
    assert_refused(chat(asgi, **{name: REFUSED_CHAT_ONLY[name]}), name)


def test_neutral_values_of_refused_fields_are_accepted(server, asgi):
    neutral = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "bad_words": [],
        "priority": 0,
        "return_token_ids": False,
        "truncate_prompt_tokens": None,
        "best_of": 1,
        "echo": False,
    }
    assert completion(asgi, **neutral).status_code == 200
    assert chat(asgi, **neutral).status_code == 200
    wait_idle(server.base_url)


@pytest.mark.parametrize(
    "sp, param",
    [
        ({"stop_regex": "a+"}, "sampling_params.stop_regex"),
        ({"logit_bias": {"1": 2.0}}, "sampling_params.logit_bias"),
        ({"min_new_tokens": 2}, "sampling_params.min_new_tokens"),
        ({"custom_params": {"a": 1}}, "sampling_params.custom_params"),
        ({"spaces_between_special_token": False}, "sampling_params.spaces_between_special_token"),
        ({"max_tokens": 5}, "sampling_params.max_tokens"),  # the OpenAI name, not SGLang's
    ],
)
def test_generate_sampling_params_refuses_what_it_cannot_honour(asgi, sp, param):
    """As SGLang, whose SamplingParams takes no other key: a misspelt key is a 400, not a default."""
    assert_refused(generate(asgi, sp), param)


@pytest.mark.parametrize(
    "field, value",
    [
        ("image_data", "http://x/img.png"),
        ("lora_path", "adapter"),
        ("return_hidden_states", True),
        ("token_ids_logprob", [1]),
        ("session_params", {"id": "s"}),
        ("input_embeds", [[0.0]]),
    ],
)
def test_generate_refuses_top_level_fields_it_cannot_honour(asgi, field, value):
    assert_refused(generate(asgi, {"max_new_tokens": 2}, **{field: value}), field)


def test_unknown_fields_are_ignored_with_a_warning(server, asgi, caplog):
    request_fields.UNKNOWN_LOG.clear()
    with caplog.at_level(logging.WARNING, logger="ddtree"):
        r = completion(asgi, frobnicate=3)
        assert r.status_code == 200, r.text
        assert generate(asgi, {"max_new_tokens": 2}, frobnicate=3).status_code == 200
        # harmless known fields pass without one
        assert completion(asgi, request_id="r-1", stream_interval=2).status_code == 200
    warned = [rec.getMessage() for rec in caplog.records if "frobnicate" in rec.getMessage()]
    assert len(warned) == 2 and "/v1/completions" in warned[0] and "/generate" in warned[1]
    assert not any("request_id" in rec.getMessage() for rec in caplog.records)
    wait_idle(server.base_url)


# ---- honoured
def base_text(asgi, **extra):
    r = completion(asgi, max_tokens=16, temperature=0, ignore_eos=True, **extra)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_include_stop_str_in_output_on_every_route(server, asgi):
    full = base_text(asgi)["text"]
    stop = full[5:7]
    cut = full.index(stop)
    assert base_text(asgi, stop=[stop])["text"] == full[:cut]
    for keep in ({"include_stop_str_in_output": True}, {"no_stop_trim": True}):
        got = base_text(asgi, stop=[stop], **keep)
        assert got["text"] == full[: cut + len(stop)] and got["finish_reason"] == "stop", keep
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": stop}
    native = generate(asgi, sp | {"no_stop_trim": True}).json()
    assert native["text"] == full[: cut + len(stop)]
    assert native["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert generate(asgi, sp).json()["text"] == full[:cut]
    wait_idle(server.base_url)


def test_detokenization_fields_reach_the_engine_on_every_route(server, asgi, monkeypatch):
    """skip_special_tokens / spaces_between_special_tokens / include_stop_str_in_output arrive in
    the engine's SamplingParams from each route (their effect on the text:
    tests/test_output_fields.py)."""
    seen = []
    real = server.engine.add_request
    monkeypatch.setattr(
        server.engine, "add_request", lambda ids, p, **k: seen.append(p) or real(ids, p, **k)
    )
    flags = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    assert completion(asgi, include_stop_str_in_output=True, **flags).status_code == 200
    assert chat(asgi, no_stop_trim=True, **flags).status_code == 200
    assert generate(asgi, {"max_new_tokens": 2, "no_stop_trim": True} | flags).status_code == 200
    assert completion(asgi).status_code == 200  # the defaults
    assert len(seen) == 4
    for p in seen[:3]:
        assert p.include_stop_str_in_output and not p.skip_special_tokens
        assert not p.spaces_between_special_tokens
    d = seen[3]
    assert not d.include_stop_str_in_output and d.skip_special_tokens
    assert d.spaces_between_special_tokens
    wait_idle(server.base_url)


def test_chat_template_flags_are_honoured(server, asgi):
    def prompt_tokens(**kw):
        r = chat(asgi, **kw)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    with_prompt = prompt_tokens()  # "[user]hi\n[assistant]"
    assert prompt_tokens(add_generation_prompt=False) == with_prompt - len("[assistant]")
    msgs = MSG + [{"role": "assistant", "content": "Sure"}]
    # the last message left open: "[user]hi\n[assistant]Sure" without its newline
    assert prompt_tokens(
        messages=msgs, add_generation_prompt=False, continue_final_message=True
    ) == len("[user]hi\n[assistant]Sure")
    r = chat(asgi, continue_final_message=True)  # with add_generation_prompt's default true
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    wait_idle(server.base_url)


# ---- HEAD, redirects, Authorization
GETS = ["/health", "/v1/models", "/get_model_info", "/get_server_info", "/metrics", "/docs"]


@pytest.mark.parametrize("path", GETS)
def test_head_answers_where_get_does(server, asgi, path):
    get, head = asgi.get(path), asgi.head(path)
    assert get.status_code == 200 and head.status_code == 200, (path, head.text)
    wire = httpx.head(server.base_url + path, headers=AUTH, timeout=30)  # uvicorn sends no body
    assert wire.status_code == 200 and wire.content == b""
    assert head.headers.get("content-type") == get.headers.get("content-type")
    assert asgi.head(path, headers={"Authorization": "Bearer wrong"}).status_code == (
        200 if path == "/health" else 401
    )
    assert asgi.head("/no-such-route").status_code == 404


@pytest.mark.parametrize("path", ["/v1/models/", "/health/", "/get_model_info//"])
def test_trailing_slash_is_served_without_a_redirect(asgi, path):
    r = asgi.get(path, headers={"Host": "evil.example"}, follow_redirects=False)
    assert r.status_code == 200 and "location" not in r.headers, (r.status_code, r.headers)
    missing = asgi.get("/nope/", headers={"Host": "evil.example"}, follow_redirects=False)
    assert missing.status_code == 404 and "evil.example" not in missing.text
    assert "location" not in missing.headers


def test_trailing_slash_post_is_served(server, asgi):
    r = asgi.post("/v1/completions/", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, r.text
    wait_idle(server.base_url)


def test_two_authorization_headers_are_a_401(server):
    anon = TestClient(server.app, raise_server_exceptions=False)
    for pair in ([AUTH["Authorization"]] * 2, [AUTH["Authorization"], "Bearer wrong"]):
        headers = [("Authorization", v) for v in pair]
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            r = anon.request(method, path, headers=headers, json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert anon.get("/v1/models", headers=AUTH).status_code == 200
