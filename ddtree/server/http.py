"""The HTTP edge: connection limits and timeouts, the API key, the body size limit and the
last-resort 500.

Pure ASGI middlewares (no BaseHTTPMiddleware: it buffers streams) and one uvicorn protocol subclass:
- `ApiKeyAuth`: with --api-key every route needs `Authorization: Bearer <key>`, except /health
  (liveness probes) and /metrics when --metrics-no-auth is given. Checked before the body is read;
  a request with two Authorization headers is refused whatever they hold (proxies disagree on
  which one counts).
- `NoSlashRedirect`: a path with a trailing slash is served as the path without it; Starlette
  would redirect it to an absolute URL built from the Host header, which a client controls.
- `BodyLimit`: a body over the limit gets 413, one that stops arriving gets 408; both close the
  connection.
- `CatchAll`: an exception no handler claimed becomes a JSON 500 and is logged once, and the
  keep-alive connection survives (uvicorn closes it when an exception escapes the app).
- `TimedH11Protocol`: a request head not complete HEADER_TIMEOUT_S after the connection opened (or
  after its first byte, on a keep-alive connection) closes the connection; uvicorn arms its
  keep-alive timer only after a response and disarms it on the first byte, so partial headers used
  to hang forever.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ddtree.server.protocol import APIError

logger = logging.getLogger("ddtree")

DEFAULT_MAX_BODY_BYTES = 8 << 20
HEADER_TIMEOUT_S = 10.0  # the whole request head, from connect or from the previous response
BODY_TIMEOUT_S = 30.0  # the whole request body, from the end of the head
KEEP_ALIVE_S = (
    30.0  # idle keep-alive connections (uvicorn's default is 5 s; OpenAI clients pool connections)
)
MAX_HEAD_BYTES = 64 << 10  # h11's limit on an incomplete request head
LIMIT_CONCURRENCY = 4096  # open connections + tasks before uvicorn answers 503


async def send_error(e: APIError, send, close: bool = False) -> None:
    from fastapi.responses import JSONResponse

    headers = {"connection": "close"} if close else None
    response = JSONResponse(e.body(), status_code=e.status, headers=headers)
    await response({"type": "http"}, None, send)


class ApiKeyAuth:
    def __init__(self, app, api_key: str | None, open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.open_paths = app, open_paths
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.expected is None or scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(given) > 1:
            return await send_error(
                APIError(401, "send one Authorization header, not several", code="invalid_api_key"),
                send,
            )
        # constant time: the key does not leak by timing
        if not hmac.compare_digest(given[0] if given else b"", self.expected):
            return await send_error(
                APIError(401, "invalid or missing API key", code="invalid_api_key"), send
            )
        await self.app(scope, receive, send)


class NoSlashRedirect:
    """`/v1/models/` is `/v1/models`: served, never redirected (api.py also turns Starlette's
    slash redirects off, so no response echoes the Host header)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            bare = path.rstrip("/") or "/"
            raw = scope.get("raw_path")
            scope = dict(scope, path=bare)
            if raw is not None:
                scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)


def get(router, path: str):
    """A GET route that answers HEAD too (as Starlette's own routes do; FastAPI's do not); the HEAD
    twin stays out of the OpenAPI schema."""

    def register(endpoint):
        router.add_api_route(path, endpoint, methods=["GET"])
        router.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
        return endpoint

    return register


class BodyLimit:
    """A body over `limit` bytes gets 413 before any handler runs; a body not complete `timeout`
    seconds after the head gets 408. The body is read here and replayed, so both hold without a
    Content-Length header."""

    def __init__(self, app, limit: int, timeout: float = BODY_TIMEOUT_S):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = APIError(
            413, f"request body exceeds the {self.limit}-byte limit", code="request_too_large"
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await send_error(too_big, send, close=True)
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.timeout
        while more:
            try:
                async with asyncio.timeout_at(deadline):
                    msg = await receive()
            except TimeoutError:
                slow = APIError(
                    408,
                    f"request body not received within {self.timeout:g} s",
                    code="request_timeout",
                )
                return await send_error(slow, send, close=True)
            if msg["type"] != "http.request":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if size > self.limit:
                return await send_error(too_big, send, close=True)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class CatchAll:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:  # noqa: BLE001 - the last line of defence: JSON, not a dropped conn
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:  # a started response cannot be amended; uvicorn closes its connection
                await send_error(
                    APIError(500, f"internal server error: {type(e).__name__}: {e}"), send
                )


class TimedH11Protocol(H11Protocol):
    header_timeout = HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # the head is complete: the body has BodyLimit's deadline
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()
        # the first bytes of the next head on a keep-alive connection
        elif self._head_timer is None:
            self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_kwargs() -> dict:
    """Connection limits for uvicorn.Config (see the constants above)."""
    return {
        "http": TimedH11Protocol,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
        "limit_concurrency": LIMIT_CONCURRENCY,
    }
