"""Time to first token: a newly arrived request is prefilled before the next decoding round (not
after one), a burst of arrivals delays decoding by at most MAX_PREFILL_STREAK prefills, a cached
request's first token comes from the first step after its admission, and every request carries
ordered `ReqTimes` stamps (engine, /metrics, meta_info, the bench's breakdown)."""

import json

import httpx
import pytest
from server_fixtures import build_tiny_pair, server_argv, thread_server
from test_scheduler_interleave import req, run, scheduler

from ddtree import SamplingParams
from ddtree.engine.scheduling.scheduler import MAX_PREFILL_STREAK

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(str(tmp_path_factory.mktemp("ttft_pair")), seed=3)


def test_arrival_after_a_prefill_is_prefilled_before_the_next_round():
    s = scheduler(chunk=64)
    s.add(req(10))
    assert run(s, 2) == [("P", 10), ("D", 1)]
    s.add(req(10))
    assert run(s, 1) == [("P", 10)]
    s.add(req(7))  # arrives while that prefill ran: before the fix it waited a round ("D", 2)
    assert run(s, 2) == [("P", 7), ("D", 3)]


def test_a_burst_of_arrivals_delays_decoding_by_at_most_the_streak():
    s = scheduler(chunk=64)
    s.add(req(10))
    run(s, 2)
    trace = []
    for _ in range(3 * (MAX_PREFILL_STREAK + 1)):
        s.add(req(5))  # one new request before every step
        trace += run(s, 1)
    kinds = "".join(k for k, _ in trace)
    assert "P" * (MAX_PREFILL_STREAK + 1) not in kinds and "D" in kinds, kinds
    # a long prompt's later chunks still alternate with decoding rounds
    s2 = scheduler(chunk=64)
    s2.add(req(10))
    run(s2, 2)
    s2.add(req(64 * 3))
    assert run(s2, 6) == [("P", 64), ("D", 1), ("P", 64), ("D", 1), ("P", 64), ("D", 2)]


def _ordered(t) -> None:
    assert 0 < t.arrival <= t.queued <= t.scheduled <= t.prefill_chunks[0]
    assert t.prefill_chunks == sorted(t.prefill_chunks) and t.prefill_chunks[-1] <= t.first_token


def test_cached_request_first_token_one_step_after_admission(pair, one_torch_thread):
    """Three requests decode; a later turn of one conversation (its prefix cached) arrives right
    after another request's prefill: the very next step prefills it and samples its first token."""
    from engine_utils import make_llm

    engine = make_llm(pair, "DDTREE", speculative_ddtree_budget=8, page_size=4).engine
    prompts = [[3 + (7 * i + j) % 90 for i in range(30 + 5 * j)] for j in range(4)]
    first = engine.add_request(prompts[0], GREEDY)
    while not first.is_finished:
        engine.step()
    for p in prompts[1:3]:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.step()  # their prefill
    engine.step()  # a decoding round
    other = engine.add_request(prompts[3], GREEDY)
    assert engine.step().reqs == (other,)  # a prefill step
    later = prompts[0] + first.output_ids + [5, 6, 7]
    turn = engine.add_request(later, GREEDY)
    advanced = engine.step().reqs
    assert turn in advanced and engine.scheduler.last_was_prefill
    assert turn.cached_tokens >= 4 * (len(prompts[0]) // 4) and len(turn.output_ids) == 1
    _ordered(turn.times)
    assert turn.times.breakdown()["prefill_chunks"] == 1


def test_timing_in_meta_info_metrics_and_the_bench_breakdown(pair, tmp_path):
    from ddtree.bench.serving import main
    from ddtree.bench.serving_report import format_breakdown

    with thread_server(server_argv(pair, "DDTREE", "--page-size", "4")) as srv:
        url = srv.base_url
        body = {"input_ids": list(range(3, 40)), "sampling_params": {"max_new_tokens": 3}}
        meta = httpx.post(url + "/generate", json=body, timeout=60).json()["meta_info"]
        t = meta["timing"]
        assert t["prefill_chunks"] == 1 and t["engine_wait"] <= t["queue"] <= t["ttft"]
        assert t["queue"] + t["prefill"] + t["publish"] == pytest.approx(t["ttft"], abs=1e-6)
        comp = {"prompt": list(range(3, 30)), "max_tokens": 2, "temperature": 0}
        ext = httpx.post(url + "/v1/completions", json=comp, timeout=60).json()["ddtree"]
        assert ext["timing"]["ttft"] > 0
        text = httpx.get(url + "/metrics", timeout=10).text
        for name in ("queue_time", "prefill_time", "first_token_publish"):
            count = [ln for ln in text.splitlines() if ln.startswith(f"ddtree_request_{name}")]
            assert any(ln.split("_count ")[-1] == "2.0" for ln in count if "_count " in ln), name
        out = tmp_path / "mt.json"
        argv = ["--base-url", url, "--workload", "multiturn", "--num-prompts", "2"]
        argv += ["--concurrency", "2", "--max-tokens", "3", "--ignore-eos", "--turns", "2"]
        argv += ["--system-prompt-tokens", "30", "--turn-tokens", "5", "--warmup", "0"]
        argv += ["--prompt-source", "random", "--token-id-min", "3", "--token-id-max", "90"]
        argv += ["--output", str(out)]
        assert main(argv) == 0
    (level,) = json.loads(out.read_text())["results"]
    b = level["ttft_breakdown_ms"]
    assert b["requests"] == 4 and level["ttft_breakdown_later_turns_ms"]["requests"] == 2
    assert 0 < b["prefill"]["p50"] <= b["ttft"]["p99"] and b["client"]["p50"] > 0
    assert "prefill p50/p99" in format_breakdown([level])


def test_multiturn_heldout_prompts_are_in_distribution_text():
    """The default workload is held-out stdlib text through the embedded tokenizer: the shared
    system prompt is the text's start, distinct ones start at distinct offsets, turns are windows
    of it; random ids stay an option."""
    from ddtree.bench import multiturn
    from ddtree.bench.serving import make_parser

    argv = ["--workload", "multiturn", "--num-prompts", "6", "--system-prompt-tokens", "256"]
    ns = make_parser().parse_args(argv)
    assert ns.prompt_source == "heldout"
    text = multiturn.heldout_tokens(None)
    convs = multiturn.conversations(ns)
    assert all(c[0] == text[:256] for c in convs) and len(convs[0][1]) == ns.turns
    turn = convs[0][1][0]
    assert len(turn) == ns.turn_tokens and any(
        text[i : i + len(turn)] == turn for i in range(len(text))
    )
    ns.distinct_system_prompts = True
    firsts = {tuple(c[0][:16]) for c in multiturn.conversations(ns)}
    assert len(firsts) == 6  # no two share a first page
    ns.prompt_source = "random"
    assert max(max(c[0]) for c in multiturn.conversations(ns)) < ns.token_id_max


def test_prefix_bench_takes_an_inflate_spec_without_a_drafter(monkeypatch, tmp_path):
    """The 27B hybrid run: `--model-path inflate:qwen3.6-27b` brings its own drafter; a plain dir
    still needs one."""
    from ddtree.tools.studies import prefix_cache

    seen = []

    def fake_serve(ns, name, extra):
        seen.append((name, prefix_cache.workload(ns, False).tokenizer))
        level = {"ttft_ms": {"p50": 10.0, "p99": 20.0}, "output_throughput": 1.0}
        level |= {"cache_hit_rate": 0.5, "failed": 0, "mean_accept_length": 3.0}
        return {"shared": level, "distinct": dict(level)}

    monkeypatch.setattr(prefix_cache, "serve", fake_serve)
    argv = ["--model-path", "inflate:qwen3.6-27b", "--out", str(tmp_path)]
    assert prefix_cache.main(argv) == 1  # the fake levels miss the 5x target
    assert [n for n, _ in seen] == ["cache", "no cache"] and seen[0][1] is None
    assert prefix_cache.main(["--model-path", str(tmp_path)]) == 2


@pytest.mark.parametrize("group, head_dim", [(4, 128), (6, 256), (1, 64), (8, 128)])
def test_warm_up_prefills_reach_every_extend_tile_config(group, head_dim):
    """Every prompt length up to the chunk takes a tile config some warm-up prefill compiled, and
    lengths that are not a multiple of 16 are warmed beside the buckets (a first request of 5
    tokens at group 4 compiled a new kernel variant inside its TTFT)."""
    from ddtree.engine.warmup import extra_prefill_lengths, prefill_buckets
    from ddtree.kernels.tree_attention.tuning import default_config

    buckets = prefill_buckets(2048, 10_000)
    extra = extra_prefill_lengths(buckets, group, head_dim)
    warmed = {default_config(n * group, head_dim) for n in buckets + extra}
    assert all(default_config(n * group, head_dim) in warmed for n in range(1, 2049))
    assert any(n % 16 for n in extra) and not set(extra) & set(buckets)
