"""OpenAI-compatible HTTP API over an AsyncEngine.

Extension: every completion response, and the finishing chunk (plus the usage chunk) of every stream, carries
a top-level object `"ddtree": {"algorithm", "mean_accept_length", "rounds"}` - the mean number of tokens emitted
per decoding round (accepted draft tokens + bonus; 1.0 for plain AR) and the number of rounds.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree.server import protocol
from ddtree.server.async_engine import AsyncEngine, Delta, Stream
from ddtree.server.metrics import pool_snapshot
from ddtree.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context
DEFAULT_MAX_BODY_BYTES = 8 << 20
DISCONNECT_POLL_S = 0.5


def _json_error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class BodyLimit:
    """ASGI middleware: requests whose body exceeds `limit` bytes get 413 before any handler runs. The body is
    read here and replayed, so the handler never sees a truncated body."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"request body exceeds the {self.limit}-byte limit", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _json_error(too_big)(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if size > self.limit:
                return await _json_error(too_big)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class SSEResponse(StreamingResponse):
    """An event stream that runs `on_close` however it ends (finished, client gone, or cancelled)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def create_app(aengine: AsyncEngine, args, metrics=None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    engine = aengine.engine
    model_name = args.served_model_name or args.model_path
    model_names = {model_name, args.model_path}
    vocab_size = engine.runner.target.config.vocab_size
    algorithm = args.speculative_algorithm
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        aengine.start()
        yield
        aengine.shutdown()

    app = FastAPI(title="ddtree", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _json_error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            return _json_error(APIError(400, f"request body is not valid JSON: {err.get('msg')}", code="invalid_json"))
        param = protocol.error_param(err.get("loc", ()))
        return _json_error(APIError(400, f"{param or 'body'}: {err.get('msg')}", param=param,
                                    code="missing_required_parameter" if err.get("type") == "missing"
                                    else "invalid_type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return _json_error(APIError(e.status_code, str(e.detail), code=None if e.status_code < 500 else "error"))

    @app.exception_handler(Exception)
    async def _server_error(request, e: Exception):
        return _json_error(APIError(500, f"internal server error: {type(e).__name__}: {e}"))

    def check_key(request: Request) -> None:
        if args.api_key and request.headers.get("authorization") != f"Bearer {args.api_key}":
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    def check_model(name: str | None) -> None:
        if name is not None and name not in model_names:
            raise APIError(404, f"model: the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def ext(d: Delta) -> dict:
        return {"algorithm": algorithm, "mean_accept_length": d.mean_accept_length, "rounds": d.rounds}

    def usage(d: Delta) -> dict:
        return {"prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
                "total_tokens": d.prompt_tokens + d.completion_tokens}

    def tokenize(e, text: str, param: str) -> list[int]:
        if e.tokenizer is None:
            raise protocol.invalid(param, "this model has no tokenizer; send the prompt as a list of token ids")
        return e.tokenizer.encode(text, add_special_tokens=False)

    async def start(body, prompt_of, param: str, default_max_tokens) -> Stream:
        """Validate, tokenize (on the engine thread) and admit; every failure is an APIError."""
        check_model(body.model)
        protocol.check_supported(body)
        if not aengine.alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")

        def prepare(e):
            ids = prompt_of(e)
            protocol.check_prompt_ids(ids, vocab_size, e.max_context, param)
            return ids, protocol.sampling_params(body, len(ids), e.max_context, default_max_tokens)

        try:
            return await aengine.submit(prepare)
        except ValueError as err:  # raised by the engine's own checks
            raise APIError(400, f"{param}: {err}", param=param) from err

    async def final_delta(st: Stream, request: Request) -> Delta:
        """Concatenate a request's deltas; aborts it if the client goes away first."""
        parts, done = [], False
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        try:
            while True:
                try:
                    d = await asyncio.wait_for(st.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    d = None
                if loop.time() >= next_check:
                    next_check = loop.time() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected")
                if d is None:
                    continue
                parts.append(d.text)
                if d.finish_reason is not None or d.error is not None:
                    done = True
                    d.text = "".join(parts)
                    if d.error is not None:
                        raise APIError(500, d.error, code="engine_error")
                    return d
        finally:
            if not done:
                aengine.abort(st.rid)

    def stream_response(st: Stream, body, chunk_of, first_chunk=None) -> SSEResponse:
        rid, include_usage = st.rid, bool(body.stream_options and body.stream_options.include_usage)
        state = {"done": False}

        async def events():
            if first_chunk is not None:
                yield _sse(first_chunk | ({"usage": None} if include_usage else {}))
            while True:
                d = await st.queue.get()
                if d.error is not None:
                    state["done"] = True
                    yield _sse(APIError(500, d.error, code="engine_error").body())
                    break
                if d.text:
                    yield _sse(chunk_of(d.text, None) | ({"usage": None} if include_usage else {}))
                if d.finish_reason is not None:
                    state["done"] = True
                    last = chunk_of("", d.finish_reason) | {"ddtree": ext(d)}
                    yield _sse(last | ({"usage": None} if include_usage else {}))
                    if include_usage:
                        yield _sse(chunk_of(None, None) | {"usage": usage(d), "ddtree": ext(d)})
                    break
            yield "data: [DONE]\n\n"

        def on_close():
            if not state["done"]:
                aengine.abort(rid)

        return SSEResponse(events(), on_close)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = protocol.completion_prompt(body)
        st = await start(body, lambda e: tokenize(e, prompt, "prompt") if isinstance(prompt, str) else list(prompt),
                         "prompt", DEFAULT_COMPLETION_MAX_TOKENS)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        if body.stream:
            def chunk(text, reason):
                choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None,
                                                    "finish_reason": reason}]
                return head | {"choices": choices}

            return stream_response(st, body, chunk)
        d = await final_delta(st, request)
        return head | {"choices": [{"index": 0, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}],
                       "usage": usage(d), "ddtree": ext(d)}

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages = protocol.chat_messages(body)

        def render(e):
            if e.tokenizer is None or not getattr(e.tokenizer, "chat_template", None):
                raise protocol.invalid("messages", "this model's tokenizer has no chat template; use /v1/completions")
            text = e.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return tokenize(e, text, "messages")

        st = await start(body, render, "messages", None)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name, "system_fingerprint": None}
        if body.stream:
            chunk_head = head | {"object": "chat.completion.chunk"}

            def chunk(text, reason):
                if text is None:
                    return chunk_head | {"choices": []}
                delta = {"content": text} if text or reason is None else {}
                return chunk_head | {"choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                  "finish_reason": reason}]}

            first = chunk_head | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]}
            return stream_response(st, body, chunk, first)
        d = await final_delta(st, request)
        choice = {"index": 0, "message": {"role": "assistant", "content": d.text}, "logprobs": None,
                  "finish_reason": d.finish_reason}
        return head | {"choices": [choice], "usage": usage(d), "ddtree": ext(d)}

    @v1.get("/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "ddtree",
                "root": args.model_path, "max_model_len": engine.max_context}
        return {"object": "list", "data": [card]}

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if not aengine.alive:
            return _json_error(APIError(503, "the engine is not running", code="engine_unavailable"))
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info():
        pools = await aengine.call(lambda: pool_snapshot(engine))
        return pools | {"model": model_name, "speculative_algorithm": algorithm, "max_context": engine.max_context,
                        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
                        "speculative_ddtree_budget": args.speculative_ddtree_budget}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise APIError(404, "metrics are disabled; start the server with --enable-metrics")
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
