"""Shutdown of `python -m ddtree.launch_server` in a subprocess: SIGTERM drains for
--graceful-shutdown-timeout and then ends what is still running; a second SIGTERM, or a SIGINT, ends
it at once. Either way a stream gets an SSE error event and `[DONE]`, a non-streaming request a JSON
503 `server_shutting_down`, and the exit code is 0. (That a drain lets requests finish is
test_server_api's test_launch_server_module_serves_and_drains_on_sigterm.)"""

import json
import signal
import threading
import time

import httpx
import pytest
from server_fixtures import build_tiny_pair, server_argv, subprocess_server

LONG = 3000  # tokens: far longer than any drain below, on any CPU


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(
        str(tmp_path_factory.mktemp("shutdown_pair")), max_position_embeddings=4096
    )


def start_clients(url: str, model: str) -> tuple[dict, list[threading.Thread], threading.Event]:
    got = {"events": [], "plain": None}
    streaming = threading.Event()
    body = {"model": model, "prompt": "x", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}

    def stream():
        with httpx.stream(
            "POST", url + "/v1/completions", json=body | {"stream": True}, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got["events"].append(line[6:])
                    streaming.set()

    def plain():
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        got["plain"] = (r.status_code, r.json(), time.monotonic())

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    return got, threads, streaming


@pytest.mark.parametrize(
    "signals, drain",
    [
        ((signal.SIGTERM,), 1.5),  # the drain deadline passes
        ((signal.SIGTERM, signal.SIGINT), 60),  # a second signal does not wait for the deadline
    ],
)
def test_shutdown_ends_in_flight_requests_with_errors_and_exits_0(pair, signals, drain):
    argv = server_argv(pair, "DDTREE", "--graceful-shutdown-timeout", str(drain))
    with subprocess_server(argv) as (url, proc):
        got, threads, streaming = start_clients(url, pair[0])
        assert streaming.wait(60), "the stream never started"
        time.sleep(0.3)  # the non-streaming request is admitted too
        t0 = time.monotonic()
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.3)
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0, proc.stderr.read()
    status, body, answered = got["plain"]
    assert status == 503 and body["error"]["code"] == "server_shutting_down", body
    ended = answered - t0
    if len(signals) == 1 and signals[0] == signal.SIGTERM:
        # it waited for the deadline, then ended them
        assert drain - 0.2 <= ended < drain + 10, ended
    else:
        assert ended < 10, ended  # ended at once, not after the 60 s drain
    events = got["events"]
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
    assert len(events) > 3  # it streamed tokens before the end


class FakeEngine:
    def __init__(self):
        self.failed = []

    def fail_all(self):
        self.failed.append(time.monotonic())


@pytest.mark.parametrize(
    "signals, drain, ends_at_once",
    [
        ((signal.SIGTERM,), 30, False),
        ((signal.SIGTERM,), 0, True),
        ((signal.SIGINT,), 30, True),
        ((signal.SIGTERM, signal.SIGTERM), 30, True),
        ((signal.SIGTERM, signal.SIGINT), 30, True),
    ],
)
def test_signal_policy(signals, drain, ends_at_once):
    """The DrainingServer's signal handling without a process: which signals end requests at once,
    and the one after that forces uvicorn out."""
    import uvicorn

    from ddtree.server.launch import draining_server

    engine = FakeEngine()
    srv = draining_server(uvicorn.Config(app=None), engine, drain)
    for sig in signals:
        srv.handle_exit(sig, None)
    assert (
        srv.should_exit and not srv.force_exit and srv._captured_signals == []
    )  # exit 0, no re-raise
    assert len(engine.failed) == (1 if ends_at_once else 0)
    srv.handle_exit(signal.SIGTERM, None)
    assert srv.force_exit == ends_at_once and len(engine.failed) == 1
    srv.end_in_flight()  # the drain timer firing late changes nothing
    assert len(engine.failed) == 1


def test_drain_timer_ends_requests_after_the_timeout():
    import uvicorn

    from ddtree.server.launch import draining_server

    engine = FakeEngine()
    srv = draining_server(uvicorn.Config(app=None), engine, 0.3)
    t0 = time.monotonic()
    srv.handle_exit(signal.SIGTERM, None)
    deadline = t0 + 5
    while not engine.failed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.failed and 0.25 <= engine.failed[0] - t0 < 3


def test_a_server_stopped_in_process_gives_its_pools_back(pair):
    """FastAPI keeps every endpoint it saw in a process-wide cache, and the endpoints' closures hold
    the serving objects, so a server stopped in-process stays reachable; its engine must not keep
    the KV pool (gigabytes on the CPU's cap: a test session of such servers ran out of memory)."""
    import gc
    import weakref

    from server_fixtures import thread_server

    with thread_server(server_argv(pair, "DDTREE")) as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200
        engine = srv.engine
        kv = weakref.ref(engine.runner.kv.k)
    gc.collect()
    assert engine.runner.kv is None and engine.runner.draft_kv is None
    assert kv() is None  # nothing else held the tensor
