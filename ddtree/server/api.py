"""The FastAPI app: OpenAI routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/v1/responses`: server/responses.py),
SGLang's native `/generate` and `/get_model_info` (`ddtree.server.native_api`),
`/health` (200 while the engine loop runs and keeps stepping; 503 when it died or is stuck;
--dp-size: 200 with a "degraded" body while some replicas serve), `/metrics` (Prometheus, with
--enable-metrics), `/get_server_info` (pool counts and allocator integrity, read between two engine
steps). The routes drive an `AsyncEngine` (one engine in this process) or a `DPEngine`
(`--dp-size` replicas, ddtree/server/dp/) through the same methods. With --api-key every route
needs the key except /health (and /metrics with --metrics-no-auth): server/http.py. Every failure
is an OpenAI-style `{"error": {message, type, param, code}}` body. Every GET route answers HEAD
too; a trailing slash is served as the path without it (no redirects).
The `ddtree` response extension is documented in `ddtree.server.openai_serving`.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree.server.async_engine import AsyncEngine
from ddtree.server.error_params import error_param
from ddtree.server.http import (
    BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    ApiKeyAuth,
    BodyLimit,
    CatchAll,
    NoSlashRedirect,
    get,
)
from ddtree.server.metrics import probe_loop_lag
from ddtree.server.native_api import native_router
from ddtree.server.openai_serving import OpenAIServing
from ddtree.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from ddtree.server.responses import responses_router

if TYPE_CHECKING:  # a --dp-size 1 server never imports ddtree.server.dp
    from ddtree.server.dp.engine import DPEngine

# pydantic error kinds where the type was right but the value is not (reported as code
# invalid_value)
VALUE_ERRORS = frozenset(
    {
        "value_error",
        "finite_number",
        "too_long",
        "string_too_long",
        "too_short",
        "string_too_short",
        "string_unicode",
    }
)


def json_error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def pick_error(errors: list[dict]) -> dict:
    """The error to report: for a union field pydantic lists one error per member; a member whose
    type matched but whose value failed (too long, not finite, a surrogate) says more than 'should
    be a list'."""
    return next((e for e in errors if e.get("type") in VALUE_ERRORS), errors[0])


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return json_error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        err = pick_error(e.errors())
        if err.get("type") == "json_invalid":
            return json_error(
                APIError(
                    400, f"request body is not valid JSON: {err.get('msg')}", code="invalid_json"
                )
            )
        param = error_param(err.get("loc", ()))
        if param is None:
            return json_error(
                APIError(
                    400,
                    "the request body must be a JSON object (Content-Type: application/json)",
                    code="invalid_type",
                )
            )
        kind = err.get("type", "")
        code = (
            "missing_required_parameter"
            if kind == "missing"
            else "invalid_value"
            if kind in VALUE_ERRORS
            else "invalid_type"
        )
        msg = str(err.get("msg")).removeprefix("Value error, ")
        return json_error(APIError(400, f"{param}: {msg}", param=param, code=code))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return json_error(APIError(e.status_code, str(e.detail)))


def create_app(
    aengine: AsyncEngine | DPEngine,
    args,
    metrics=None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = BODY_TIMEOUT_S,
) -> FastAPI:
    engine = aengine.engine
    serving = OpenAIServing(aengine, args)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        aengine.start()
        probe = None
        if metrics is not None:  # the HTTP loop's own lag, beside the engine's round times
            probe = asyncio.get_running_loop().create_task(probe_loop_lag(metrics))
        yield
        if probe is not None:
            probe.cancel()
        aengine.shutdown()
        aengine.release()
        serving.close()

    app = FastAPI(title="ddtree", lifespan=lifespan, redirect_slashes=False)
    # added last = outermost: the key is checked before the body is read; CatchAll sits inside
    # FastAPI's ServerErrorMiddleware, which would re-raise and make uvicorn drop the connection
    app.add_middleware(CatchAll)
    app.add_middleware(BodyLimit, limit=max_body_bytes, timeout=body_timeout)
    open_paths = ("/health", "/metrics") if args.metrics_no_auth else ("/health",)
    app.add_middleware(ApiKeyAuth, api_key=args.api_key, open_paths=open_paths)
    app.add_middleware(NoSlashRedirect)  # outermost: the key check sees the served path
    add_error_handlers(app)

    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    @get(v1, "/models")
    async def models():
        card = {
            "id": serving.model_name,
            "object": "model",
            "created": created,
            "owned_by": "ddtree",
            "root": args.model_path,
            "max_model_len": engine.max_context,
        }
        return {"object": "list", "data": [card]}

    app.include_router(v1)
    app.include_router(responses_router(serving))  # /v1/responses: server/responses.py
    app.include_router(native_router(serving, args, engine))  # behind ApiKeyAuth like every route

    @get(app, "/health")
    async def health():
        problem = aengine.health_problem()
        if problem is not None:
            return json_error(APIError(503, problem, code="engine_unavailable"))
        degraded = aengine.degraded()  # --dp-size: some replicas down, the others serving
        if degraded is not None:
            return JSONResponse({"status": "degraded", "message": degraded})
        return Response(status_code=200)

    # /server_info and /model_info: the names sgl-router asks for first (it falls back to get_*)
    @get(app, "/get_server_info")
    @get(app, "/server_info")
    async def server_info():
        pools = await aengine.pool_snapshot()
        return pools | {
            "model": serving.model_name,
            "speculative_algorithm": args.speculative_algorithm,
            "max_context": engine.max_context,
            "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
            "speculative_ddtree_budget": args.speculative_ddtree_budget,
            # SGLang's server-args fields a router reads to name the model and its tokenizer
            "model_path": args.model_path,
            "served_model_name": serving.model_name,
            "tokenizer_path": args.tokenizer_path,
            "tp_size": args.tp_size,
            "dp_size": args.dp_size,
            "load_balance_method": args.load_balance_method,
        }

    @get(app, "/metrics")
    async def prometheus():
        if metrics is None:
            raise APIError(404, "metrics are disabled; start the server with --enable-metrics")
        return Response(await aengine.render_metrics(), media_type=metrics.content_type)

    return app
