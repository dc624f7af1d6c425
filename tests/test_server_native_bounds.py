"""Issue 39 item 4: SGLang's native `/generate` has the OpenAI routes' bounds and checks
(server/limits.py), one test per bound: stop strings, stop ids, prompts x n per call, characters
before tokenizing, lone surrogates, non-finite numbers; a client that leaves during admission
stops its batch before the engine sees it; tokenizing runs off the engine thread; streamed chunks
carry the running spec_verify_ct. Each refusal is a 400 naming the field, and the server serves
the next request with clean pools. ~15 s on 2 cores."""

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from server_fixtures import build_tiny_pair, server_argv, thread_server, wait_idle, wait_running

from ddtree.server import limits

CONTEXT = 512  # the tiny pair's max_position_embeddings


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(str(tmp_path_factory.mktemp("native_bounds_pair")))


@pytest.fixture(scope="module")
def server(pair):
    with thread_server(server_argv(pair, "DDTREE")) as srv:
        yield srv


@pytest.fixture(scope="module")
def asgi(server):
    """In-process requests to the served app (the engine thread runs under the uvicorn thread)."""
    return TestClient(server.app, raise_server_exceptions=False)


def assert_pools_idle(base_url):
    info = wait_idle(base_url, timeout=10)
    assert info["kv_pages_free"] == info["kv_pages_total"]
    assert info["request_slots_free"] == info["request_slots_total"]
    assert info["kv_integrity"] == "ok"


LONG_STOP = "s" * (limits.MAX_STOP_CHARS + 1)
TOO_MANY = limits.MAX_BATCH_REQUESTS // 4 + 1  # prompts that, at n=4, pass the limit
BAD = {  # name: (body, or raw JSON for the fields after "text", param, code)
    "too many stop strings": (
        {"text": "a", "sampling_params": {"stop": ["x"] * (limits.MAX_STOP_STRINGS + 1)}},
        "sampling_params.stop",
        "invalid_value",
    ),
    "stop string too long": (
        {"text": "a", "sampling_params": {"stop": LONG_STOP}},
        "sampling_params.stop",
        "invalid_value",
    ),
    "stop string in a list too long": (
        {"text": "a", "sampling_params": {"stop": ["b", LONG_STOP]}},
        "sampling_params.stop.1",
        "invalid_value",
    ),
    "too many stop ids": (  # the 10,000
        {"text": "a", "sampling_params": {"stop_token_ids": [1] * 10_000}},
        "sampling_params.stop_token_ids",
        "invalid_value",
    ),
    "prompts x n over the batch limit": (  # the 1,000 x 4, scaled to the limit
        {"text": ["p"] * TOO_MANY, "sampling_params": {"n": 4, "max_new_tokens": 1}},
        "text",
        "invalid_value",
    ),
    "too many prompts": (
        {"input_ids": [[1]] * (limits.MAX_BATCH_REQUESTS + 1)},
        "input_ids",
        "invalid_value",
    ),
    "text over the characters per token": (
        {"text": "t" * (limits.PROMPT_CHARS_PER_TOKEN * CONTEXT + 1)},
        "text",
        "context_length_exceeded",
    ),
    "batch text over the characters per token": (
        {"text": ["ok", "t" * (limits.PROMPT_CHARS_PER_TOKEN * CONTEXT + 1)]},
        "text.1",
        "context_length_exceeded",
    ),
    "surrogate text": ('"text": "a\\ud800b"', "text", "invalid_value"),
    "surrogate in a text batch": ('"text": ["ok", "\\udfff"]', "text.1", "invalid_value"),
    "surrogate stop": (
        '"text": "a", "sampling_params": {"stop": "\\ud83d"}',
        "sampling_params.stop",
        "invalid_value",
    ),
    "surrogate rid": ('"text": "a", "rid": "\\ud800"', "rid", "invalid_value"),
    "rid too long": ({"text": "a", "rid": "r" * (limits.MAX_NAME_CHARS + 1)}, "rid", None),
    "NaN temperature": (
        '"text": "a", "sampling_params": {"temperature": NaN}',
        "sampling_params.temperature",
        "invalid_value",
    ),
    "Infinity top_p": (
        '"text": "a", "sampling_params": {"top_p": Infinity}',
        "sampling_params.top_p",
        "invalid_value",
    ),
    "-Infinity min_p": (
        '"text": "a", "sampling_params": {"min_p": -Infinity}',
        "sampling_params.min_p",
        "invalid_value",
    ),
    "NaN repetition_penalty": (
        '"text": "a", "sampling_params": {"repetition_penalty": NaN}',
        "sampling_params.repetition_penalty",
        "invalid_value",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_generate_is_a_400_naming_the_field(server, asgi, case):
    body, param, code = BAD[case]
    raw = "{" + body + "}" if isinstance(body, str) else json.dumps(body)
    r = asgi.post("/generate", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param.split(".")[0] in err["message"]
    if code:
        assert err["code"] == code, err
    if code == "context_length_exceeded":  # refused by its length, before it was tokenized
        assert "characters" in err["message"], err
    ok = asgi.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200, ok.text
    assert_pools_idle(server.base_url)


def test_generate_at_the_bounds_is_served(server, asgi):
    """The limits are inclusive: a batch of exactly MAX_BATCH_REQUESTS requests (prompts x n),
    max-size stop lists and stop-id lists are served."""
    n = 4
    prompts = limits.MAX_BATCH_REQUESTS // n
    sp = {
        "max_new_tokens": 1,
        "n": n,
        "stop": ["\u20ac" * limits.MAX_STOP_CHARS] * limits.MAX_STOP_STRINGS,
        "stop_token_ids": [96] * limits.MAX_STOP_TOKEN_IDS,
    }
    r = asgi.post("/generate", json={"input_ids": [[1, 2]] * prompts, "sampling_params": sp})
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()) == limits.MAX_BATCH_REQUESTS
    assert_pools_idle(server.base_url)


class Leaves:
    """A Request whose client goes away after `after` disconnect checks."""

    def __init__(self, after: int):
        self.after, self.checks = after, 0

    async def is_disconnected(self) -> bool:
        self.checks += 1
        return self.checks > self.after


def test_a_client_that_leaves_during_admission_stops_its_batch(server, monkeypatch):
    """The batch is tokenized prompt by prompt; once the client is gone the rest is not, and none
    of it reaches the engine (before: every prompt was admitted, then aborted)."""
    from ddtree.server.native_api import NativeServing
    from ddtree.server.native_protocol import GenerateRequest
    from ddtree.server.openai_serving import OpenAIServing
    from ddtree.server.protocol import APIError

    engine, args = server.engine, server.engine.args
    added, encoded = [], []
    real_add, real_encode = engine.add_request, engine.tokenizer.encode
    monkeypatch.setattr(engine, "add_request", lambda *a, **k: added.append(1) or real_add(*a, **k))
    monkeypatch.setattr(
        engine.tokenizer, "encode", lambda *a, **k: encoded.append(1) or real_encode(*a, **k)
    )
    serving = OpenAIServing(server.async_engine, args)
    native = NativeServing(serving, args)
    body = GenerateRequest(text=[f"prompt {i}" for i in range(40)])
    try:
        with pytest.raises(APIError) as info:
            asyncio.run(native.generate(body, Leaves(after=3)))
        assert info.value.status == 499
        assert len(encoded) == 4 and added == []
        # the same batch from a client that stays is admitted whole
        out = asyncio.run(native.generate(body.model_copy(), Leaves(after=10**6)))
        assert len(out) == 40 and len(added) == 40
    finally:
        serving.close()
    assert_pools_idle(server.base_url)


def test_tokenizing_runs_off_the_engine_thread(server, pair, monkeypatch):
    """A prompt whose tokenizing never ends (blocked here) does not hold up a running stream: it
    keeps decoding while the tokenizer thread waits, which the engine thread could not if it did
    the tokenizing."""
    tok = server.engine.tokenizer
    real_encode, entered, release, threads = tok.encode, threading.Event(), threading.Event(), []

    def blocking_encode(text, *a, **k):
        if text.startswith("BLOCK"):
            threads.append(threading.current_thread().name)
            entered.set()
            release.wait(30)
        return real_encode(text, *a, **k)

    monkeypatch.setattr(tok, "encode", blocking_encode)
    stream_body = {
        "input_ids": [1, 2, 3],
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }
    blocked = threading.Thread(
        target=lambda: httpx.post(
            server.base_url + "/generate",
            json={"text": "BLOCK me", "sampling_params": {"max_new_tokens": 2}},
            timeout=60,
        )
    )
    try:
        with httpx.stream("POST", server.base_url + "/generate", json=stream_body, timeout=60) as r:
            lines = r.iter_lines()
            wait_running(server.base_url, 1)
            blocked.start()
            assert entered.wait(20), "the blocked prompt never reached the tokenizer"
            before = None
            deadline = time.monotonic() + 20
            for line in lines:  # the stream goes on while the tokenizer thread is blocked
                if not line.startswith("data: {"):
                    continue
                n = len(json.loads(line[6:])["output_ids"])
                before = n if before is None else before
                if n >= before + 20 or time.monotonic() > deadline:
                    break
            assert n >= before + 20, (before, n)
            assert not release.is_set()
    finally:
        release.set()
        blocked.join(30)
    assert threads and threads[0].startswith("ddtree-tokenize"), threads
    assert_pools_idle(server.base_url)


def test_streamed_chunks_carry_the_running_spec_counts(server):
    """Every chunk reports the rounds so far (spec_verify_ct) and their mean accept length, not 0
    until the last."""
    body = {
        "input_ids": [4, 5, 6],
        "stream": True,
        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(server.base_url + "/generate", json=body, timeout=60)
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    counts = [e["meta_info"]["spec_verify_ct"] for e in events]
    assert len(events) >= 3 and counts == sorted(counts), counts
    assert counts[-2] > 0 and counts[-1] >= counts[-2]
    for e in events[:-1]:
        meta = e["meta_info"]
        if meta["spec_verify_ct"]:
            # every token after the prefill's first came from a counted round
            tokens_in_rounds = meta["spec_accept_length"] * meta["spec_verify_ct"]
            assert tokens_in_rounds == pytest.approx(len(e["output_ids"]) - 1)
    whole = httpx.post(server.base_url + "/generate", json=body | {"stream": False}, timeout=60)
    assert whole.json()["meta_info"]["spec_verify_ct"] == counts[-1]
