"""`ddtree bench serving`: drive a running server with streamed OpenAI requests and report serving metrics.

For each concurrency level (one run may sweep several) it sends the prompt set with at most that many requests
in flight, optionally paced by Poisson arrivals at --request-rate, all streamed with usage. It reports request
and token throughput, TTFT, TPOT (per output token after the first) and end-to-end latency (mean, p50, p90,
p99), the mean accepted length read from the server's `ddtree` response extension (weighted by rounds),
the prefix-cache hit rate (usage.prompt_tokens_details.cached_tokens / prompt tokens) and, from the server's
/metrics (when it runs with --enable-metrics), the chosen-budget histogram, rounds per verify width,
predicted vs realised accept length and the per-round host time (`serving_metrics.py`). `--workload
multiturn` runs multi-turn conversations over a shared system prompt instead (`ddtree/bench/multiturn.py`).
Each level also reports the client's own load (`stream_client.ClientLoad`: its event-loop lag and
CPU share), so a client that cannot keep up is seen, not booked as server time. Results go to a JSON
file and PNG plots next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

from ddtree.bench.serving_report import (
    Result,
    finite,
    format_breakdown,
    format_client,
    format_table,
    level_summary,
)
from ddtree.bench.stream_client import ClientLoad, make_client, request_body

SYNTHETIC_TOPICS = (
    "a stack",
    "a queue",
    "binary search",
    "merge sort",
    "a linked list",
    "an LRU cache",
    "matrix multiplication",
    "a trie",
    "Dijkstra's algorithm",
    "a rate limiter",
    "JSON parsing",
    "a thread pool",
    "run-length encoding",
    "the Fibonacci numbers",
    "a bloom filter",
    "a heap",
)
SYNTHETIC_TEMPLATES = (
    "Write a Python function that implements {t}.",
    "Explain how {t} works, step by step.",
    'def {f}():\n    """Implementation of {t}."""\n',
    "List three common bugs in code for {t}.",
)


@dataclass
class Item:
    prompt: str | list[int] | None = None
    messages: list | None = None
    max_tokens: int | None = None


def synthetic_items(n: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = SYNTHETIC_TOPICS[i % len(SYNTHETIC_TOPICS)]
        template = rng.choice(SYNTHETIC_TEMPLATES)
        out.append(
            Item(prompt=template.format(t=topic, f="_".join(topic.split()[-2:]).replace("'", "")))
        )
    return out


def jsonl_items(path: str) -> list[Item]:
    """One JSON object per line: {"prompt": text or token ids} or {"messages": [...]}, optional "max_tokens"."""
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row.get("prompt", row.get("text"))
            if prompt is None and "messages" not in row:
                raise ValueError(f"{path}:{n}: needs a 'prompt' (or 'text') or 'messages' field")
            items.append(
                Item(prompt=prompt, messages=row.get("messages"), max_tokens=row.get("max_tokens"))
            )
    return items


async def one_request(client, model: str, item: Item, ns) -> Result:
    """One streamed request through `client` (`stream_client.HttpxStreams` or `OpenAIStreams`:
    both yield the OpenAI chunk objects as dicts)."""
    chat = item.messages is not None or (ns.chat and isinstance(item.prompt, str))
    body = request_body(model, item, ns, chat)
    t0 = time.perf_counter()
    res = Result(ok=False)
    try:
        async for chunk in client.chunks(body, chat):
            choices = chunk.get("choices")
            if choices and not res.ttft:
                c = choices[0]
                if (c.get("delta") or {}).get("content") if chat else c.get("text"):
                    res.ttft = time.perf_counter() - t0
            usage = chunk.get("usage")
            if usage:
                res.completion_tokens, res.prompt_tokens = (
                    usage["completion_tokens"],
                    usage["prompt_tokens"],
                )
                res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                ) or 0
            ext = chunk.get("ddtree")
            if ext:
                res.rounds, res.mean_accept_length = (
                    ext.get("rounds", 0),
                    ext.get("mean_accept_length", 0.0),
                )
                res.timing = ext.get("timing") or res.timing
        res.latency = time.perf_counter() - t0
        res.ttft = res.ttft or res.latency
        res.ok = True
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal to the benchmark
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_level(client, model: str, items: list[Item], concurrency: int, ns) -> dict:
    from ddtree.bench import serving_metrics

    before = await serving_metrics.scrape(ns.base_url, ns.api_key)
    row = await _run_level(client, model, items, concurrency, ns)
    server = serving_metrics.delta(before, await serving_metrics.scrape(ns.base_url, ns.api_key))
    row["server"] = server  # None without --enable-metrics on the server
    for key in (
        "mean_budget",
        "mean_rows",
        "rows_spread",
        "predicted_round_ms",
        "priced_round_ms",
        "predicted_accept_length",
        "round_ms",
        "host_ms",
        "grammar_host_ms",
        "device_ms",
        "idle_ms",
    ):
        row[key] = None if server is None else server[key]
    return row


async def _run_level(client, model: str, items: list[Item], concurrency: int, ns) -> dict:
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(ns.seed)

    async def gated(item: Item) -> Result:
        async with gate:
            return await one_request(client, model, item, ns)

    async with ClientLoad() as load:
        t0 = time.perf_counter()
        tasks = []
        for item in items:
            tasks.append(asyncio.create_task(gated(item)))
            if ns.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(ns.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    requests = [asdict(r) for r in results] if ns.save_requests else None
    row = level_summary(concurrency, ns.request_rate, results, duration, requests)
    row["client"] = {"kind": ns.client, **load.report()}
    return row


async def run(ns, items: list[Item]) -> dict:
    from ddtree.bench import multiturn

    client = make_client(ns.client, ns.base_url, ns.api_key, ns.timeout)
    try:
        model = ns.model or await client.model()
        if ns.warmup:
            await asyncio.gather(*(one_request(client, model, it, ns) for it in items[: ns.warmup]))
        levels = [
            await multiturn.with_evictions(
                run_level(client, model, items, c, ns), ns.base_url, ns.api_key
            )
            for c in ns.concurrency
        ]
    finally:
        await client.close()
    return {
        "base_url": ns.base_url,
        "model": model,
        "num_prompts": len(items),
        "max_tokens": ns.max_tokens,
        "temperature": ns.temperature,
        "response_format": ns.response_format,
        "dataset": ns.dataset_path or "synthetic",
        "client": ns.client,
        "results": levels,
    }


def plot(report: dict, path: str) -> bool:
    from ddtree.bench.plots import pyplot

    plt = pyplot()
    if plt is None:
        return False

    levels = report["results"]
    xs = [r["concurrency"] for r in levels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(xs, [r["output_throughput"] for r in levels], "o-")
    axes[0].set(xlabel="concurrency", ylabel="output tokens / s", title="throughput")
    axes[1].plot(xs, [r["mean_accept_length"] for r in levels], "o-", color="tab:green")
    axes[1].set(xlabel="concurrency", ylabel="tokens per round", title="mean accepted length")
    for key, style in (("ttft_ms", "o-"), ("tpot_ms", "s--")):
        axes[2].plot(xs, [r[key]["p50"] for r in levels], style, label=f"{key[:4].upper()} p50")
        axes[2].plot(
            xs, [r[key]["p99"] for r in levels], style, alpha=0.5, label=f"{key[:4].upper()} p99"
        )
    axes[2].set(xlabel="concurrency", ylabel="ms", title="latency", yscale="log")
    axes[2].legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    name = os.path.basename(report["model"].rstrip("/"))
    fig.suptitle(f"{name} - {report['num_prompts']} prompts, max_tokens {report['max_tokens']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# the default --json-schema: keys the grammar forces, bounded strings, an enum, numbers, an array
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 64},
        "category": {"type": "string", "enum": ["news", "sports", "science", "other"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
        "summary": {"type": "string", "maxLength": 256},
    },
    "required": ["title", "category", "score", "tags", "summary"],
}


def _json_schema(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def make_parser() -> argparse.ArgumentParser:
    from ddtree.bench.cli import DefaultsFormatter

    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="ddtree bench serving",
        description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsFormatter,
    )
    p.add_argument(
        "--base-url", default="http://127.0.0.1:30000", help="server root URL (without /v1)"
    )
    p.add_argument("--model", help="model name; default: the first one /v1/models lists")
    p.add_argument("--api-key", help="bearer token the server requires (default: none)")
    p.add_argument(
        "--dataset-path",
        help='JSONL prompt set ({"prompt"} or {"messages"} per line); '
        "default: the built-in synthetic set",
    )
    p.add_argument(
        "--num-prompts", type=int, default=64, help="prompts per level (the set is cycled)"
    )
    p.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4, 16], help="one or more levels"
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second; inf = all at once",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="max new tokens per request")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate exactly max_tokens (ddtree extension)"
    )
    p.add_argument("--chat", action="store_true", help="send text prompts to /v1/chat/completions")
    p.add_argument(
        "--response-format",
        choices=("text", "json_object", "json_schema"),
        default="text",
        help="structured outputs for every request (json_schema: --json-schema's); the report's "
        "grammar_host_ms is the host time grammar rows add per round",
    )
    p.add_argument(
        "--json-schema",
        type=_json_schema,
        default=BENCH_SCHEMA,
        help="the schema of --response-format json_schema: a JSON file (default: a built-in "
        "object of strings, an enum, numbers and an array)",
    )
    p.add_argument(
        "--client",
        choices=("httpx", "openai"),
        default="httpx",
        help="httpx: POST + SSE parsed with json (light, as SGLang's and vLLM's benchmarks); "
        "openai: the AsyncOpenAI SDK (checks the server against it; more client CPU per chunk)",
    )
    p.add_argument("--warmup", type=int, default=1, help="requests sent once before measuring")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic set and the arrivals")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument(
        "--output", default="bench_serving.json", help="JSON report; the PNG goes next to it"
    )
    p.add_argument(
        "--save-requests", action="store_true", help="keep per-request timings in the JSON"
    )
    p.add_argument(
        "--workload",
        choices=("single", "multiturn"),
        default="single",
        help="single: one request per prompt; multiturn: conversations over a shared system prompt",
    )
    from ddtree.bench import multiturn

    multiturn.add_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = make_parser().parse_args(argv)
    if any(c < 1 for c in ns.concurrency) or ns.num_prompts < 1 or ns.request_rate <= 0:
        print(
            "error: --concurrency, --num-prompts and --request-rate must be positive",
            file=sys.stderr,
        )
        return 2
    if ns.workload == "multiturn":
        from ddtree.bench import multiturn

        problem = multiturn.check(ns)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        try:
            convs = multiturn.conversations(ns)
        except (OSError, ValueError) as e:  # the tokenizer or the held-out text
            print(f"error: --workload multiturn: {e}", file=sys.stderr)
            return 2
        report = finite(asyncio.run(multiturn.run(ns, convs)))
    else:
        try:
            base = (
                jsonl_items(ns.dataset_path)
                if ns.dataset_path
                else synthetic_items(ns.num_prompts, ns.seed)
            )
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        items = [base[i % len(base)] for i in range(ns.num_prompts)] if base else []
        report = finite(asyncio.run(run(ns, items)))
    os.makedirs(os.path.dirname(os.path.abspath(ns.output)), exist_ok=True)
    with open(ns.output, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, allow_nan=False)  # strict JSON: no Infinity / NaN
    png = os.path.splitext(ns.output)[0] + ".png"
    wrote = [ns.output] + ([png] if plot(report, png) else [])
    print(format_table(report["results"]))
    breakdown = format_breakdown(report["results"])
    if breakdown:
        print(breakdown)
    load = format_client(report["results"])
    if load:
        print(load)
    print(f"wrote {' and '.join(wrote)}")
    return 1 if any(r["failed"] for r in report["results"]) else 0
