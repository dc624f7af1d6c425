"""Server-sent events, shared by every streaming route (OpenAI, native `/generate`, Responses): the
response that runs its close hook however the stream ends, the `data:` line, and several requests'
deltas as one iterator in arrival order."""

from __future__ import annotations

import asyncio
import json

from fastapi.responses import StreamingResponse

from ddtree.server.async_engine import AsyncEngine, Stream


class SSEResponse(StreamingResponse):
    """An event stream that runs `on_close` however it ends (finished, client gone, or cancelled)."""

    def __init__(self, content, on_close):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Interleaved:
    """The deltas of several streams as one async iterator of (choice index, Delta), in arrival
    order, until every stream has finished or failed. `close` aborts the requests that have not
    (the client went away)."""

    def __init__(self, streams: list[Stream]):
        self.streams, self.done = streams, set()
        self.merged: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Future] = []

    async def _forward(self, i: int, st: Stream) -> None:
        while True:
            d = await st.queue.get()
            self.merged.put_nowait((i, d))
            if d.finish_reason is not None or d.error is not None:
                return

    async def __aiter__(self):
        self.tasks = [
            asyncio.ensure_future(self._forward(i, st)) for i, st in enumerate(self.streams)
        ]
        while len(self.done) < len(self.streams):
            i, d = await self.merged.get()
            if d.finish_reason is not None or d.error is not None:
                self.done.add(i)
            yield i, d

    def close(self, aengine: AsyncEngine) -> None:
        for t in self.tasks:
            t.cancel()
        for i, st in enumerate(self.streams):
            if i not in self.done:
                aengine.abort(st.rid)
