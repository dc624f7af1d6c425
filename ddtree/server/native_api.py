"""SGLang's native routes: `POST /generate` and `GET /get_model_info`.

`/generate` answers one prompt with `{"text", "output_ids", "meta_info"}` and a batch (or n > 1)
with a list of them, prompt-major. meta_info: id, finish_reason ({"type": "stop", "matched": string
or token id} | {"type": "length", "length": n} | {"type": "abort"}), prompt_tokens,
completion_tokens, cached_tokens (prompt tokens found in the prefix cache), e2e_latency, timing (the final
object: seconds of the time to first token by phase, `ReqTimes.breakdown`), and for DFLASH / DDTREE
spec_verify_ct (decoding rounds) and spec_accept_length (mean tokens per round); with
`return_logprob`, output_token_logprobs / output_top_logprobs and input_token_logprobs /
input_top_logprobs (from `logprob_start_len`; the first entry's log-prob is None). Streaming sends SSE `data:` objects
whose text and output_ids are cumulative (SGLang's default), with "index" when several choices
interleave, then `data: [DONE]`.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from ddtree.server import protocol
from ddtree.server.async_engine import Delta
from ddtree.server.http import get
from ddtree.server.logprob_format import native_logprobs, native_prompt_logprobs
from ddtree.server.native_protocol import (
    GenerateRequest,
    check_batch,
    check_native,
    native_sampling_params,
)
from ddtree.server.openai_serving import OpenAIServing, check_prompt_chars, tokenize
from ddtree.server.reasoning import ReasoningParser
from ddtree.server.sse import Interleaved, SSEResponse, sse
from ddtree.server.structured import grammar_spec, peer


def _at(param: str, i: int, batch: bool) -> str:
    """The field a prompt's error names: `text` of one prompt, `text.3` of a batch's fourth."""
    return f"{param}.{i}" if batch else param


def finish_reason(d: Delta) -> dict | None:
    if d.finish_reason is None:
        return None
    if d.finish_reason == "stop":
        return {"type": "stop", "matched": d.matched}
    if d.finish_reason == "length":
        return {"type": "length", "length": d.completion_tokens}
    return {"type": d.finish_reason}


class NativeServing:
    def __init__(self, serving: OpenAIServing, args):
        self.serving, self.args = serving, args
        self.speculative = args.speculative_algorithm != "NONE"

    def result(
        self,
        body: GenerateRequest,
        d: Delta,
        rid: str,
        text: str,
        ids: list[int],
        lps: list,
        started: float,
        prompt_entries: list | None = None,
    ) -> dict:
        meta = {
            "id": rid,
            "finish_reason": finish_reason(d),
            "prompt_tokens": d.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": d.cached_tokens,
            "e2e_latency": time.monotonic() - started,
        }
        if d.timing is not None:  # the final object: the time to first token by phase
            meta["timing"] = d.timing
        if self.speculative:
            meta |= {"spec_verify_ct": d.rounds, "spec_accept_length": d.mean_accept_length}
        if body.return_logprob:
            meta |= native_logprobs(lps, body.return_text_in_logprobs)
            if prompt_entries is not None:
                meta |= native_prompt_logprobs(prompt_entries, body.return_text_in_logprobs)
        out = {"text": text, "output_ids": ids, "meta_info": meta}
        parser = self.serving.reasoning_parser
        if body.separate_reasoning and parser is not None:
            prompt = body.text if isinstance(body.text, str) else ""
            # None (null) where the output has no think block, as chat's reasoning_content
            out["reasoning_text"], out["text"] = ReasoningParser(parser, prompt).parse(text)
        return out

    async def generate(self, body: GenerateRequest, request: Request):
        started = time.monotonic()  # e2e_latency counts from the request's arrival
        prompts, batch = body.prompts()
        sps = body.params_for(len(prompts))
        check_batch(body, prompts, sps)
        for sp in sps:
            check_native(body, sp)
        param = "text" if body.text is not None else "input_ids"
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                check_prompt_chars(len(prompt), self.serving.max_context, _at(param, i, batch))
        vocab = self.serving.vocab_size
        grammars = [grammar_spec(sp.grammar_fields(), "sampling_params.") for sp in sps]
        for g in grammars:
            await self.serving.grammars.compile(g, peer(request))  # off the engine thread
        prepared = []
        # prompt by prompt on a tokenizer thread; a client that left stops the batch here, before
        # any of it reaches the engine
        for i, (prompt, sp, g) in enumerate(zip(prompts, sps, grammars)):

            def prepare(e, prompt=prompt, sp=sp, g=g, name=_at(param, i, batch)):
                ids = tokenize(e, prompt, name) if isinstance(prompt, str) else list(prompt)
                protocol.check_prompt_ids(ids, vocab, e.max_context, name)
                return ids, native_sampling_params(body, sp, len(ids), e.max_context, g)

            ids, params = await self.serving.prepare(prepare)
            prepared.append((ids, params, sp.n))
            if await request.is_disconnected():
                raise protocol.APIError(499, "client disconnected")
        streams = await self.serving.admit(prepared, param, started)
        rids = self._rids(body, streams)
        if body.stream:
            return self._stream(body, streams, rids, started)
        ds = await self.serving.final_deltas(streams, request)
        out = []
        for d, rid in zip(ds, rids):
            entries = await self._prompt_entries(d)
            out.append(self.result(body, d, rid, d.text, d.token_ids, d.logprobs, started, entries))
        return out if batch or len(out) > 1 else out[0]

    async def _prompt_entries(self, d: Delta) -> list | None:
        """The Delta's prompt log-probs as entries (decoded on a tokenizer thread), or None."""
        if d.prompt_logprobs is None:
            return None
        return (await self.serving.echo("", [], d))[1]

    @staticmethod
    def _rids(body: GenerateRequest, streams) -> list[str]:
        """The caller's `rid`s (one per prompt; `-i` per choice with n > 1), else ours."""
        given = [body.rid] if isinstance(body.rid, str) else body.rid
        if not given or len(given) * (len(streams) // len(given)) != len(streams):
            return [st.rid for st in streams]
        n = len(streams) // len(given)
        return [
            given[i // n] if n == 1 else f"{given[i // n]}-{i % n}" for i in range(len(streams))
        ]

    def _stream(
        self, body: GenerateRequest, streams, rids: list[str], started: float
    ) -> SSEResponse:
        merged = Interleaved(streams)
        texts, ids, lps = [""] * len(streams), [[] for _ in streams], [[] for _ in streams]
        prompt_entries: list[list | None] = [None] * len(streams)

        async def events():
            async for i, d in merged:
                if d.error is not None:
                    yield sse(protocol.APIError(d.error_status, d.error, code=d.error_code).body())
                    break
                texts[i] += d.text
                ids[i] += d.token_ids
                lps[i] += d.logprobs
                if d.prompt_logprobs is not None:
                    prompt_entries[i] = await self._prompt_entries(d)
                if not (d.text or d.token_ids or d.finish_reason):
                    continue
                chunk = self.result(
                    body, d, rids[i], texts[i], list(ids[i]), lps[i], started, prompt_entries[i]
                )
                if d.finish_reason is None:
                    chunk["meta_info"]["prompt_tokens"] = streams[i].prompt_tokens
                yield sse(chunk | ({"index": i} if len(streams) > 1 else {}))
            yield "data: [DONE]\n\n"

        return SSEResponse(events(), lambda: merged.close(self.serving.aengine))

    def model_info(self, engine) -> dict:
        """SGLang's fields, plus the drafter and algorithm this server decodes with."""
        t, a = self.args.target_config, self.args
        return {
            "model_path": a.model_path,
            "tokenizer_path": a.tokenizer_path,
            "is_generation": True,
            "weight_version": "default",
            "model_type": t.model_type,
            "architectures": [t.architecture],
            "served_model_name": self.serving.model_name,
            "max_context_length": engine.max_context,
            "speculative_algorithm": a.speculative_algorithm,
            "speculative_draft_model_path": a.speculative_draft_model_path,
        }


def native_router(serving: OpenAIServing, args, engine) -> APIRouter:
    native = NativeServing(serving, args)
    router = APIRouter()

    @router.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        return await native.generate(body, request)

    @get(router, "/get_model_info")
    @get(router, "/model_info")  # the name sgl-router asks for first
    async def get_model_info():
        return native.model_info(engine)

    return router
