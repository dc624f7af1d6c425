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

from ddtree.engine.scheduling.request import SamplingParams
from ddtree.server import limits, protocol
from ddtree.server.async_engine import AsyncEngine, Delta, EngineUnavailable, Stream
from ddtree.server.chat_tools import ChatOutput, ChatTools
from ddtree.server.logprob_format import (
    LogprobEntry,
    TextOffsets,
    TokenBytes,
    chat_logprobs,
    completion_logprobs,
    decode_prompt_entries,
    top_k,
    vllm_prompt_logprobs,
)
from ddtree.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from ddtree.server.sse import Interleaved, SSEResponse, sse
from ddtree.server.structured import GrammarCompiler, grammar_spec, peer

DEFAULT_COMPLETION_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat defaults to the context
)
DISCONNECT_POLL_S = 0.5
# threads that tokenize prompts and render chat templates, off the engine thread (a long prompt
# tokenized there stalled every stream); the tokenizer releases the GIL while it encodes
TOKENIZE_THREADS = 2


def usage(ds: list[Delta], n: int | None = None) -> dict:
    """Prompts of n choices each (prompt-major; default one prompt): each prompt counts once,
    the completions add up (as OpenAI and vLLM)."""
    firsts = ds[:: n or len(ds)]
    prompt, completion = sum(d.prompt_tokens for d in firsts), sum(d.completion_tokens for d in ds)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in firsts)},
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


class OpenAIServing:
    def __init__(self, aengine: AsyncEngine, args):
        self.aengine = aengine
        self.model_name = args.served_model_name or args.model_path
        self.algorithm = args.speculative_algorithm
        self.vocab_size = args.target_config.vocab_size
        self.max_context = aengine.engine.max_context
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, "ddtree-tokenize")
        # prompt entries' id -> bytes table, read on tokenizer threads (the engine thread keeps
        # its own for emitted tokens); its cache is a dict of immutable values: a race computes
        # an id twice, never wrongly
        self.prompt_bytes = TokenBytes(aengine.engine.tokenizer)

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
        client: str = "",
    ) -> list[Stream]:
        """Validate, compile the request's grammar (off the engine thread), tokenize (on a
        tokenizer thread: prompt_of(engine) -> ids) and admit body.n requests; failures are
        APIErrors. `model` picks nothing: the one served model answers any name, as in SGLang.
        grammar: the grammar the caller derived (tools); else the body's structured-output
        fields'. client: whose compile workers it uses (structured.peer)."""
        check_prompt_chars(prompt_chars(body), self.max_context, param)
        streams, _ = await self.start_many(
            body, [(prompt_of, param)], default_max_tokens, grammar, client
        )
        return streams

    async def start_many(
        self, body, prompts: list, default_max_tokens: int | None, grammar=None, client: str = ""
    ) -> tuple[list[Stream], list[list[int]]]:
        """`start` for several prompts, each (prompt_of, the field its errors name): body.n
        requests each, prompt-major, all admitted at once. Returns them and each prompt's ids."""
        arrival = time.monotonic()  # the request's time to first token starts here
        protocol.check_supported(body)
        if grammar is None:
            grammar = grammar_spec(body.grammar_fields())
        await self.grammars.compile(grammar, client)
        prepared = []
        for prompt_of, param in prompts:  # one tokenizer-thread hop per prompt

            def prepare(e, prompt_of=prompt_of, param=param):
                ids = prompt_of(e)
                protocol.check_prompt_ids(ids, self.vocab_size, e.max_context, param)
                return ids, protocol.sampling_params(
                    body, len(ids), e.max_context, default_max_tokens, grammar
                )

            ids, params = await self.prepare(prepare)
            prepared.append((ids, params, body.n or 1))
        streams = await self.admit(prepared, prompts[0][1], arrival)
        return streams, [ids for ids, _, _ in prepared]

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
        parts, ids, lps, done, plp = [], [], [], False, None
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
                plp = plp if d.prompt_logprobs is None else d.prompt_logprobs
                if d.finish_reason is not None or d.error is not None:
                    done = True
                    if d.error is not None:
                        raise APIError(d.error_status, d.error, code=d.error_code)
                    d.text, d.token_ids, d.logprobs = "".join(parts), ids, lps
                    d.prompt_logprobs = plp
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
        self, streams: list[Stream], body, chunk_of, first_chunks: tuple = (), first_of=None
    ) -> SSEResponse:
        """chunk_of(i, d, None) builds choice i's chunks from Delta d (text, log-probs; none when
        the choice's output holds it all back), chunk_of(i, None, reason) its finishing ones (the
        last carries the reason), chunk_of(None, None, None) one without choices. first_chunks[i]
        opens choice i; `await first_of(i, d)` (optional) is a chunk before choice i's first delta
        (an echoed prompt). The choices' deltas interleave. With stream_options.include_usage, a
        last chunk carries the usage; with continuous_usage_stats too, every chunk carries its
        choice's usage so far (vLLM's extension)."""
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and opts.continuous_usage_stats
        tokens = [0] * len(streams)  # completion tokens per choice so far

        def tail(i: int) -> dict:
            if not continuous:
                return {"usage": None} if include_usage else {}
            p = streams[i].prompt_tokens
            return {
                "usage": {
                    "prompt_tokens": p,
                    "completion_tokens": tokens[i],
                    "total_tokens": p + tokens[i],
                }
            }

        merged = Interleaved(streams)

        async def events():
            finals: dict[int, Delta] = {}
            started: set[int] = set()
            for i, chunk in enumerate(first_chunks):
                yield sse(chunk | tail(i))
            async for i, d in merged:
                if d.error is not None:
                    yield sse(APIError(d.error_status, d.error, code=d.error_code).body())
                    break
                if first_of is not None and i not in started:
                    started.add(i)
                    yield sse(await first_of(i, d) | tail(i))
                tokens[i] += len(d.token_ids)
                if d.text or d.logprobs:
                    for chunk in chunk_of(i, d, None):
                        yield sse(chunk | tail(i))
                if d.finish_reason is not None:
                    finals[i] = d
                    tokens[i] = d.completion_tokens
                    *rest, last = chunk_of(i, None, d.finish_reason)
                    for chunk in rest:
                        yield sse(chunk | tail(i))
                    yield sse(last | {"ddtree": self.ext([d])} | tail(i))
            if include_usage and len(finals) == len(streams):
                ds = [finals[i] for i in range(len(streams))]
                u = usage(ds, body.n)
                yield sse(chunk_of(None, None, None)[0] | {"usage": u, "ddtree": self.ext(ds)})
            yield "data: [DONE]\n\n"

        return SSEResponse(events(), lambda: merged.close(self.aengine))

    async def echo(self, prompt, ids: list[int], d: Delta) -> tuple[str, list[LogprobEntry]]:
        """An echoed prompt's text (a token-id prompt decoded) and its log-prob entries (empty
        unless computed), on a tokenizer thread."""

        def render(e):
            text = prompt
            if not isinstance(prompt, str):
                text = e.tokenizer.decode(ids) if e.tokenizer is not None else ""
            plp = d.prompt_logprobs
            if plp is None:
                return text, []
            return text, decode_prompt_entries(e.tokenizer, plp, self.prompt_bytes)

        return await self.prepare(render)

    async def completions(self, body: CompletionRequest, request: Request):
        """One prompt or a list (OpenAI's batch: choice index = prompt index x n + choice); with
        `echo` the prompt (and its log-probs) leads each choice; max_tokens 0 with echo returns
        the prompt alone; vLLM's `prompt_logprobs` come per choice."""
        prompts, batch = protocol.completion_prompts(body)
        want_logprobs, k = protocol.logprob_fields(body)
        names = [f"prompt.{i}" if batch else "prompt" for i in range(len(prompts))]
        for p, name in zip(prompts, names):
            if isinstance(p, str):
                check_prompt_chars(len(p), self.max_context, name)

        def ids_of(p, name):
            if isinstance(p, str):
                return lambda e: tokenize(e, p, name, body.add_special_tokens)
            return lambda e: list(p)

        jobs = [(ids_of(p, name), name) for p, name in zip(prompts, names)]
        streams, ids = await self.start_many(
            body, jobs, DEFAULT_COMPLETION_MAX_TOKENS, client=peer(request)
        )
        n, echo, pk = body.n or 1, bool(body.echo), body.prompt_logprobs
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        offsets = [TextOffsets(body.skip_special_tokens) for _ in streams]
        if body.stream:

            def choice(i, text, lp=None, reason=None) -> dict:
                return head | {
                    "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": reason}]
                }

            async def first(i, d):
                text, entries = await self.echo(prompts[i // n], ids[i // n], d)
                lp = None
                if want_logprobs:  # the echoed prompt's offsets come first in the choice's text
                    lp = completion_logprobs(top_k(entries, k), offsets[i])
                return choice(i, text, lp)

            def chunk(i, d, reason) -> list[dict]:
                if i is None:
                    return [head | {"choices": []}]
                if d is None:
                    return [choice(i, "", reason=reason)]
                lp = None
                if want_logprobs:
                    lp = completion_logprobs(d.logprobs, offsets[i])
                return [choice(i, d.text, lp)]

            return self.stream(streams, body, chunk, first_of=first if echo else None)
        ds = await self.final_deltas(streams, request)
        choices, echoes = [], {}
        for i, d in enumerate(ds):
            text, entries = "", []
            if echo or pk is not None:  # once per prompt: its choices' prompt rows are the same
                if i // n not in echoes:
                    echoes[i // n] = await self.echo(prompts[i // n], ids[i // n], d)
                text, entries = echoes[i // n]
            choice = {
                "index": i,
                "text": text + d.text if echo else d.text,
                "finish_reason": d.finish_reason,
                "logprobs": None,
            }
            if want_logprobs:
                echoed = top_k(entries, k) if echo else []
                choice["logprobs"] = completion_logprobs(echoed + d.logprobs, offsets[i])
            if pk is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(top_k(entries, pk))
            choices.append(choice)
        return head | {"choices": choices, "usage": usage(ds, n), "ddtree": self.ext(ds)}

    async def start_chat(
        self, body: ChatCompletionRequest, client: str = ""
    ) -> tuple[list[Stream], list[ChatOutput]]:
        """A chat request admitted: its tools and grammar, the template rendered and tokenized on a
        tokenizer thread, body.n requests, and each choice's ChatOutput (reasoning, content, tool
        calls). Chat completions and the Responses API (server/responses.py) both start here."""
        messages = protocol.chat_messages(body)
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

        streams = await self.start(body, render, "messages", None, grammar, client)
        reasoning = self.reasoning_parser if body.separate_reasoning else None
        outputs = [ChatOutput(reasoning, tools, rendered.get("prompt", "")) for _ in streams]
        return streams, outputs

    async def chat(self, body: ChatCompletionRequest, request: Request):
        want_logprobs, _ = protocol.logprob_fields(body)
        streams, outputs = await self.start_chat(body, peer(request))
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

            def choice(i, delta, lp=None, reason=None) -> dict:
                return head | {
                    "choices": [
                        {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
                    ]
                }

            def chunk(i, d, reason) -> list[dict]:
                if i is None:
                    return [head | {"choices": []}]
                out = outputs[i]
                if d is None:  # the finish: what the parsers held back, then the reason
                    *rest, last = out.stream_deltas("", final=True)
                    return [choice(i, x) for x in rest] + [
                        choice(i, last, reason=out.finish_reason(reason))
                    ]
                deltas, lp = out.stream_deltas(d.text), logprobs_of(d)
                if deltas == [{}] and lp is None:
                    return []  # the choice's output held it all back
                return [choice(i, x, lp if n == 0 else None) for n, x in enumerate(deltas)]

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
        out = head | {"choices": choices, "usage": usage(ds), "ddtree": self.ext(ds)}
        if body.prompt_logprobs is not None:  # vLLM: the response's, from the one prompt
            _, entries = await self.echo("", [], ds[0])
            out["prompt_logprobs"] = vllm_prompt_logprobs(top_k(entries, body.prompt_logprobs))
        return out


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
