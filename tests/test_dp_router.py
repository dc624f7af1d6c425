"""The multi-host path, run: SGLang's router (`sglang-router` from PyPI, the Rust gateway started
by its own `python -m sglang_router.launch_router`) in front of two ddtree CPU workers. The router
registers them (it reads /server_info -> /get_server_info and /model_info -> /get_model_info, then
polls /health), and chat, completions, streaming and /generate go through it with the `openai`
client. Then the worker that served the most is killed and the same prompts are sent again at once:
with `cache_aware` (the router's default) they are routed to the dead worker first, and with
ROUTER_FLAGS every one of them still succeeds (with the router's defaults, 2 of 4 failed: its
retries went back to the same worker until its circuit breaker opened after 10 failures).
Skipped only where sglang-router cannot be installed (it ships Linux / macOS wheels). ~40 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_fixtures import REPO_ROOT, build_tiny_pair, free_port, server_argv, wait_healthy

pytest.importorskip(
    "sglang_router", reason="sglang-router is not installed (pip install sglang-router)"
)
openai = pytest.importorskip("openai")

# what docs/scaling.md tells a user to run: a failure opens the worker's circuit breaker at once,
# so the next retry of the same request (5 by default) goes to another worker; the health checks
# then take the dead worker out of the rotation
ROUTER_FLAGS = [
    "--policy",
    "cache_aware",
    "--cb-failure-threshold",
    "1",
    "--health-check-interval-secs",
    "2",
    "--health-failure-threshold",
    "2",
]
PROMPTS = [f"Tell the story number {i} of the dragon and the town." for i in range(6)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(str(tmp_path_factory.mktemp("router_pair")))


def start(cmd: list[str], log) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def served(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "ddtree_requests_total"
    )


@pytest.fixture(scope="module")
def cluster(pair, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router_logs")
    ports = [free_port(), free_port()]
    workers = [
        start(
            [sys.executable, "-m", "ddtree.launch_server", *server_argv(pair, "DDTREE")]
            + ["--port", str(p), "--log-level", "warning"],
            open(logs / f"worker{i}.log", "w"),
        )
        for i, p in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    router = None
    try:
        for url, w in zip(urls, workers):
            wait_healthy(url, 120, w)
        port = free_port()
        router_log = open(logs / "router.log", "w")
        router = start(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
            + ["--port", str(port), "--prometheus-port", str(free_port()), "--worker-urls", *urls]
            + ["--log-level", "warn", *ROUTER_FLAGS],
            router_log,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180  # a loaded 2-core box: its health checks run late
        while True:  # the router registers its workers in the background
            assert router.poll() is None, (logs / "router.log").read_text()[-2000:]
            try:
                models = httpx.get(base + "/v1/models", timeout=2).json()["data"]
                if models and models[0]["id"] == pair[0]:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            assert time.monotonic() < deadline, "the router did not register the workers"
            time.sleep(0.3)
        yield base, urls, workers
    finally:
        for p in ([router] if router else []) + workers:
            stop(p)


def drive(base: str, model: str) -> None:
    """Chat, completions and a streamed chat through the router with the openai client, plus the
    native /generate, for every prompt; every one must succeed."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    for p in PROMPTS:
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], max_tokens=8
        )
        assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens
        text = client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0)
        assert text.choices[0].finish_reason in ("length", "stop")
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": p}],
                max_tokens=8,
                stream=True,
            )
        )
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        body = {"text": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        r = httpx.post(base + "/generate", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] > 0, r.text


def test_the_router_serves_through_ddtree_workers_and_survives_a_dead_one(cluster, pair):
    base, urls, workers = cluster
    drive(base, pair[0])
    counts = [served(u) for u in urls]
    assert sum(counts) == 4 * len(PROMPTS), counts  # every request reached a worker once
    busiest = counts.index(max(counts))
    os.kill(workers[busiest].pid, signal.SIGKILL)
    workers[busiest].wait(10)
    drive(base, pair[0])  # at once: the router has not noticed yet
    other = urls[1 - busiest]
    assert served(other) == counts[1 - busiest] + 4 * len(PROMPTS)
