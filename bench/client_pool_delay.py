"""How late a streamed request leaves the benchmark client: one shared httpx pool against one
connection per request in flight (`ddtree/bench/stream_client.py`'s lanes).

A stub OpenAI server (uvicorn, its own process) streams `--max-tokens` tokens per request in chunks
of 7, one chunk per `--round-ms` (the 8B-shape server's rhythm at concurrency 64), so the server
side is the same for both clients. For each client it runs `--concurrency` requests in flight,
`--waves` times over, and reports from httpx's trace hooks when each request's headers started to
go out (after it was issued), its time to first chunk, and the output tok/s.

    PYTHONPATH=. python3 bench/client_pool_delay.py --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import httpx
import numpy as np

STUB = """
import asyncio, json, sys
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
import uvicorn
app, ROUND = FastAPI(), float(sys.argv[2])
@app.post("/v1/completions")
async def completions(body: dict):
    n = body["max_tokens"]
    async def chunks():
        sent = 0
        while sent < n:
            await asyncio.sleep(ROUND)
            k = min(7, n - sent)
            sent += k
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": "t " * k}]}) + "\\n\\n"
        yield "data: [DONE]\\n\\n"
    return StreamingResponse(chunks(), media_type="text/event-stream")
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


async def level(kind: str, ns) -> dict:
    from ddtree.bench.stream_client import Lanes

    url = f"http://127.0.0.1:{ns.port}/v1/completions"
    shared = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=ns.concurrency + 8))
    lanes = Lanes({}, 60.0)
    gate = asyncio.Semaphore(ns.concurrency)
    body = {"model": "m", "prompt": "x", "max_tokens": ns.max_tokens, "stream": True}

    async def one():
        t0, sent = time.perf_counter(), []

        async def trace(name, info):
            if name == "http11.send_request_headers.started":
                sent.append(time.perf_counter() - t0)

        async def read(http):  # the whole stream: the connection is reused only after it
            first = None
            async with http.stream("POST", url, json=body, extensions={"trace": trace}) as r:
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - t0
            return first

        if kind == "shared pool":
            first = await read(shared)
        else:
            async with lanes.lane() as http:
                first = await read(http)
        return sent[0], first

    async def gated():
        async with gate:
            return await one()

    t0 = time.perf_counter()
    got = await asyncio.gather(*(gated() for _ in range(ns.concurrency * ns.waves)))
    wall = time.perf_counter() - t0
    await shared.aclose()
    await lanes.aclose()
    sent, first = (np.array(x) * 1e3 for x in zip(*got))
    return {
        "client": kind,
        "headers_sent_ms": {p: float(np.percentile(sent, q)) for p, q in (("p50", 50), ("p99", 99))}
        | {"max": float(sent.max())},
        "first_chunk_ms": {
            p: float(np.percentile(first, q)) for p, q in (("p50", 50), ("p99", 99))
        },
        "wall_s": wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--waves", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--round-ms", type=float, default=30.0)
    p.add_argument("--port", type=int, default=30117)
    p.add_argument("--output", help="JSON of the rows")
    ns = p.parse_args()
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(ns.port), str(ns.round_ms / 1e3)])
    try:
        for _ in range(100):
            try:
                httpx.post(f"http://127.0.0.1:{ns.port}/v1/completions", json={"max_tokens": 1})
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        rows = [asyncio.run(level(kind, ns)) for kind in ("shared pool", "lanes")]
    finally:
        stub.terminate()
        stub.wait()
    print(
        f"{'client':>12} {'headers sent p50/p99/max ms':>30} {'first chunk p50/p99 ms':>24}"
        f" {'out tok/s':>10}"
    )
    tokens = ns.concurrency * ns.waves * ns.max_tokens
    for r in rows:
        h, f = r["headers_sent_ms"], r["first_chunk_ms"]
        print(
            f"{r['client']:>12} {h['p50']:>12.1f} / {h['p99']:.1f} / {h['max']:.1f}"
            f" {f['p50']:>14.1f} / {f['p99']:.1f} {tokens / r['wall_s']:>10.0f}"
        )
    if ns.output:
        with open(ns.output, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(ns), "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
