"""Completions and chat completions: validate, admit into the engine, and answer as one JSON body or an SSE
stream of OpenAI chunk objects.

Extension: every completion response, and the finishing chunk (plus the usage chunk) of every stream, carries
a top-level object `"ddtree": {"algorithm", "mean_accept_length", "rounds"}` - the mean number of tokens emitted
per decoding round (accepted draft tokens + bonus; 1.0 for plain AR) and the number of rounds.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from ddtree.server import limits, protocol
from ddtree.server.async_engine import AsyncEngine, Delta, EngineUnavailable, Stream
from ddtree.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context
DISCONNECT_POLL_S = 0.5


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


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage(d: Delta) -> dict:
    return {"prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
            "total_tokens": d.prompt_tokens + d.completion_tokens}


def prompt_chars(body) -> int:
    """Characters of prompt text a request carries (token-id prompts count 0: the context check
    bounds them)."""
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str)
                   else sum(len(p.text) for p in m.content or ()) for m in body.messages)
    p = body.prompt
    return len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str))


def tokenize(engine, text: str, param: str) -> list[int]:
    if engine.tokenizer is None:
        raise protocol.invalid(param, "this model has no tokenizer; send the prompt as a list of token ids")
    return engine.tokenizer.encode(text, add_special_tokens=False)


class OpenAIServing:
    def __init__(self, aengine: AsyncEngine, args):
        self.aengine = aengine
        self.model_name = args.served_model_name or args.model_path
        self.model_names = {self.model_name, args.model_path}
        self.algorithm = args.speculative_algorithm
        self.vocab_size = aengine.engine.runner.target.config.vocab_size
        self.max_context = aengine.engine.max_context

    def ext(self, d: Delta) -> dict:
        return {"algorithm": self.algorithm, "mean_accept_length": d.mean_accept_length, "rounds": d.rounds}

    async def start(self, body, prompt_of, param: str, default_max_tokens: int | None) -> Stream:
        """Validate, tokenize (on the engine thread: prompt_of(engine) -> ids) and admit; failures are APIErrors."""
        if body.model is not None and body.model not in self.model_names:
            raise APIError(404, f"model: the model {body.model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        protocol.check_supported(body)
        chars = prompt_chars(body)
        if chars > limits.prompt_chars_limit(self.max_context):
            per_token = limits.PROMPT_CHARS_PER_TOKEN
            raise APIError(400, f"{param}: has {chars} characters; this model's context length is "
                                f"{self.max_context} tokens (at most {per_token} characters per token "
                                "are accepted before tokenizing)", param=param,
                           code="context_length_exceeded")

        def prepare(e):
            ids = prompt_of(e)
            protocol.check_prompt_ids(ids, self.vocab_size, e.max_context, param)
            return ids, protocol.sampling_params(body, len(ids), e.max_context, default_max_tokens)

        try:
            return await self.aengine.submit(prepare)
        except EngineUnavailable as err:
            raise APIError(503, str(err), code="engine_unavailable") from err
        except ValueError as err:  # the engine's own admission checks
            raise APIError(400, f"{param}: {err}", param=param) from err

    async def final_delta(self, st: Stream, request: Request) -> Delta:
        """All of a request's deltas joined into one; the request is aborted if the client goes away first."""
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
                    if d.error is not None:
                        raise APIError(d.error_status, d.error, code=d.error_code)
                    d.text = "".join(parts)
                    return d
        finally:
            if not done:
                self.aengine.abort(st.rid)

    def stream(self, st: Stream, body, chunk_of, first_chunk: dict | None = None) -> SSEResponse:
        """chunk_of(text, finish_reason) builds a chunk; chunk_of(None, None) one without choices."""
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        tail = {"usage": None} if include_usage else {}
        state = {"done": False}

        async def events():
            if first_chunk is not None:
                yield sse(first_chunk | tail)
            while True:
                d = await st.queue.get()
                if d.error is not None:
                    state["done"] = True
                    yield sse(APIError(d.error_status, d.error, code=d.error_code).body())
                    break
                if d.text:
                    yield sse(chunk_of(d.text, None) | tail)
                if d.finish_reason is not None:
                    state["done"] = True
                    yield sse(chunk_of("", d.finish_reason) | {"ddtree": self.ext(d)} | tail)
                    if include_usage:
                        yield sse(chunk_of(None, None) | {"usage": usage(d), "ddtree": self.ext(d)})
                    break
            yield "data: [DONE]\n\n"

        def on_close():
            if not state["done"]:
                self.aengine.abort(st.rid)

        return SSEResponse(events(), on_close)

    async def completions(self, body: CompletionRequest, request: Request):
        prompt = protocol.completion_prompt(body)
        ids_of = (lambda e: tokenize(e, prompt, "prompt")) if isinstance(prompt, str) else (lambda e: list(prompt))
        st = await self.start(body, ids_of, "prompt", DEFAULT_COMPLETION_MAX_TOKENS)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if body.stream:
            def chunk(text, reason):
                return head | {"choices": [] if text is None else [
                    {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

            return self.stream(st, body, chunk)
        d = await self.final_delta(st, request)
        choice = {"index": 0, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
        return head | {"choices": [choice], "usage": usage(d), "ddtree": self.ext(d)}

    async def chat(self, body: ChatCompletionRequest, request: Request):
        messages = protocol.chat_messages(body)

        def render(e):
            if e.tokenizer is None or not getattr(e.tokenizer, "chat_template", None):
                raise protocol.invalid("messages", "this model's tokenizer has no chat template; use /v1/completions")
            text = e.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return tokenize(e, text, "messages")

        st = await self.start(body, render, "messages", None)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "system_fingerprint": None}
        if body.stream:
            head = head | {"object": "chat.completion.chunk"}

            def chunk(text, reason):
                if text is None:
                    return head | {"choices": []}
                delta = {"content": text} if text or reason is None else {}
                return head | {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

            first = head | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None}]}
            return self.stream(st, body, chunk, first)
        d = await self.final_delta(st, request)
        choice = {"index": 0, "message": {"role": "assistant", "content": d.text}, "logprobs": None,
                  "finish_reason": d.finish_reason}
        return head | {"choices": [choice], "usage": usage(d), "ddtree": self.ext(d)}
