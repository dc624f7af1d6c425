"""Issue 54 items 2, 4, 5 and 7 over HTTP, on one server (the embedded pair, AR, fp32,
`--reasoning-parser qwen3`): JSON the server parses out of a string is bounded (nested thousands
deep: a 400 naming the field, never a RecursionError 500); the reasoning parser keeps an answer
without a think block byte for byte (null reasoning on /generate); unknown fields are bounded per
request and warned about with bounded state; log-prob `bytes` and `text_offset` of tokens that
split a UTF-8 character (byte-level BPE: `é` is two tokens). Grammars force the outputs, so the
random model's text is known. ~15 s."""

import json
import logging
import os

import httpx
import pytest
from server_fixtures import server_argv, thread_server, wait_idle

from ddtree.assets import PACKAGE_PAIR
from ddtree.server import limits, request_fields

DEEP = "[" * 5000 + "]" * 5000
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    pair = (os.path.join(PACKAGE_PAIR, "target"), os.path.join(PACKAGE_PAIR, "drafter"))
    with thread_server(server_argv(pair, "NONE", "--reasoning-parser", "qwen3")) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def post(http, path_body: tuple[str, dict]) -> httpx.Response:
    return http.post(path_body[0], json=path_body[1])


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def refused(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


# ---- item 2: JSON inside strings, bounded -------------------------------------------------------
def call(path: str, body: dict) -> tuple[str, dict]:
    base = {"max_tokens": 2}
    if path == "/generate":
        base = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    elif path.endswith("chat/completions"):
        base |= {"messages": USER}
    else:
        base |= {"prompt": "hi"}
    return path, base | body


NESTED = {
    "json_schema": call("/v1/completions", {"json_schema": DEEP}),
    "guided_json": call("/v1/completions", {"guided_json": DEEP}),
    "structured_outputs.json": call("/v1/chat/completions", {"structured_outputs": {"json": DEEP}}),
    "sampling_params.json_schema": call(
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "json_schema": DEEP}},
    ),
    "messages.1.tool_calls.0.function.arguments": call(
        "/v1/chat/completions",
        {
            "messages": USER
            + [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": DEEP},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "1"},
            ]
        },
    ),
    # an object from the body: nested under Python's recursion limit, over the bound
    "response_format.json_schema.schema": call(
        "/v1/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": json.loads('{"a":' * 500 + "1" + "}" * 500)},
            }
        },
    ),
}


@pytest.mark.parametrize("param", list(NESTED))
def test_nested_json_in_a_field_is_a_400_naming_it(http, param):
    path, body = NESTED[param]
    err = refused(http.post(path, json=body), param)
    assert f"at most {limits.MAX_JSON_DEPTH}" in err["message"], err


def test_json_within_the_bound_still_parses(http):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"prompt": "x", "max_tokens": 8, "temperature": 0, "json_schema": json.dumps(schema)}
    assert isinstance(
        json.loads(ok(http.post("/v1/completions", json=body))["choices"][0]["text"]), dict
    )
    args = json.dumps({"k": json.loads("[" * 100 + "]" * 100)})  # 101 levels: accepted
    history = USER + [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}
            ],
        }
    ]
    ok(http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 1}))


# ---- item 4: the reasoning parser keeps an answer without a think block -------------------------
INDENTED = "    def __init__(self):"


@pytest.mark.parametrize("stream", [False, True])
def test_answer_without_think_block_is_byte_for_byte(http, stream):
    body = {"messages": USER, "temperature": 0, "max_tokens": 40, "stream": stream}
    body["regex"] = r"    def __init__\(self\):"
    if not stream:
        msg = ok(http.post("/v1/chat/completions", json=body))["choices"][0]["message"]
        assert msg["content"] == INDENTED and msg.get("reasoning_content") is None, msg
        return
    content, reasoning = "", ""
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    content += c["delta"].get("content") or ""
                    reasoning += c["delta"].get("reasoning_content") or ""
    assert (content, reasoning) == (INDENTED, "")


def test_one_whitespace_token_is_the_answer(http):
    """max_tokens 1 on a leading space: the space is the content, as without the parser."""
    body = {"messages": USER, "temperature": 0, "max_tokens": 1, "regex": " +x"}
    parsed = ok(http.post("/v1/chat/completions", json=body))
    plain = ok(http.post("/v1/chat/completions", json=body | {"separate_reasoning": False}))
    assert parsed["usage"]["completion_tokens"] == 1
    text = plain["choices"][0]["message"]["content"]
    assert text.strip() == "" and text
    assert parsed["choices"][0]["message"]["content"] == text


def test_generate_reasoning_text_is_null_without_a_block(http):
    sp = {"max_new_tokens": 40, "temperature": 0, "regex": r"    return 1"}
    body = {"text": "def f():\n", "sampling_params": sp, "separate_reasoning": True}
    out = ok(http.post("/generate", json=body))
    assert out["text"] == "    return 1" and out["reasoning_text"] is None, out
    sp["regex"] = r"<think>\nab\n</think>\n\n  x"
    out = ok(http.post("/generate", json=body))
    assert (out["reasoning_text"], out["text"]) == ("ab", "  x"), out


# ---- item 5: unknown fields bounded -------------------------------------------------------------
def test_too_many_unknown_fields_is_a_400_naming_the_bound(http):
    many = {f"x{i}": 1 for i in range(limits.MAX_UNKNOWN_FIELDS + 1)}
    for path, body in (
        call("/v1/completions", many),
        call("/v1/chat/completions", many),
        call("/generate", many),
    ):
        err = refused(http.post(path, json=body), None)
        assert "MAX_UNKNOWN_FIELDS" in err["message"] and err["code"] == "too_many_unknown_fields"
    err = refused(post(http, call("/v1/completions", {"y" * 300: 1})), None)
    assert "MAX_NAME_CHARS" in err["message"]
    # at the bound: served
    few = {f"x{i}": 1 for i in range(limits.MAX_UNKNOWN_FIELDS)}
    ok(post(http, call("/v1/completions", few)))


def test_unknown_field_warnings_are_bounded(server, http, caplog, monkeypatch):
    """Distinct names in every request: the warnings name a bounded sample, the state stops
    growing at its capacity, and one line says so."""
    log = request_fields.UnknownFieldLog(capacity=100)
    monkeypatch.setattr(request_fields, "UNKNOWN_LOG", log)
    n = limits.MAX_UNKNOWN_FIELDS
    with caplog.at_level(logging.WARNING, logger="ddtree"):
        for k in range(6):
            body = {f"f{k}_{i}": 1 for i in range(n)}
            ok(post(http, call("/v1/completions", body)))
        ok(post(http, call("/v1/completions", {"f0_0": 1})))  # warned already: no line
    lines = [r.getMessage() for r in caplog.records if "request field" in r.getMessage()]
    assert len(log.seen) == 100 and log.full
    assert len(lines) == 3 and "further ones are not" in caplog.records[-1].getMessage()
    assert f"(and {n - request_fields.WARN_SAMPLE} more)" in lines[0]
    assert all(len(s) < 400 for s in lines), lines
    wait_idle(server.base_url)


# ---- item 7: log-prob bytes and offsets of tokens that split a character ------------------------
def test_split_character_logprob_bytes_and_offsets(http):
    """`é` is two byte-level tokens (0xC3, 0xA9): chat `bytes` are each token's own byte and join to
    the content's UTF-8; completions `text_offset` count characters of the text, both halves of
    `é` at its offset; streamed offsets equal the whole's."""
    common = {"temperature": 0, "max_tokens": 12, "regex": "aé日b"}
    chat = ok(
        http.post(
            "/v1/chat/completions",
            json=common | {"messages": USER, "logprobs": True, "top_logprobs": 2},
        )
    )["choices"][0]
    content = chat["message"]["content"]
    assert content == "aé日b"
    entries = chat["logprobs"]["content"][:-1]  # the last: EOS, which the grammar ends with
    assert len(entries) == 7
    assert b"".join(bytes(e["bytes"]) for e in entries) == content.encode()
    assert any(e["bytes"] == [0xC3] for e in entries) and [0xEF, 0xBF, 0xBD] not in [
        e["bytes"] for e in entries
    ]
    for e in entries:
        assert all(isinstance(t["bytes"], list) for t in e["top_logprobs"])
    body = common | {"prompt": "x", "logprobs": 1}
    lp = ok(http.post("/v1/completions", json=body))["choices"][0]["logprobs"]
    text = "aé日b"
    # a: 0; é's two bytes: 1, 1; 日's three: 2, 2, 2; b: 3; EOS (skipped in the text): 4
    assert lp["text_offset"] == [0, 1, 1, 2, 2, 2, 3, 4], lp
    assert all(text[o] == ch for o, ch in zip(lp["text_offset"], "aéé日日日b"))
    streamed = []
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += (c["logprobs"] or {}).get("text_offset", [])
    assert streamed == lp["text_offset"]
