"""The prefix cache seen from outside: `cached_tokens` in OpenAI usage (prompt_tokens_details) and
SGLang's meta_info, the cache metrics in /metrics, and `bench serving --workload multiturn`'s hit
rate (--disable-radix-cache: tests/test_prefix_cache_engine.py)."""

import json

import httpx
import pytest
from server_fixtures import build_tiny_pair, server_argv, thread_server, wait_idle

PROMPT = list(range(3, 40))  # 37 token ids (the tiny pair's vocab is 97)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(str(tmp_path_factory.mktemp("prefix_pair")), seed=5)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def multiturn(url: str, out) -> dict:
    from ddtree.bench.serving import main

    argv = ["--base-url", url, "--workload", "multiturn", "--num-prompts", "4"]
    argv += ["--concurrency", "2", "--max-tokens", "4", "--ignore-eos", "--turns", "2"]
    argv += ["--system-prompt-tokens", "40", "--turn-tokens", "6", "--warmup", "0"]
    argv += ["--prompt-source", "random"]  # the tiny pair's vocab is 97
    argv += ["--token-id-min", "3", "--token-id-max", "90", "--output", str(out)]
    assert main(argv) == 0
    (level,) = json.loads(out.read_text())["results"]
    assert level["completed"] == 8 and level["failed"] == 0
    return level


def test_cached_tokens_metrics_and_multiturn_hit_rate(pair, tmp_path):
    with thread_server(server_argv(pair, "DDTREE", "--page-size", "4")) as srv:
        url = srv.base_url
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
        again = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        # all but the last prompt token: 9 pages of 4 (kept) = 36
        assert again["prompt_tokens_details"]["cached_tokens"] == 36
        native = {"input_ids": PROMPT + [50], "sampling_params": {"max_new_tokens": 2}}
        meta = httpx.post(url + "/generate", json=native, timeout=60).json()["meta_info"]
        assert meta["cached_tokens"] >= 36
        level = multiturn(url, tmp_path / "on.json")
        assert level["cache_hit_rate"] > 0.3 and level["cached_tokens"] > 0
        assert level["cache_evicted_pages"] == 0  # read from /metrics around the level
        steps = level["steps"]  # the level's step plan, from the same scrapes
        # 8 turns: each prompt prefilled once (one chunk), decode batches of at most 2
        assert steps["prefill_steps"] >= 1 and steps["chunks_per_prompt"] == pytest.approx(1)
        assert 1 <= steps["mean_decode_batch"] <= 2 and steps["decode_steps"] > 0
        assert steps["graphed_share"] == 0  # on the CPU nothing is captured
        assert steps["graphable_share"] == 1  # short prompts: the device would replay them
        info = wait_idle(url)
        assert info["kv_integrity"] == "ok" and info["kv_pages_cached"] > 0
        text = httpx.get(url + "/metrics", timeout=10).text
        assert metric(text, "ddtree_prefix_cache_hit_tokens") >= 72 + level["cached_tokens"]
        assert 0 < metric(text, "ddtree_prefix_cache_hit_rate") < 1
        assert metric(text, "ddtree_kv_pages_cached") == info["kv_pages_cached"]
        assert metric(text, "ddtree_step_prefill_steps") >= steps["prefill_steps"] + 3
