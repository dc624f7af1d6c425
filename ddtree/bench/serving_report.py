"""`ddtree bench serving`'s results and their report: the per-request `Result`, a level's summary
(throughput, TTFT / TPOT / end-to-end percentiles, accept length, cache hits, the server's TTFT by
phase) and the tables printed from it. Shared by the single-turn workload (`serving.py`), the
multi-turn one (`multiturn.py`) and the client's own load (`stream_client.py`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    rounds: int = 0
    mean_accept_length: float = 0.0
    error: str = ""
    timing: dict | None = None  # the server's TTFT by phase (the `ddtree` extension's "timing")


def summary(values: list[float], scale: float = 1000.0) -> dict:
    import numpy as np

    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * scale
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


# the server's phases of the time to first token (`ReqTimes.breakdown`), then the client's rest
BREAKDOWN_PARTS = ("queue", "engine_wait", "prefill", "publish", "ttft")


def ttft_breakdown(ok: list) -> dict | None:
    """p50 / p99 (ms) of each server-side TTFT phase over the requests that report one, and
    `client` = the client's TTFT minus the server's (HTTP, the SSE parse, the client's loop);
    None when the server sends no timing (not ddtree, or an older one)."""
    timed = [r for r in ok if getattr(r, "timing", None)]
    if not timed:
        return None
    out = {
        k: summary([r.timing[k] for r in timed if r.timing.get(k) is not None])
        for k in BREAKDOWN_PARTS
    }
    client = [r.ttft - r.timing["ttft"] for r in timed if r.timing.get("ttft") is not None]
    out["client"] = summary(client)
    out["requests"] = len(timed)
    return out


def level_summary(
    concurrency: int, request_rate, results: list, duration: float, requests: list | None
) -> dict:
    """One level's report from its per-request results (this module's `Result`, or the multi-turn
    workload's turns: the same fields)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    rounds = sum(r.rounds for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    return {
        "concurrency": concurrency,
        "request_rate": request_rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "total_output_tokens": out_tokens,
        "ttft_ms": summary([r.ttft for r in ok]),
        "ttft_breakdown_ms": ttft_breakdown(ok),
        "tpot_ms": summary(tpot),
        "e2e_latency_ms": summary([r.latency for r in ok]),
        "mean_accept_length": sum(r.mean_accept_length * r.rounds for r in ok) / rounds
        if rounds
        else 0.0,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "requests": requests,
    }


def finite(obj):
    """`obj` with each non-finite float as None (an unpaced --request-rate is inf): strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


# (header, unit, row key, percentile or None, decimals); every column is 11 wide after a space
TABLE_COLUMNS = (
    ("conc", "requests", "concurrency", None, 0),
    ("ok", "requests", "completed", None, 0),
    ("fail", "requests", "failed", None, 0),
    ("req/s", "req/s", "request_throughput", None, 2),
    ("out tok/s", "tok/s", "output_throughput", None, 1),
    ("TTFT p50", "ms", "ttft_ms", "p50", 1),
    ("TTFT p99", "ms", "ttft_ms", "p99", 1),
    ("TPOT p50", "ms", "tpot_ms", "p50", 2),
    ("TPOT p99", "ms", "tpot_ms", "p99", 2),
    ("E2E p50", "ms", "e2e_latency_ms", "p50", 1),
    ("cache hit", "ratio", "cache_hit_rate", None, 2),
    ("accept", "tok/round", "mean_accept_length", None, 2),
    # from the server's /metrics (- without --enable-metrics): budget per request-round, the
    # policy's predicted accept length, and per decode round its wall time and the host time
    # outside it; on the GPU's clock (CUDA) the round's span and the GPU idle before it
    ("budget", "nodes", "mean_budget", None, 1),
    # verify rows per request (root + drafts) and their spread across a round's batch; the cost
    # model's round ms beside the measured round ms of the rounds it priced (auto)
    ("rows/req", "rows", "mean_rows", None, 1),
    ("rows sd", "rows", "rows_spread", None, 1),
    ("pred rnd", "ms", "predicted_round_ms", None, 2),
    ("meas rnd", "ms", "priced_round_ms", None, 2),
    ("pred acc", "tok/round", "predicted_accept_length", None, 2),
    ("round", "ms", "round_ms", None, 2),
    ("host", "ms/round", "host_ms", None, 2),
    ("grammar", "ms/round", "grammar_host_ms", None, 2),
    ("device", "ms", "device_ms", None, 2),
    ("idle", "ms/round", "idle_ms", None, 2),
)


def format_table(levels: list[dict]) -> str:
    """One row per concurrency level under a header and a line of units."""
    lines = [
        "".join(f" {h:>11}" for h, *_ in TABLE_COLUMNS),
        "".join(f" {'(' + unit + ')':>11}" for _, unit, *_ in TABLE_COLUMNS),
    ]
    for r in levels:
        values = [
            (r[key][pct] if pct else r.get(key), digits) for _, _, key, pct, digits in TABLE_COLUMNS
        ]
        lines.append("".join(f" {'-':>11}" if v is None else f" {v:>11.{d}f}" for v, d in values))
    return "\n".join(lines)


BREAKDOWN_COLUMNS = ("queue", "engine_wait", "prefill", "publish", "ttft", "client")


def format_breakdown(levels: list[dict]) -> str | None:
    """The TTFT by phase per level (ms, p50 / p99), or None when no level has one."""
    rows = [(r["concurrency"], r.get("ttft_breakdown_ms")) for r in levels]
    if not any(b for _, b in rows):
        return None
    head = f" {'conc':>6}" + "".join(f" {k + ' p50/p99':>20}" for k in BREAKDOWN_COLUMNS)
    lines = [
        "TTFT by phase (ms): queue = arrival -> scheduled (engine_wait: of it, the wait for "
        "the running step), prefill, publish; ttft = the server's; client = the rest",
        head,
    ]
    for conc, b in rows:
        if not b:
            lines.append(f" {conc:>6}" + "".join(f" {'-':>20}" for _ in BREAKDOWN_COLUMNS))
            continue
        cells = (f"{b[k]['p50']:.1f} / {b[k]['p99']:.1f}" for k in BREAKDOWN_COLUMNS)
        lines.append(f" {conc:>6}" + "".join(f" {c:>20}" for c in cells))
    return "\n".join(lines)


def format_client(levels: list[dict]) -> str | None:
    """The client's own load per level (`stream_client.ClientLoad`), or None when not measured."""
    rows = [(r["concurrency"], r.get("client")) for r in levels]
    if not any(c for _, c in rows):
        return None
    lines = ["client load: event-loop lag (ms, mean / p99 / max) and CPU share of one core"]
    for conc, c in rows:
        if c:
            lag = c["loop_lag_ms"]
            lines.append(
                f" {conc:>6} {c['kind']:>7}  lag {lag['mean']:.2f} / {lag['p99']:.2f} / "
                f"{lag['max']:.1f}  cpu {c['cpu_share']:.2f}"
            )
    return "\n".join(lines)
