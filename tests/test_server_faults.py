"""Issue 39 through the real HTTP server (the embedded pair, DDTREE, prefix cache on): stop strings
leave the server whole; a failure while serving one request fails that request alone (a 500-class
error to its client) while the others stream on; a failure that cannot be isolated turns /health
503 and ends every request with a 503; a full queue is back-pressure (503 + Retry-After), never a
200 with empty text."""

import concurrent.futures as cf
import json
import re

import httpx
import pytest
from server_fixtures import server_info, thread_server, wait_idle, wait_running

ARGV = ["--device", "cpu", "--dtype", "float32", "--enable-metrics"]
DDTREE = ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "16"]
PROMPTS = [
    "def quicksort(xs):",
    "import os\n",
    "class Foo:\n    def __init__(self",
    "for i in range(10):",
]
STOPS = ["\n\n", ":", ")", "\n", "return"]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:_total)? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def complete(http, prompt, **kw):
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0} | kw
    return http.post("/v1/completions", json=body)


def stream_events(http, body):
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]


def assert_whole(url):
    info = wait_idle(url)
    assert info["kv_integrity"] == "ok"
    assert info["request_slots_free"] == info["request_slots_total"]


@pytest.fixture(scope="module")
def server(one_torch_thread):
    with thread_server(ARGV + DDTREE) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    return httpx.Client(base_url=server.base_url, timeout=120)


def test_stop_strings_leave_the_server_whole(server, http):
    """The report: greedy completions with ordinary stop strings, several at once; it had failed
    the step about once in six requests, failed the other streams and leaked slots and pages."""
    jobs = [(p, s) for s in STOPS for p in PROMPTS]
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda j: complete(http, j[0], stop=[j[1]]), jobs))
    for (prompt, stop), r in zip(jobs, results):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length") and stop not in choice["text"]
        if choice["finish_reason"] == "length":
            assert choice["text"]
    assert_whole(server.base_url)
    m = http.get("/metrics").text
    assert metric(m, "ddtree_requests_failed_alone") == 0
    assert metric(m, "ddtree_pool_integrity") == 1
    assert http.get("/health").status_code == 200


def test_a_kernel_failure_for_one_request_fails_it_alone(server, http, monkeypatch):
    """Four streams; the decoding round raises whenever the culprit (prompt '#poison...') has
    emitted a few tokens: its client gets a server error mid-stream, the other three stream to
    the end with the text they get without the fault, and the pools are whole."""
    bodies = [{"prompt": p, "max_tokens": 40, "temperature": 0} for p in PROMPTS[:3]]
    clean = [complete(http, **b).json()["choices"][0]["text"] for b in bodies]
    engine = server.engine
    tok = engine.tokenizer
    real = engine.decoder.round

    def round_(reqs, max_context):
        for r in reqs:
            if tok.decode(r.prompt_ids).startswith("#poison") and len(r.output_ids) >= 3:
                raise RuntimeError("injected kernel failure")
        return real(reqs, max_context)

    monkeypatch.setattr(engine.decoder, "round", round_)
    before = metric(http.get("/metrics").text, "ddtree_requests_failed_alone")
    poison = {"prompt": "#poison\ndef f(x):", "max_tokens": 40, "temperature": 0}
    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(stream_events, http, b) for b in bodies + [poison]]
        streams = [f.result() for f in futs]
    for events, text in zip(streams[:3], clean):
        assert "error" not in events[-1]
        assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == text
    assert streams[3][-1]["error"]["type"] == "server_error"
    assert "injected kernel failure" in streams[3][-1]["error"]["message"]
    assert_whole(server.base_url)
    m = http.get("/metrics").text
    assert metric(m, "ddtree_requests_failed_alone") == before + 1
    assert metric(m, "ddtree_pool_integrity") == 1
    assert http.get("/health").status_code == 200
    monkeypatch.undo()
    assert complete(http, PROMPTS[0]).status_code == 200


def test_a_bug_in_the_step_itself_fails_the_running_requests(server, http, monkeypatch):
    """A step that raises outside the engine's isolation (here: its decode log, after the tokens
    were emitted): the engine blames the running requests (`LLMEngine.fail_step`), their clients
    get a server error naming the bug, the pools stay whole and the server serves on."""
    engine = server.engine
    tok = engine.tokenizer
    real = engine.batch_log.decode

    def decode(emitted, rec):
        for r in engine.scheduler.running:
            if tok.decode(r.prompt_ids).startswith("#bug") and len(r.output_ids) >= 3:
                raise RuntimeError("injected step bug")
        return real(emitted, rec)

    monkeypatch.setattr(engine.batch_log, "decode", decode)
    before = metric(http.get("/metrics").text, "ddtree_engine_errors")
    events = stream_events(http, {"prompt": "#bug\ndef f(x):", "max_tokens": 40, "temperature": 0})
    err = events[-1]["error"]
    assert err["type"] == "server_error" and "internal engine error" in err["message"]
    assert "injected step bug" in err["message"]
    assert_whole(server.base_url)
    assert metric(http.get("/metrics").text, "ddtree_engine_errors") == before + 1
    assert http.get("/health").status_code == 200
    monkeypatch.undo()
    assert complete(http, PROMPTS[0]).status_code == 200


def test_a_full_queue_is_back_pressure_with_retry_after(one_torch_thread):
    argv = ARGV + ["--max-running-requests", "1", "--max-queued-requests", "1"]
    with thread_server(argv) as srv, httpx.Client(base_url=srv.base_url, timeout=120) as http:
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        with cf.ThreadPoolExecutor(2) as pool:
            first = pool.submit(complete, http, **body)
            wait_running(srv.base_url)
            second = pool.submit(complete, http, **body)
            _wait_waiting(srv.base_url, 1)
            r = complete(http, PROMPTS[1], max_tokens=4)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert "--max-queued-requests" in r.json()["error"]["message"]
            assert first.result().status_code == 200 and second.result().status_code == 200
        assert complete(http, PROMPTS[1], max_tokens=4).status_code == 200
        assert_whole(srv.base_url)


def _wait_waiting(url, n, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while server_info(url)["num_waiting_requests"] < n:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.02)


def test_a_fault_that_cannot_be_isolated_turns_health_503(one_torch_thread):
    """A device error poisons the context: the in-flight request ends with a 503, /health says
    why, new requests get a 503, and /metrics shows ddtree_engine_dead 1."""
    with thread_server(ARGV + DDTREE) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as h:
        engine = srv.engine
        real = engine.decoder.round
        calls = {"n": 0}

        def round_(reqs, max_context):
            calls["n"] += 1
            if calls["n"] > 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return real(reqs, max_context)

        engine.decoder.round = round_
        events = stream_events(h, {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0})
        assert "illegal memory access" in events[-1]["error"]["message"]
        health = h.get("/health")
        assert health.status_code == 503 and "cannot go on" in health.text
        r = complete(h, PROMPTS[1])
        assert r.status_code == 503 and "illegal memory access" in r.text
        assert metric(h.get("/metrics").text, "ddtree_engine_dead") == 1
