"""The FastAPI app: OpenAI routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models`), `/health`,
`/metrics` (Prometheus, with --enable-metrics), `/get_server_info` (pool counts and allocator integrity, read
between two engine steps), and SGLang's native `/generate` and `/get_model_info`
(`ddtree.server.native_api`). Every failure is an OpenAI-style
`{"error": {message, type, param, code}}` body.
The `ddtree` response extension is documented in `ddtree.server.openai_serving`.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree.server import protocol
from ddtree.server.async_engine import AsyncEngine
from ddtree.server.metrics import pool_snapshot
from ddtree.server.native_api import native_router
from ddtree.server.openai_serving import OpenAIServing
from ddtree.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_BODY_BYTES = 8 << 20


def json_error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413 before any handler runs. The body is read here and
    replayed, so the limit holds without a Content-Length header too."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"request body exceeds the {self.limit}-byte limit", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await json_error(too_big)(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if size > self.limit:
                return await json_error(too_big)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return json_error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            return json_error(APIError(400, f"request body is not valid JSON: {err.get('msg')}", code="invalid_json"))
        param = protocol.error_param(err.get("loc", ()))
        if param is None:
            return json_error(APIError(400, "the request body must be a JSON object (Content-Type: application/json)",
                                       code="invalid_type"))
        code = "missing_required_parameter" if err.get("type") == "missing" else "invalid_type"
        return json_error(APIError(400, f"{param}: {err.get('msg')}", param=param, code=code))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return json_error(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _server_error(request, e: Exception):
        return json_error(APIError(500, f"internal server error: {type(e).__name__}: {e}"))


def create_app(aengine: AsyncEngine, args, metrics=None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    engine = aengine.engine
    serving = OpenAIServing(aengine, args)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        aengine.start()
        yield
        aengine.shutdown()

    app = FastAPI(title="ddtree", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    add_error_handlers(app)

    def check_key(request: Request) -> None:
        if args.api_key and request.headers.get("authorization") != f"Bearer {args.api_key}":
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    @v1.get("/models")
    async def models():
        card = {"id": serving.model_name, "object": "model", "created": created, "owned_by": "ddtree",
                "root": args.model_path, "max_model_len": engine.max_context}
        return {"object": "list", "data": [card]}

    app.include_router(v1)
    app.include_router(native_router(serving, args, engine), dependencies=[Depends(check_key)])

    @app.get("/health")
    async def health():
        if not aengine.alive:
            return json_error(APIError(503, "the engine is not running", code="engine_unavailable"))
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info():
        pools = await aengine.call(lambda: pool_snapshot(engine))
        return pools | {"model": serving.model_name, "speculative_algorithm": args.speculative_algorithm,
                        "max_context": engine.max_context,
                        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
                        "speculative_ddtree_budget": args.speculative_ddtree_budget}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise APIError(404, "metrics are disabled; start the server with --enable-metrics")
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
