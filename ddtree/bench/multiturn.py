"""`bench serving --workload multiturn`: multi-turn chat over the native `/generate` route.

A conversation is a system prompt of --system-prompt-tokens (shared by every conversation, or with
--distinct-system-prompts one of its own: the no-sharing workload) and --turns user turns of
--turn-tokens each. Turn t's prompt is the conversation so far as token ids: system + user_1 +
output_1 + ... + user_t, so a prefix cache can reuse everything but the new user turn. --concurrency
conversations run at once (--num-prompts conversations in all), each turn after the previous one
finished. Prompts are held-out in-distribution text by default (--prompt-source heldout: the Python
standard library modules the embedded pair's corpus leaves out, `bench.corpus.stdlib_files`, through
--tokenizer; the shared system prompt is the text's start, every other piece a window at a seeded
offset, distinct system prompts at distinct offsets), so drafts are accepted as in real use; with
--prompt-source random, token ids are drawn from [--token-id-min, --token-id-max). Per turn the
server's `meta_info.cached_tokens` is read back: the level reports the cache hit rate (cached /
prompt tokens) beside the usual throughput and latency numbers.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field

from ddtree.bench.serving_report import Result
from ddtree.bench.stream_client import sse_chunks
from ddtree.engine.scheduling.step_stats import StepStats, step_metric, summarize


@dataclass
class TurnResult(Result):
    """One turn: a `serving_report.Result`, its number and the reply (the next turn's history)."""

    turn: int = 0
    output_ids: list[int] = field(default_factory=list, repr=False)


def heldout_tokens(tokenizer: str | None) -> list[int]:
    """The held-out stdlib modules (`bench.corpus.stdlib_files`: never in the embedded pair's
    training corpus) as one token-id sequence, through `tokenizer` (a dir with tokenizer.json or
    the file; default: the embedded pair's)."""
    import os

    from tokenizers import Tokenizer

    from ddtree.bench.corpus import read_texts, stdlib_files

    if tokenizer is None:
        from ddtree.assets import default_model_paths

        tokenizer = default_model_paths()[0]
    path = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
    tok = Tokenizer.from_file(path)
    texts = read_texts(stdlib_files()[1])
    return [t for text in texts for t in tok.encode(text, add_special_tokens=False).ids]


def conversations(ns) -> list[tuple[list[int], list[list[int]]]]:
    """(system prompt, user turns) per conversation, token ids, seeded."""
    rng = random.Random(ns.seed)
    n_sys, n_turn = ns.system_prompt_tokens, ns.turn_tokens
    if getattr(ns, "prompt_source", "random") == "heldout":
        text = heldout_tokens(getattr(ns, "tokenizer", None))
        if len(text) < 2 * (n_sys + n_turn) + ns.num_prompts:
            raise ValueError(f"the held-out text has {len(text)} tokens: too few for this shape")
        # distinct system prompts start at distinct offsets: no two share a first page
        starts = rng.sample(range(len(text) - n_sys), ns.num_prompts)

        def system_of(j: int) -> list[int]:
            o = starts[j] if ns.distinct_system_prompts else 0
            return text[o : o + n_sys]

        def turn_of() -> list[int]:
            o = rng.randrange(n_sys, len(text) - n_turn)
            return text[o : o + n_turn]
    else:

        def ids(n: int) -> list[int]:
            return [rng.randrange(ns.token_id_min, ns.token_id_max) for _ in range(n)]

        shared = ids(n_sys)

        def system_of(j: int) -> list[int]:
            return ids(n_sys) if ns.distinct_system_prompts else shared

        def turn_of() -> list[int]:
            return ids(n_turn)

    return [(system_of(j), [turn_of() for _ in range(ns.turns)]) for j in range(ns.num_prompts)]


async def one_turn(http, url: str, ids: list[int], ns, turn: int) -> TurnResult:
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": ns.max_tokens,
            "temperature": ns.temperature,
            "ignore_eos": ns.ignore_eos,
        },
    }
    res = TurnResult(ok=False, turn=turn)
    t0 = time.perf_counter()
    last = None
    try:
        async for last in sse_chunks(http, url + "/generate", body):
            if not res.ttft and last.get("output_ids"):
                res.ttft = time.perf_counter() - t0
        res.latency = time.perf_counter() - t0
        meta = last["meta_info"]
        res.output_ids = list(last["output_ids"])
        res.completion_tokens = meta["completion_tokens"]
        res.prompt_tokens = meta["prompt_tokens"]
        res.cached_tokens = meta.get("cached_tokens", 0)
        res.rounds = meta.get("spec_verify_ct", 0)
        res.mean_accept_length = meta.get("spec_accept_length", 0.0)
        res.timing = meta.get("timing")
        res.ttft = res.ttft or res.latency
        res.ok = True
    except Exception as e:  # noqa: BLE001 - a failed turn is counted, not fatal to the benchmark
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_conversation(http, url, system, turns, ns) -> list[TurnResult]:
    history, out = list(system), []
    for t, user in enumerate(turns):
        history += user
        res = await one_turn(http, url, list(history), ns, t)
        out.append(res)
        if not res.ok:
            break
        history += res.output_ids
    return out


async def run_level(url: str, convs, concurrency: int, ns) -> dict:
    """One level: `concurrency` conversations at a time; `serving_report.level_summary`'s keys plus
    `ttft_later_turns_ms` (turns after the first: the ones a conversation's own history can hit)."""
    from ddtree.bench.serving_report import level_summary, summary, ttft_breakdown
    from ddtree.bench.stream_client import Lanes

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    gate = asyncio.Semaphore(concurrency)
    lanes = Lanes(headers, ns.timeout)  # one connection per conversation in flight
    try:

        async def gated(system, turns):
            async with gate, lanes.lane() as http:
                return await run_conversation(http, url, system, turns, ns)

        for _ in range(ns.warmup):
            async with lanes.lane() as http:
                await one_turn(http, url, [ns.token_id_min] * 8, ns, 0)
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(gated(s, t) for s, t in convs))
        duration = time.perf_counter() - t0
    finally:
        await lanes.aclose()
    results = [r for run in runs for r in run]
    requests = (
        [{k: v for k, v in asdict(r).items() if k != "output_ids"} for r in results]
        if ns.save_requests
        else None
    )
    out = level_summary(concurrency, None, results, duration, requests)
    later = [r for r in results if r.ok and r.turn > 0]
    out["ttft_later_turns_ms"] = summary([r.ttft for r in later])
    out["ttft_breakdown_later_turns_ms"] = ttft_breakdown(later)
    return out


CACHE_COUNTERS = ("ddtree_prefix_cache_evicted_pages_total", "ddtree_prefix_cache_hit_tokens_total")
# hybrid targets: why cached pages were not reused (no state checkpoint ended them; checkpoints
# dropped for newer ones), as level keys; a server that does not export them leaves them None
STATE_COUNTERS = {
    "ddtree_prefix_cache_state_miss_tokens_total": "cache_state_miss_tokens",
    "ddtree_prefix_cache_checkpoint_drops_total": "cache_checkpoint_drops",
}
# the engine's per-step counters (engine/scheduling/step_stats.py), when the server exports them
STEP_COUNTERS = {step_metric(name) + "_total": name for name in StepStats().as_dict()}


async def cache_counters(url: str, api_key: str | None) -> dict[str, float] | None:
    """The server's prefix-cache counters (and its step counters, when exported) from /metrics,
    or None (metrics off, or not ddtree)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10, headers=headers) as http:
            r = await http.get(url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    found: dict[str, float] = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{", 1)[0]  # a --dp-size server's replicas (dp_rank) add up
        if name in CACHE_COUNTERS or name in STEP_COUNTERS or name in STATE_COUNTERS:
            found[name] = found.get(name, 0.0) + float(value)
    return found if all(c in found for c in CACHE_COUNTERS) else None


async def with_evictions(level_coro, url: str, api_key: str | None) -> dict:
    """Run a level; add the pages the server's cache evicted meanwhile (None without /metrics)."""
    before = await cache_counters(url, api_key)
    level = await level_coro
    after = await cache_counters(url, api_key) if before is not None else None
    key = CACHE_COUNTERS[0]
    level["cache_evicted_pages"] = after[key] - before[key] if after is not None else None
    for metric, level_key in STATE_COUNTERS.items():
        both = after is not None and metric in after and metric in before
        level[level_key] = after[metric] - before[metric] if both else None
    # the level's step plan: prefill steps, graphed share, passes, batch sizes (None: not exported)
    level["steps"] = None
    if after is not None and all(k in after and k in before for k in STEP_COUNTERS):
        level["steps"] = summarize({n: after[k] - before[k] for k, n in STEP_COUNTERS.items()})
    return level


async def run(ns, convs=None) -> dict:
    """convs: `conversations(ns)` when already built (the caller reports its errors)."""
    url = ns.base_url.rstrip("/")
    convs = convs if convs is not None else conversations(ns)
    levels = [
        await with_evictions(run_level(url, convs, c, ns), url, ns.api_key) for c in ns.concurrency
    ]
    return {
        "base_url": ns.base_url,
        "model": ns.model or url,
        "workload": "multiturn",
        "num_prompts": ns.num_prompts,
        "system_prompt_tokens": ns.system_prompt_tokens,
        "distinct_system_prompts": ns.distinct_system_prompts,
        "turns": ns.turns,
        "turn_tokens": ns.turn_tokens,
        "prompt_source": ns.prompt_source,
        "max_tokens": ns.max_tokens,
        "temperature": ns.temperature,
        "dataset": "multiturn",
        "results": levels,
    }


def add_flags(p, distinct: bool = True) -> None:
    """The workload's flags (`distinct=False`: without --distinct-system-prompts, for a caller that
    runs both kinds itself)."""
    g = p.add_argument_group("multi-turn workload (--workload multiturn)")
    g.add_argument(
        "--system-prompt-tokens", type=int, default=2048, help="system prompt length (tokens)"
    )
    if distinct:
        g.add_argument(
            "--distinct-system-prompts",
            action="store_true",
            help="each conversation its own system prompt (nothing shared)",
        )
    g.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    g.add_argument("--turn-tokens", type=int, default=64, help="tokens per user turn")
    g.add_argument(
        "--prompt-source",
        choices=("heldout", "random"),
        default="heldout",
        help="heldout: held-out stdlib text (drafts accepted as in use); random: random token ids",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer dir (or tokenizer.json) for --prompt-source heldout; default: the embedded "
        "pair's (also the inflated pairs')",
    )
    g.add_argument(
        "--token-id-min", type=int, default=100, help="--prompt-source random: smallest token id"
    )
    g.add_argument(
        "--token-id-max", type=int, default=1000, help="--prompt-source random: ids stay below"
    )


def check(ns) -> str | None:
    """The problem with the multi-turn flags, or None."""
    if ns.system_prompt_tokens < 0 or ns.turns < 1 or ns.turn_tokens < 1:
        return "--system-prompt-tokens must be >= 0, --turns and --turn-tokens >= 1"
    if not 0 <= ns.token_id_min < ns.token_id_max:
        return "--token-id-min must be >= 0 and below --token-id-max"
    # bench serving's flags that only the single-request workload reads
    unused = [
        flag
        for flag, given in (
            ("--dataset-path", getattr(ns, "dataset_path", None)),
            ("--chat", getattr(ns, "chat", False)),
            ("--request-rate", getattr(ns, "request_rate", float("inf")) != float("inf")),
        )
        if given
    ]
    if unused:
        return f"{', '.join(unused)}: not used by --workload multiturn; drop them"
    return None
