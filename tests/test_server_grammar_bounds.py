"""Grammar work bounded end to end (issue 54 items 1, 6, 8), on a DDTREE server over the embedded
pair (CPU, fp32; its 8,192-token vocabulary makes `(.{1,50}){1,50}` really slow to mask):

- the stall test: pathological regexes and deep schemas sent beside plain requests; the plain
  requests answer what they answer alone, each well within a bound the unbounded engine could not
  meet, /health stays 200 with the stall detector at a few seconds, and the pathological regexes
  get a 400 `grammar_too_complex` naming the field (at compile, from the probe fill, or mid-decode
  from the step budget, whichever this machine's speed makes it);
- slow compiles (injected: they block until the test releases them) get a 400 after the limit
  while a simple grammar from the same client still compiles and decodes; a client past its
  share of compile workers gets a 429 with Retry-After; a request that finds no worker a 503;
- `\\x41B` constrains to `AB`, and `[\\u00e9\\u00e8a-z ]` is accepted.
~30 s."""

import asyncio
import re
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from engine_stub import IdleEngine
from server_fixtures import server_argv, thread_server

from ddtree.assets import PACKAGE_PAIR
from ddtree.grammar import Grammars, GrammarSpec
from ddtree.server import limits
from ddtree.server.protocol import APIError
from ddtree.server.structured import GrammarCompiler

PAIR = (f"{PACKAGE_PAIR}/target", f"{PACKAGE_PAIR}/drafter")
PLAIN = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}


def nested_schema(depth: int) -> dict:
    s = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


@pytest.fixture(scope="module")
def srv():
    argv = server_argv(PAIR, "DDTREE")
    with thread_server(argv) as s:
        yield s


def post(srv, body, timeout=120):
    return httpx.post(srv.base_url + "/v1/completions", json=body, timeout=timeout)


def test_pathological_grammars_beside_plain_traffic(srv):
    srv.async_engine.stall_timeout_s = 8.0  # /health turns 503 if a step takes this long
    alone = []
    for _ in range(4):
        t0 = time.monotonic()
        r = post(srv, PLAIN)
        alone.append(time.monotonic() - t0)
        assert r.status_code == 200
    want = r.json()["choices"][0]["text"]

    bad: dict[str, httpx.Response] = {}
    bodies = {
        "regex1": PLAIN | {"regex": "(.{1,50}){1,50}", "max_tokens": 64},
        "regex2": PLAIN | {"regex": "a(.{1,50}){1,50}", "max_tokens": 64},
        "schema": PLAIN | {"json_schema": nested_schema(60), "max_tokens": 64},  # 121 levels
    }
    threads = [
        threading.Thread(target=lambda k=k, b=b: bad.__setitem__(k, post(srv, b)))
        for k, b in bodies.items()
    ]
    health, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            health.append(httpx.get(srv.base_url + "/health", timeout=30).status_code)
            time.sleep(0.2)

    poller = threading.Thread(target=poll)
    poller.start()
    for t in threads:
        t.start()
    time.sleep(0.3)  # the pathological ones compile and reach the engine first
    beside = []
    for _ in range(6):
        t0 = time.monotonic()
        r = post(srv, PLAIN)
        beside.append(time.monotonic() - t0)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    for t in threads:
        t.join(120)
    stop.set()
    poller.join()
    print(f"\nplain alone {['%.2f' % x for x in alone]} s, beside {['%.2f' % x for x in beside]} s")
    # unbounded, a plain request beside these waited minutes (each fill of the regexes slower)
    assert max(beside) < 20
    assert health and set(health) == {200}
    for k in ("regex1", "regex2"):
        r = bad[k]
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "grammar_too_complex" and "regex" in err["message"]
    assert bad["schema"].status_code in (200, 400)
    assert post(srv, PLAIN).json()["choices"][0]["text"] == want


@pytest.fixture
def blocked_compiles(monkeypatch):
    """Regexes starting SLOW! compile only when `release` is set (xgrammar cannot be stopped)."""
    state = SimpleNamespace(release=threading.Event(), entered=[])
    real = Grammars._compile

    def compile_(self, spec):
        if spec.source.startswith("SLOW!"):
            state.entered.append(spec.source)  # a worker runs it: admitted, and in flight
            state.release.wait(60)
        return real(self, spec)

    monkeypatch.setattr(Grammars, "_compile", compile_)
    # the injected compiles never finish by themselves: a limit far above a real compile of
    # `[0-9]{10}` (milliseconds) keeps that one inside it on a loaded CI machine
    monkeypatch.setattr(limits, "GRAMMAR_COMPILE_TIMEOUT_S", 3.0)
    yield state
    state.release.set()


def test_slow_compiles_do_not_starve_a_simple_grammar(srv, blocked_compiles):
    slow = [PLAIN | {"regex": f"SLOW!{i}"} for i in range(3)]
    out: dict[int, httpx.Response] = {}
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, post(srv, slow[i])))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(2):  # over the limit: the grammar itself is too slow, said so
        assert out[i].status_code == 400
        assert "could not be compiled within 3 s" in out[i].json()["error"]["message"]
    # their threads still compile; a simple grammar of the same client is served, every time
    for n in range(6):
        r = post(srv, PLAIN | {"regex": "[0-9]{10}", "max_tokens": 16, "prompt": f"n{n}"})
        assert r.status_code == 200, r.text
        assert re.fullmatch("[0-9]{10}", r.json()["choices"][0]["text"])
    # two more slow ones: the client's share (4) is in flight; its next compile is refused
    more = [
        threading.Thread(target=post, args=(srv, slow[2] | {"regex": f"SLOW!{i}b"}))
        for i in range(2)
    ]
    for t in more:
        t.start()
    deadline = time.monotonic() + 30
    # both in flight before the probes: a probe compiling while the second one is admitted would
    # take the client's fourth slot and leave that one a 429 instead
    while len(blocked_compiles.entered) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(blocked_compiles.entered) == 4
    r, k = None, 0
    while time.monotonic() < deadline:  # distinct regexes: a cached one takes no worker
        k += 1
        r = post(srv, PLAIN | {"regex": f"[0-9]{{3}}x{k}"})
        if r.status_code == 429:
            break
        time.sleep(0.05)
    assert r is not None and r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "too_many_grammar_compiles"
    assert int(r.headers["Retry-After"]) > 0
    blocked_compiles.release.set()
    for t in more:
        t.join(60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the abandoned compiles finish, the share comes back
        k += 1
        r = post(srv, PLAIN | {"regex": f"[0-9]{{3}}y{k}"})
        if r.status_code != 429:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_a_compile_without_a_worker_is_a_503(monkeypatch):
    """One worker, held by client a's slow compile: client b's waits GRAMMAR_COMPILE_QUEUE_S and
    is told the server is busy (a 503 with Retry-After), not that its grammar is too complex."""
    monkeypatch.setattr(limits, "GRAMMAR_COMPILE_QUEUE_S", 0.3)
    monkeypatch.setattr(limits, "GRAMMAR_COMPILE_TIMEOUT_S", 0.3)
    release = threading.Event()

    class Slow:
        def compile(self, spec):
            release.wait(30)

        def probe(self, spec):
            return 0.0

    engine = IdleEngine(grammars=Slow())
    compiler = GrammarCompiler(engine, workers=1)

    async def run():
        a = asyncio.ensure_future(compiler.compile(GrammarSpec.regex("a+"), "a"))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as b:
            await compiler.compile(GrammarSpec.regex("b+"), "b")
        with pytest.raises(APIError) as slow:
            await a
        return b.value, slow.value

    try:
        b, slow = asyncio.run(run())
    finally:
        release.set()
    assert (b.status, b.code, b.headers["Retry-After"]) == (503, "grammar_compiler_busy", "1")
    assert (slow.status, slow.code) == (400, "grammar_too_complex")
    compiler.close()


def test_regex_escapes_over_http(srv):
    r = post(srv, PLAIN | {"regex": r"\x41B", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "AB"
    r = post(srv, PLAIN | {"regex": r"[\u00e9\u00e8a-z ]{3}", "max_tokens": 6})
    assert r.status_code == 200 and re.fullmatch("[éèa-z ]{3}", r.json()["choices"][0]["text"])
    r = post(srv, PLAIN | {"regex": r"(a)\1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex"
    assert "backreference" in r.json()["error"]["message"]
