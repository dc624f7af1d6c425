"""Issue 54 item 9: a hybrid prefix hit ends at a recurrent-state checkpoint, and the memory plan
keeps one per running request.

Seen on an H100: the Qwen3.6-27B shape in FP8 with `--max-running-requests 64`, 32 prompts repeated
across concurrency levels; DFLASH served 89% of prompt tokens from the cache, DDTREE `auto` 0%. The
plan gave the running requests every state-pool row they could take and the checkpoints only the
remainder: `auto`'s per-request stash (max budget 64 + 1 nodes, DFLASH's 16) filled the pool, leaving
about one checkpoint (DFLASH: 41), and 32 prompts taking turns over fewer rows than prompts never find
theirs (LRU). Here: the plan at that shape (no weights), the engine on the toy hybrid pair with a
state pool pinned at its running requests (`--max-mamba-cache-size`, which they used to fill), and
the misses' cause in /metrics."""

import asyncio

import httpx
import pytest
from engine_utils import accepted_prompts, make_llm
from server_fixtures import build_tiny_hybrid_pair, server_argv, thread_server, wait_idle

from ddtree import SamplingParams
from ddtree.bench.multiturn import STATE_COUNTERS, cache_counters
from ddtree.config import ServerArgs, resolve_server_args
from ddtree.config.memory_plan import memory_plan
from ddtree.engine.config import plan_pools

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PAGE = 4
H100_GIB = 80  # `check-config --device-memory-gib 80`
REPEATED = 32  # the bench's prompts, each repeated at every concurrency level


def args_27b(algorithm: str, *, cache: bool = True, **kw):
    """The 27B hybrid shape in block FP8 (config.json only), as the H100 bench served it."""
    return resolve_server_args(
        ServerArgs(
            model_path="inflate:qwen3.6-27b",
            speculative_algorithm=algorithm,
            device="cuda",
            quantization="fp8",
            speculative_draft_quantization="fp8",
            mamba_scheduler_strategy="no_buffer",
            max_running_requests=64,
            cuda_graph_max_bs=64,
            disable_radix_cache=not cache,
            **kw,
        ),
        (9, 0),
    )


def plan_27b(algorithm: str, *, cache: bool = True, **kw):
    """Its pools on one 80 GiB GPU, the weights' bytes as check-config counts them."""
    args = args_27b(algorithm, cache=cache, **kw)
    weights = memory_plan(args, H100_GIB * 2**30).weight_bytes_per_device
    return plan_pools(args, H100_GIB * 2**30, weights, "cuda")


@pytest.mark.parametrize(
    "algorithm, kw",
    [("DFLASH", {}), ("DDTREE", {"speculative_ddtree_budget": "auto"})],
    ids=["dflash", "ddtree-auto"],
)
def test_27b_fp8_plan_keeps_a_checkpoint_per_running_request(algorithm, kw):
    on = plan_27b(algorithm, **kw)
    # every running request can leave its prompt's state behind: the bench's 32 prompts all fit
    assert on.checkpoint_rows >= on.max_running_requests >= REPEATED
    assert on.checkpoint_bytes == on.checkpoint_rows * on.state_bytes_per_request
    if algorithm == "DDTREE":
        # the trade, visible: auto's stash fills the pool, so the checkpoints cap concurrency, and
        # --disable-radix-cache gives their rows back to running requests
        off = plan_27b(algorithm, cache=False, **kw)
        assert off.checkpoint_rows == 0 and off.max_running_requests > on.max_running_requests
        assert any("checkpoint per running request" in w for w in on.warnings)
        # check-config's plan says it
        text = memory_plan(args_27b(algorithm, **kw), H100_GIB * 2**30).format()
        assert f"({on.max_running_requests} running beside their checkpoints)" in text, text


def test_repeated_prompts_hit_under_auto_when_the_running_requests_fill_the_state_pool(
    toy_hybrid_pair,
):
    """The state pool pinned at the running requests (`--max-mamba-cache-size` =
    `--max-running-requests`: they used to take all of it, the 27B's condition, leaving no
    checkpoint row): prompts repeated one at a time hit on their second pass, with the same
    tokens."""
    llm = make_llm(
        toy_hybrid_pair,
        "DDTREE",
        speculative_ddtree_budget="auto",
        page_size=PAGE,
        max_running_requests=4,
        max_mamba_cache_size=4,
    )
    runner = llm.engine.runner
    assert runner.checkpoints is not None
    assert runner.checkpoints.num_rows >= runner.cfg.max_running_requests >= 1
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [list(p) for p in accepted_prompts(4, (13, 14, 15, 17))]
    first = [llm.generate([p], params)[0] for p in prompts]
    again = [llm.generate([p], params)[0] for p in prompts]
    assert [o.cached_tokens for o in first] == [0] * 4
    # all but the last prompt token, cut to the checkpoint at the last full page
    assert [o.cached_tokens for o in again] == [(len(p) - 1) // PAGE * PAGE for p in prompts]
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    stats = runner.bm.cache.stats
    assert stats.state_miss_tokens == 0 and stats.checkpoint_drops == 0
    runner.checkpoints.check_integrity(runner.bm.cache)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    return build_tiny_hybrid_pair(str(tmp_path_factory.mktemp("hybrid_prefix_pair")), seed=3)


@pytest.mark.parametrize("order", ["AA", "ABAB"])
def test_metrics_say_why_a_hybrid_prompt_missed(tiny_hybrid, order):
    """One running request and its one checkpoint row: a prompt repeated hits; two prompts taking
    turns each drop the other's checkpoint (LRU over fewer rows than prompts, the 27B bench's
    pattern), so every cached page is recomputed, and /metrics says why: the cached tokens as state
    misses, the checkpoint drops, the rows."""
    extra = ["--page-size", str(PAGE), "--speculative-ddtree-budget", "auto"]
    extra += ["--max-running-requests", "1", "--max-mamba-cache-size", "1"]
    prompts = {"A": list(range(3, 30)), "B": list(range(40, 67))}  # 27 tokens: 6 full pages + 3
    with thread_server(server_argv(tiny_hybrid, "DDTREE", *extra)) as srv:
        usage = []
        for name in order:
            body = {"prompt": prompts[name], "max_tokens": 3, "temperature": 0}
            r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
            usage.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        info = wait_idle(srv.base_url)
        text = httpx.get(srv.base_url + "/metrics", timeout=10).text
        # what `bench serving` reads around each level (its cache_state_miss_tokens)
        counters = asyncio.run(cache_counters(srv.base_url, None))
    assert info["kv_integrity"] == "ok"
    assert metric(text, "ddtree_prefix_cache_checkpoint_rows") == 1
    if order == "AA":
        assert usage == [0, 24]
        misses, drops = 0, 0
    else:
        assert usage == [0, 0, 0, 0]
        misses, drops = 2 * 24, 3  # the second A and B; B, A, B each took the other's row
    assert metric(text, "ddtree_prefix_cache_state_miss_tokens") == misses
    assert metric(text, "ddtree_prefix_cache_checkpoint_drops") == drops
    assert counters[next(iter(STATE_COUNTERS))] == misses
