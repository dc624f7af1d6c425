"""`bench serving`'s side of the wire: the streamed request, and what the client itself costs.

Two clients send the same OpenAI request and hand `serving.one_request` the same chunk dicts:
- `httpx` (the default): one POST per request, the SSE lines parsed with `json.loads`: the way
  SGLang's and vLLM's serving benchmarks read a stream (aiohttp there), so the client stays light at
  high concurrency.
- `openai`: the official `AsyncOpenAI` SDK (its pydantic chunk objects, turned back into dicts), for
  checking the server against the SDK users run. It costs more client CPU: a share of 0.71 of a
  core against httpx's 0.42 on a 64-stream loopback load (a stub server, 384 requests of 128
  tokens in chunks of 7).

`ClientLoad` measures the benchmark process while a level runs: its event loop's lag (a task that
sleeps 1 ms and records how late it wakes) and its CPU time per wall second. A loaded client shows
as lag and a CPU share near 1.0: time the server's TTFT breakdown books as `client`, and
requests that reach the server late (a smaller decode batch than the concurrency allows).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

CLIENTS = ("httpx", "openai")
PROBE_S = 0.001


def request_body(model: str, item, ns, chat: bool) -> dict:
    body = {
        "model": model,
        "max_tokens": item.max_tokens or ns.max_tokens,
        "temperature": ns.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ns.ignore_eos:
        body["ignore_eos"] = True  # ddtree (and SGLang / vLLM) extension
    fmt = getattr(ns, "response_format", "text")
    if fmt == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": ns.json_schema},
        }
    if chat:
        body["messages"] = item.messages or [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    return body


async def sse_chunks(http, url: str, body: dict) -> AsyncIterator[dict]:
    """POST `body` to `url` and yield each SSE `data:` object (up to `[DONE]`); a non-200 status
    or an error object in the stream raises, with the server's reason."""
    async with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # an error the server met after the stream began
                raise RuntimeError(f"stream error: {str(chunk['error'])[:300]}")
            yield chunk


class Lanes:
    """One keep-alive connection per request in flight: a request takes a free lane (an
    `httpx.AsyncClient` of one connection, made on first need) and gives it back when its stream
    is closed. A shared pool instead (one `AsyncClient`, `max_connections` >= the concurrency)
    starts requests late on reused connections at high concurrency, with the event loop idle: the
    server books that as `client` time in the TTFT breakdown and runs a smaller batch than the
    concurrency (BENCHMARKS.md's history has the measurement)."""

    def __init__(self, headers: dict, timeout: float, wrap=None):
        import ssl

        self.headers, self.timeout, self.wrap = headers, timeout, wrap
        # one TLS context for every lane: a new AsyncClient loads the CA store otherwise
        # (~20 ms each, on the event loop; 64 lanes stalled the first wave by 1.3 s)
        self.tls = ssl.create_default_context()
        self.free: list = []
        self.https: list = []

    @asynccontextmanager
    async def lane(self):
        if self.free:
            lane = self.free.pop()
        else:
            import httpx

            http = httpx.AsyncClient(
                timeout=self.timeout,
                limits=httpx.Limits(max_connections=1),
                headers=self.headers,
                verify=self.tls,
            )
            self.https.append(http)
            lane = self.wrap(http) if self.wrap else http
        try:
            yield lane
        finally:
            self.free.append(lane)

    async def aclose(self) -> None:
        for http in self.https:
            await http.aclose()
        self.free, self.https = [], []


class HttpxStreams:
    """POST + SSE, `json.loads` per line."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        self.url = base_url.rstrip("/") + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.lanes = Lanes(headers, timeout)

    async def model(self) -> str:
        async with self.lanes.lane() as http:
            r = await http.get(self.url + "/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    async def chunks(self, body: dict, chat: bool) -> AsyncIterator[dict]:
        path = "/chat/completions" if chat else "/completions"
        async with self.lanes.lane() as http:
            async for chunk in sse_chunks(http, self.url + path, body):
                yield chunk

    async def close(self) -> None:
        await self.lanes.aclose()


class OpenAIStreams:
    """The same requests through `AsyncOpenAI`, one SDK client per lane (its own error types on
    failure)."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        from openai import AsyncOpenAI

        def sdk(http):
            return AsyncOpenAI(
                base_url=base_url.rstrip("/") + "/v1",
                api_key=api_key or "none",
                max_retries=0,
                timeout=timeout,
                http_client=http,
            )

        self.lanes = Lanes({}, timeout, wrap=sdk)

    async def model(self) -> str:
        async with self.lanes.lane() as client:
            return (await client.models.list()).data[0].id

    async def chunks(self, body: dict, chat: bool) -> AsyncIterator[dict]:
        body = dict(body)
        extra = {"ignore_eos": body.pop("ignore_eos")} if "ignore_eos" in body else None
        async with self.lanes.lane() as client:
            create = client.chat.completions.create if chat else client.completions.create
            stream = await create(**body, extra_body=extra)
            async with stream:
                async for chunk in stream:
                    yield chunk.to_dict()  # the SDK's pydantic object, extras ("ddtree") included

    async def close(self) -> None:
        await self.lanes.aclose()


def make_client(kind: str, base_url: str, api_key: str | None, timeout: float):
    if kind not in CLIENTS:
        raise ValueError(f"--client {kind!r}: use one of {CLIENTS}")
    cls = HttpxStreams if kind == "httpx" else OpenAIStreams
    return cls(base_url, api_key, timeout)


class ClientLoad:
    """`async with ClientLoad() as load:` around a level; then `load.report()`."""

    async def __aenter__(self) -> ClientLoad:
        self.lags: list[float] = []
        self._stop = False
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        self._task = asyncio.create_task(self._probe())
        return self

    async def _probe(self) -> None:
        while not self._stop:
            t = time.perf_counter()
            await asyncio.sleep(PROBE_S)
            self.lags.append(time.perf_counter() - t - PROBE_S)

    async def __aexit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0
        self._stop = True
        await self._task

    def report(self) -> dict:
        from ddtree.bench.serving_report import summary

        lag = summary(self.lags)
        lag["max"] = max(self.lags, default=0.0) * 1000.0
        return {"loop_lag_ms": lag, "cpu_share": self.cpu / self.wall if self.wall > 0 else 0.0}
