"""`ddtree serve --dp-size 2` on the CPU (toy pair, DDTREE, fp32): two replica processes behind one
HTTP server. Concurrent requests are served by both replicas (per-replica counts in /metrics) with
a single engine's tokens at T=0; cache_aware sends a conversation's next turn to the replica that
caches it; pools are clean after the drain; a replica killed mid-request fails only the requests
it held (503 `replica_unavailable`, a stream's error event included) while the other replica goes
on serving and /health says "degraded" naming it; SIGTERM then drains the survivor and exits 0.
A dp 2 x tp 2 server serves the same tokens (each replica starts its own rank). Three servers
start here; the module runs in ~2 min on a busy 2-core box."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from engine_utils import accepted_prompts, make_llm, toy_pattern
from server_fixtures import server_argv, server_info, subprocess_server, wait_idle

from ddtree import SamplingParams
from ddtree.models.shapes import EOS_ID

N_NEW = 12
PROMPTS = [list(p) for p in accepted_prompts(6)]
ENV = {"OMP_NUM_THREADS": "1"}


@functools.lru_cache(maxsize=None)
def reference(pair) -> tuple[tuple[int, ...], ...]:
    """One engine's greedy tokens (AR: speculation is lossless, test_engine_lossless)."""
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    outs = make_llm(pair, "NONE").generate(PROMPTS, params)
    return tuple(tuple(o.token_ids) for o in outs)


def generate(url: str, ids: list[int], n: int = N_NEW, **sampling) -> httpx.Response:
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True} | sampling
    return httpx.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=120
    )


def metric(url: str, name: str) -> dict[str, float]:
    """dp_rank -> value of one labelled sample family (other labels summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name:
                key = s.labels.get("dp_rank", "")
                out[key] = out.get(key, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def dp_server(toy_pair):
    argv = server_argv(toy_pair, "DDTREE", "--dp-size", "2", "--load-balance-method", "cache_aware")
    with subprocess_server(argv, env=ENV) as (url, proc):
        yield url


def test_dp2_serves_concurrent_requests_on_both_replicas_with_one_engines_tokens(
    dp_server, toy_pair
):
    before = metric(dp_server, "ddtree_requests_total")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        rs = list(pool.map(lambda p: generate(dp_server, p), PROMPTS))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    got = tuple(tuple(r.json()["output_ids"]) for r in rs)
    assert got == reference(toy_pair)
    accept = [r.json()["meta_info"]["spec_accept_length"] for r in rs]
    assert sum(accept) / len(accept) > 2, accept  # the replicas really speculated
    after = metric(dp_server, "ddtree_requests_total")
    served = {rank: after[rank] - before.get(rank, 0.0) for rank in after}
    assert sorted(served) == ["0", "1"] and sum(served.values()) == len(PROMPTS), served
    assert min(served.values()) >= 2, served  # shortest queue spread the burst
    dispatched = metric(dp_server, "ddtree_dp_dispatched_requests_total")
    assert set(dispatched) == {"0", "1"}


def test_cache_aware_sends_the_next_turn_to_the_replica_that_caches_it(dp_server):
    """Four conversations; each second turn (the first turn's prompt + answer + more) must land on
    the replica that served the first (the other never saw it) and find >= 2 pages cached there."""
    firsts = [[1] + toy_pattern("prog", 3 + 5 * i, 39, 1 + i % 3) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = [
            r.json()["output_ids"] for r in pool.map(lambda p: generate(dp_server, p), firsts)
        ]
        seconds = [
            p + a + toy_pattern("walk", 7 * i, 8) for i, (p, a) in enumerate(zip(firsts, answers))
        ]
        rs = list(pool.map(lambda p: generate(dp_server, p), seconds))
    cached = [r.json()["meta_info"]["cached_tokens"] for r in rs]
    assert all(c >= 32 for c in cached), cached  # 52-token histories: 3 full 16-token pages


def test_grammars_are_checked_here_and_constrain_on_the_replicas(dp_server, toy_pair):
    """A structured-output request: its grammar is validated in the HTTP process (a bad one is a
    400 naming the field, no replica involved) and compiled again on the replica that serves it,
    whose tokens it constrains; on both replicas. The toy vocabulary is the words "4" .. "63" (its
    decoder joins them with spaces): the grammar reads the words' own bytes."""
    import re

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(toy_pair[0], "tokenizer.json"))
    regex = "[0-9]{5,7}"
    before = metric(dp_server, "ddtree_requests_total")
    for prompt in PROMPTS[:4]:
        r = generate(dp_server, prompt, 16, regex=regex, ignore_eos=False)
        assert r.status_code == 200, r.text
        out = r.json()["output_ids"]
        assert out[-1] == EOS_ID, out  # the grammar ended it: EOS is the only token it allows then
        words = "".join(vocab.id_to_token(i) for i in out[:-1])
        assert re.fullmatch(regex, words), (words, r.json()["meta_info"]["finish_reason"])
    after = metric(dp_server, "ddtree_requests_total")
    assert all(after[rank] > before.get(rank, 0.0) for rank in ("0", "1")), (before, after)
    sp = {"max_new_tokens": 8, "regex": "(unclosed"}
    bad = httpx.post(dp_server + "/generate", json={"input_ids": PROMPTS[0], "sampling_params": sp})
    assert bad.status_code == 400 and "regex" in bad.json()["error"]["message"], bad.text


def test_pools_are_clean_after_the_drain(dp_server):
    info = wait_idle(dp_server)
    assert info["replicas_serving"] == 2 and info["kv_integrity"] == "ok"
    for rep in info["replicas"]:
        assert rep["problem"] is None and rep["in_flight"] == 0
        assert rep["kv_pages_free"] == rep["kv_pages_total"], rep  # cached pages count as free
        assert rep["request_slots_free"] == rep["request_slots_total"], rep
        assert rep["kv_integrity"] == "ok"
    assert info["kv_pages_free"] == sum(r["kv_pages_total"] for r in info["replicas"])


def test_dp2_tp2_replicas_each_start_their_own_ranks(toy_pair):
    """--dp-size 2 --tp-size 2: each replica process starts its own tensor-parallel rank (gloo
    on the CPU, the same code as NCCL on cuda:r of the replica's GPUs) and serves one engine's
    tokens."""
    argv = server_argv(toy_pair, "DFLASH", "--dp-size", "2", "--tp-size", "2")
    with subprocess_server(argv, env=ENV) as (url, proc):
        with ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda p: generate(url, p), PROMPTS[:4]))
        assert [tuple(r.json()["output_ids"]) for r in rs] == list(reference(toy_pair)[:4])
        assert sum(r.json()["meta_info"]["spec_accept_length"] for r in rs) / 4 > 2
        info = server_info(url)
        assert [r["dispatched"] for r in info["replicas"]] == [2, 2]


def _wait_running(url: str, n: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(url)
        if info["num_running_requests"] == n:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


class Stream(threading.Thread):
    """A streamed completion read in the background: its events, and a way to stop early."""

    def __init__(self, url: str, n: int, prompt: str):
        super().__init__()
        body = {"model": "m", "prompt": prompt, "max_tokens": n, "stream": True}
        self.req = (url + "/v1/completions", body | {"temperature": 0, "ignore_eos": True})
        self.events: list[str] = []
        self.status, self.stop_after = None, None
        self.start()

    def run(self):
        with httpx.stream("POST", self.req[0], json=self.req[1], timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                if self.stop_after is not None and len(self.events) >= self.stop_after:
                    return  # the client goes away: the server aborts the request

    def wait_events(self, n: int, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while len(self.events) < n:
            assert self.is_alive() and time.monotonic() < deadline, self.events[-3:]
            time.sleep(0.02)


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    from server_fixtures import build_tiny_pair

    root = str(tmp_path_factory.mktemp("dp_long_pair"))
    return build_tiny_pair(root, max_position_embeddings=4096)


def test_a_killed_replica_fails_only_what_it_held_and_sigterm_drains_the_rest(long_pair):
    """Plain AR on a random char-level pair: 2000-token requests outlast every step here."""
    argv = server_argv(long_pair, "NONE", "--dp-size", "2", "--graceful-shutdown-timeout", "60")
    with subprocess_server(argv, env=ENV) as (url, proc):
        long = 2000
        lost_plain: dict = {}

        def plain():
            body = {"model": "m", "prompt": "b", "max_tokens": long, "ignore_eos": True}
            lost_plain["r"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

        # round robin, one at a time: replica 0 gets the 1st and 3rd, replica 1 the 2nd
        lost_stream = Stream(url, long, "c")
        lost_stream.wait_events(1)
        kept = Stream(url, long, "a")
        kept.wait_events(1)
        t = threading.Thread(target=plain)
        t.start()
        info = _wait_running(url, 3)
        assert [r["in_flight"] for r in info["replicas"]] == [2, 1]
        seen = len(kept.events)
        os.kill(info["replicas"][0]["pid"], signal.SIGKILL)
        t.join(60)
        lost_stream.join(60)
        r = lost_plain["r"]
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "replica_unavailable"
        assert "replica 0" in r.json()["error"]["message"]
        assert lost_stream.status == 200 and lost_stream.events[-1] == "[DONE]"
        err = json.loads(lost_stream.events[-2])["error"]
        assert err["code"] == "replica_unavailable" and "killed by SIGKILL" in err["message"]
        kept.wait_events(seen + 20)  # replica 0 went on streaming through it
        kept.stop_after = len(kept.events) + 1

        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 200, health.text
        assert health.json()["status"] == "degraded" and "replica 0" in health.json()["message"]
        body = {"model": "m", "prompt": "d", "max_tokens": 8}
        for _ in range(3):  # new requests: all to the survivor
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert metric(url, "ddtree_dp_replica_up") == {"0": 0.0, "1": 1.0}
        kept.join(60)
        info = wait_idle(url)
        survivor = info["replicas"][1]
        assert info["replicas_serving"] == 1 and survivor["kv_integrity"] == "ok"
        assert survivor["request_slots_free"] == survivor["request_slots_total"]
        assert survivor["kv_pages_free"] == survivor["kv_pages_total"]

        # SIGTERM to the server and its replica (as a service manager signals a process group):
        # the request in flight still finishes, then everything exits
        drained = Stream(url, 600, "e")
        drained.wait_events(1)
        proc.send_signal(signal.SIGTERM)
        os.kill(survivor["pid"], signal.SIGTERM)
        drained.join(120)
        assert drained.events[-1] == "[DONE]"
        assert json.loads(drained.events[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0
        with pytest.raises(ProcessLookupError):  # the replica left with the server
            os.kill(survivor["pid"], 0)
