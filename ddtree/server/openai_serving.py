"""Completions and chat completions: validate, admit into the engine, and answer as one JSON body or an SSE
stream of OpenAI chunk objects. `n > 1` admits n independent requests (choice i samples with
seed + i when a seed is given); usage counts the prompt once and sums the choices' completion
tokens, as OpenAI does.

Extension: every completion response, and the finishing chunk (plus the usage chunk) of every stream, carries
a top-level object `"ddtree": {"algorithm", "mean_accept_length", "rounds", "timing"}` - the mean number of tokens
emitted per decoding round (accepted draft tokens + bonus; 1.0 for plain AR), the number of rounds, and the time
to first token by phase in seconds (`ReqTimes.breakdown`: queue, prefill, publish, ttft, ...).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import StreamingResponse

from ddtree.engine.request import SamplingParams
from ddtree.server import limits, protocol
from ddtree.server.async_engine import AsyncEngine, Delta, EngineUnavailable, Stream
from ddtree.server.chat_tools import ChatOutput, ChatTools
from ddtree.server.logprob_format import TextOffsets, chat_logprobs, completion_logprobs
from ddtree.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from ddtree.server.structured import GrammarCompiler, grammar_spec

DEFAULT_COMPLETION_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat defaults to the context
)
DISCONNECT_POLL_S = 0.5
# threads that tokenize prompts and render chat templates, off the engine thread (a long prompt
# tokenized there stalled every stream); the tokenizer releases the GIL while it encodes
TOKENIZE_THREADS = 2


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


def usage(ds: list[Delta]) -> dict:
    """One prompt, n choices: the prompt counts once, the completions add up (as OpenAI)."""
    prompt, completion = ds[0].prompt_tokens, sum(d.completion_tokens for d in ds)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": ds[0].cached_tokens},
    }


def prompt_chars(body) -> int:
    """Characters of prompt text a request carries (token-id prompts count 0: the context check
    bounds them)."""
    if isinstance(body, ChatCompletionRequest):
        return sum(
            len(m.content)
            if isinstance(m.content, str)
            else sum(len(p.text) for p in m.content or ())
            for m in body.messages
        )
    p = body.prompt
    return len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str))


def check_prompt_chars(chars: int, max_context: int, param: str) -> None:
    """A prompt too long to fit the context whatever the tokenizer does is refused before it is
    tokenized (limits.PROMPT_CHARS_PER_TOKEN)."""
    if chars > limits.prompt_chars_limit(max_context):
        raise APIError(
            400,
            f"{param}: has {chars} characters; this model's context length is {max_context} "
            f"tokens (at most {limits.PROMPT_CHARS_PER_TOKEN} characters per token are accepted "
            "before tokenizing)",
            param=param,
            code="context_length_exceeded",
        )


def tokenize(engine, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
    """On a tokenizer thread (`OpenAIServing.prepare`): the engine's tokenizer is read-only after
    start-up, and encoding does not change it."""
    if engine.tokenizer is None:
        raise protocol.invalid(
            param, "this model has no tokenizer; send the prompt as a list of token ids"
        )
    return engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)


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


class OpenAIServing:
    def __init__(self, aengine: AsyncEngine, args):
        self.aengine = aengine
        self.model_name = args.served_model_name or args.model_path
        self.algorithm = args.speculative_algorithm
        self.vocab_size = args.target_config.vocab_size
        self.max_context = aengine.engine.max_context
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, "ddtree-tokenize")

        self.grammars = GrammarCompiler(aengine.engine)  # off the engine thread
        self.reasoning_parser = getattr(args, "reasoning_parser", None)
        self.tool_call_parser = getattr(args, "tool_call_parser", None)

    def close(self) -> None:
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()

    def ext(self, ds: list[Delta]) -> dict:
        """The `ddtree` extension over one or more choices (accept length weighted by rounds;
        timing: the first choice's time to first token by phase, seconds)."""
        rounds = sum(d.rounds for d in ds)
        mean = sum(d.mean_accept_length * d.rounds for d in ds) / rounds if rounds else 0.0
        out = {"algorithm": self.algorithm, "mean_accept_length": mean, "rounds": rounds}
        return out | ({"timing": ds[0].timing} if ds and ds[0].timing is not None else {})

    async def start(
        self,
        body,
        prompt_of,
        param: str,
        default_max_tokens: int | None,
        grammar=None,
    ) -> list[Stream]:
        """Validate, compile the request's grammar (off the engine thread), tokenize (on a
        tokenizer thread: prompt_of(engine) -> ids) and admit body.n requests; failures are
        APIErrors. `model` picks nothing: the one served model answers any name, as in SGLang.
        grammar: the grammar the caller derived (tools); else the body's structured-output
        fields'."""
        arrival = time.monotonic()  # the request's time to first token starts here
        protocol.check_supported(body)
        if grammar is None:
            grammar = grammar_spec(body.grammar_fields())
        check_prompt_chars(prompt_chars(body), self.max_context, param)

        await self.grammars.compile(grammar)

        def prepare(e):
            ids = prompt_of(e)
            protocol.check_prompt_ids(ids, self.vocab_size, e.max_context, param)
            return ids, protocol.sampling_params(
                body, len(ids), e.max_context, default_max_tokens, grammar
            )

        ids, params = await self.prepare(prepare)
        return await self.admit([(ids, params, body.n or 1)], param, arrival)

    async def prepare(self, fn):
        """fn(engine) on a tokenizer thread: the request's host work before admission
        (tokenizing, rendering the chat template, checking the ids), off the engine thread, which
        then only admits. fn reads only what is fixed after start-up (tokenizer, max_context)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenize_pool, fn, self.aengine.engine)

    async def admit(
        self, prepared: list[tuple[list[int], SamplingParams, int]], param: str, arrival: float
    ) -> list[Stream]:
        """Admit, for each (prompt ids, params, n), n independent requests (choice i samples with
        seed + i when a seed is given), all at once: every admission is queued before the engine
        thread runs them, so they join between the same two steps. If one fails, none stays."""
        jobs = []
        for ids, params, n in prepared:
            for i in range(n):
                if i and params.seed is not None:
                    jobs.append((ids, dataclasses.replace(params, seed=params.seed + i)))
                else:
                    jobs.append((ids, params))
        results = await asyncio.gather(
            *(self.aengine.submit(lambda e, job=job: job, arrival) for job in jobs),
            return_exceptions=True,
        )
        streams = [r for r in results if isinstance(r, Stream)]
        failed = [r for r in results if not isinstance(r, Stream)]
        if not failed:
            return streams
        for st in streams:
            self.aengine.abort(st.rid)
        err = failed[0]
        if isinstance(err, APIError):
            raise err
        if isinstance(err, EngineUnavailable):  # dead, shutting down, or the queue is full
            raise unavailable(err) from err
        if isinstance(err, ValueError):  # the engine's own admission checks
            raise APIError(400, f"{param}: {err}", param=param) from err
        if isinstance(err, asyncio.CancelledError):
            raise err
        raise APIError(
            500, f"admitting request {len(streams) + 1} of {len(jobs)} failed: {err}"
        ) from err

    async def final_delta(self, st: Stream, request: Request) -> Delta:
        """All of a request's deltas joined into one; the request is aborted if the client goes away first."""
        parts, ids, lps, done = [], [], [], False
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
                ids += d.token_ids
                lps += d.logprobs
                if d.finish_reason is not None or d.error is not None:
                    done = True
                    if d.error is not None:
                        raise APIError(d.error_status, d.error, code=d.error_code)
                    d.text, d.token_ids, d.logprobs = "".join(parts), ids, lps
                    return d
        finally:
            if not done:
                self.aengine.abort(st.rid)

    async def final_deltas(self, streams: list[Stream], request: Request) -> list[Delta]:
        """final_delta of every choice; if one fails, the others are cancelled (and so aborted)."""
        tasks = [asyncio.ensure_future(self.final_delta(st, request)) for st in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    def stream(
        self, streams: list[Stream], body, chunk_of, first_chunks: tuple = ()
    ) -> SSEResponse:
        """chunk_of(i, d, None) builds choice i's chunk from Delta d (text, log-probs),
        chunk_of(i, None, reason) its finishing chunk, chunk_of(None, None, None) one without
        choices. The choices' deltas interleave."""
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        tail = {"usage": None} if include_usage else {}
        merged = Interleaved(streams)

        async def events():
            finals: dict[int, Delta] = {}
            for chunk in first_chunks:
                yield sse(chunk | tail)
            async for i, d in merged:
                if d.error is not None:
                    yield sse(APIError(d.error_status, d.error, code=d.error_code).body())
                    break
                if d.text or d.logprobs:
                    chunk = chunk_of(i, d, None)
                    if chunk is not None:  # None: the choice's output held it all back
                        yield sse(chunk | tail)
                if d.finish_reason is not None:
                    finals[i] = d
                    yield sse(chunk_of(i, None, d.finish_reason) | {"ddtree": self.ext([d])} | tail)
            if include_usage and len(finals) == len(streams):
                ds = [finals[i] for i in range(len(streams))]
                yield sse(chunk_of(None, None, None) | {"usage": usage(ds), "ddtree": self.ext(ds)})
            yield "data: [DONE]\n\n"

        return SSEResponse(events(), lambda: merged.close(self.aengine))

    async def completions(self, body: CompletionRequest, request: Request):
        prompt = protocol.completion_prompt(body)
        want_logprobs, _ = protocol.logprob_fields(body)
        ids_of = (
            (lambda e: tokenize(e, prompt, "prompt", body.add_special_tokens))
            if isinstance(prompt, str)
            else (lambda e: list(prompt))
        )
        streams = await self.start(body, ids_of, "prompt", DEFAULT_COMPLETION_MAX_TOKENS)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        offsets = [TextOffsets(body.skip_special_tokens) for _ in streams]
        if body.stream:

            def chunk(i, d, reason):
                if i is None:
                    return head | {"choices": []}
                if d is None:
                    return head | {
                        "choices": [
                            {"index": i, "text": "", "logprobs": None, "finish_reason": reason}
                        ]
                    }
                lp = None
                if want_logprobs:
                    lp = completion_logprobs(d.logprobs, offsets[i])
                return head | {
                    "choices": [{"index": i, "text": d.text, "logprobs": lp, "finish_reason": None}]
                }

            return self.stream(streams, body, chunk)
        ds = await self.final_deltas(streams, request)
        choices = [
            {
                "index": i,
                "text": d.text,
                "finish_reason": d.finish_reason,
                "logprobs": completion_logprobs(d.logprobs, offsets[i]) if want_logprobs else None,
            }
            for i, d in enumerate(ds)
        ]
        return head | {"choices": choices, "usage": usage(ds), "ddtree": self.ext(ds)}

    async def chat(self, body: ChatCompletionRequest, request: Request):
        messages = protocol.chat_messages(body)
        want_logprobs, _ = protocol.logprob_fields(body)
        tools = ChatTools.of(body, self.tool_call_parser)
        grammar = grammar_spec(body.grammar_fields())
        if tools is not None and tools.grammar() is not None:
            if grammar is not None:
                raise protocol.invalid(
                    grammar.param, f"conflicts with tool_choice {tools.choice!r}: give one"
                )
            grammar = tools.grammar()
        kwargs = chat_template_kwargs(body.chat_template_kwargs)
        rendered = {}

        def render(e):
            if e.tokenizer is None or not getattr(e.tokenizer, "chat_template", None):
                raise protocol.invalid(
                    "messages", "this model's tokenizer has no chat template; use /v1/completions"
                )
            extra = {"tools": tools.render} if tools is not None and tools.render else {}
            try:
                text = e.tokenizer.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    **extra,
                    **kwargs,
                )
            except APIError:
                raise
            except Exception as err:  # noqa: BLE001 - jinja raises for what the template refuses
                raise protocol.invalid("messages", f"the chat template failed: {err}") from err
            rendered["prompt"] = text
            return tokenize(e, text, "messages", body.add_special_tokens)

        streams = await self.start(body, render, "messages", None, grammar)
        reasoning = self.reasoning_parser if body.separate_reasoning else None
        outputs = [ChatOutput(reasoning, tools, rendered.get("prompt", "")) for _ in streams]
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": None,
        }

        def logprobs_of(d):
            return chat_logprobs(d.logprobs) if want_logprobs else None

        if body.stream:
            head = head | {"object": "chat.completion.chunk"}

            def chunk(i, d, reason):
                if i is None:
                    return head | {"choices": []}
                if d is None:  # the finish: what the parsers held back, then the reason
                    out = outputs[i]
                    return head | {
                        "choices": [
                            {
                                "index": i,
                                "delta": out.feed("", final=True),
                                "logprobs": None,
                                "finish_reason": out.finish_reason(reason),
                            }
                        ]
                    }
                delta = outputs[i].feed(d.text)
                lp = logprobs_of(d)
                if not delta and lp is None:
                    return None
                return head | {
                    "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": None}]
                }

            role = {"role": "assistant", "content": ""}
            first = tuple(
                head
                | {
                    "choices": [
                        {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
                    ]
                }
                for i in range(len(streams))
            )
            return self.stream(streams, body, chunk, first)
        ds = await self.final_deltas(streams, request)
        choices = []
        for i, (d, out) in enumerate(zip(ds, outputs)):
            out.feed(d.text, final=True)
            choices.append(
                {
                    "index": i,
                    "message": out.message(),
                    "logprobs": logprobs_of(d),
                    "finish_reason": out.finish_reason(d.finish_reason),
                }
            )
        return head | {"choices": choices, "usage": usage(ds), "ddtree": self.ext(ds)}


def unavailable(err: EngineUnavailable) -> APIError:
    """503; with Retry-After when it is back-pressure (the queue is full), not a dead engine."""
    headers = None if err.retry_after is None else {"Retry-After": str(err.retry_after)}
    return APIError(503, str(err), code="engine_unavailable", headers=headers)


RESERVED_TEMPLATE_KWARGS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "tokenize",
    "conversation",
)


def chat_template_kwargs(kwargs: dict | None) -> dict:
    """`chat_template_kwargs`, checked: no key the server sets itself, a bounded size."""
    if not kwargs:
        return {}
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise protocol.invalid(f"chat_template_kwargs.{key}", "is set by the server")
    if len(json.dumps(kwargs)) > limits.MAX_TEMPLATE_KWARGS_CHARS:
        raise protocol.invalid(
            "chat_template_kwargs", f"is over {limits.MAX_TEMPLATE_KWARGS_CHARS} characters"
        )
    return dict(kwargs)
