"""`POST /v1/responses`: the OpenAI Responses API over the chat path.

The request becomes the chat completion it describes (server/responses_protocol.py) and is admitted
by `OpenAIServing.start_chat`, so the chat template, `--tool-call-parser`, `--reasoning-parser`
and grammars (`text.format` json_schema / json_object, tool_choice required / named) are chat's,
and speculation runs as for any request. The choice's `ChatOutput` deltas (reasoning_content,
content, tool_calls) become output items in order: a `reasoning` item (its text as
`reasoning_text` content), a `message` with one `output_text` part, and one `function_call` item
per call (`call_id` is the chat call's id). A stream and a plain response come from the same
`OutputItems` fed differently, so a stream's deltas concatenate to the plain response's text.

A stream is OpenAI's event sequence, each event with its `sequence_number`, as SSE `event:` /
`data:` pairs and no `[DONE]` (as OpenAI): `response.created`, `response.in_progress`, per item
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` ...
(`response.reasoning_text.delta` for reasoning, `response.function_call_arguments.delta` for a
call), `response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
then `response.completed` with the whole response, or `response.incomplete` when it stopped at
`max_output_tokens` (status `incomplete`, `incomplete_details.reason` "max_output_tokens": OpenAI's
behaviour; vLLM sends `response.completed` either way). A failure mid-stream is an `error` event
then `response.failed`.

`usage`: `input_tokens` (with `input_tokens_details.cached_tokens` from the prefix cache),
`output_tokens`, `total_tokens`, and `output_tokens_details.reasoning_tokens` counted by
tokenizing the reasoning text. The response carries the `ddtree` extension of
server/openai_serving.py. Nothing is stored: `GET /v1/responses/{id}` is a 404 saying so.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from pydantic import ValidationError

from ddtree.server import protocol
from ddtree.server.async_engine import Delta
from ddtree.server.chat_tools import ChatOutput
from ddtree.server.error_params import error_param
from ddtree.server.openai_serving import OpenAIServing, usage
from ddtree.server.protocol import APIError, ChatCompletionRequest
from ddtree.server.responses_protocol import (
    ResponsesRequest,
    chat_body,
    responses_error,
    responses_param,
)
from ddtree.server.sse import Interleaved, SSEResponse
from ddtree.server.structured import peer


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A choice's ChatOutput deltas -> output items and the stream events that build them
    (without sequence numbers). Items open in order; a new kind of output closes the open one."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}  # a chat tool-call delta's index -> its item
        self.reasoning_text = ""

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _start(self, item: dict) -> list[dict]:
        events = self.close("completed")
        self.items.append(item)
        self.open = item
        events.append(
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": item,
            }
        )
        part = None
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        if part is not None:
            events.append(
                {
                    "type": "response.content_part.added",
                    **self._where(item),
                    "content_index": 0,
                    "part": part,
                }
            )
        # the added event shows the item as it started; later events grow a copy
        self.items[-1] = self.open = json.loads(json.dumps(item))
        if part is not None:
            self.open["content"] = [dict(part)]
        return events

    def feed(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("reasoning_content"):
            text = delta["reasoning_content"]
            self.reasoning_text += text
            if self.open is None or self.open["type"] != "reasoning":
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
                events += self._start(item | {"status": "in_progress"})
            self.open["content"][0]["text"] += text
            events.append(
                {
                    "type": "response.reasoning_text.delta",
                    **self._where(self.open),
                    "content_index": 0,
                    "delta": text,
                }
            )
        if delta.get("content"):
            text = delta["content"]
            if self.open is None or self.open["type"] != "message":
                item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": []}
                events += self._start(item | {"status": "in_progress"})
            self.open["content"][0]["text"] += text
            events.append(
                {
                    "type": "response.output_text.delta",
                    **self._where(self.open),
                    "content_index": 0,
                    "delta": text,
                    "logprobs": [],
                }
            )
        for tc in delta.get("tool_calls") or ():
            fn = tc.get("function") or {}
            if tc.get("id") is not None:  # a call's header (with its arguments so far)
                item = {
                    "id": _id("fc"),
                    "type": "function_call",
                    "call_id": tc["id"],
                    "name": fn.get("name"),
                    "arguments": "",
                    "status": "in_progress",
                }
                events += self._start(item)
                self.calls[tc["index"]] = self.open
            piece = fn.get("arguments") or ""
            call = self.calls.get(tc["index"])
            if piece and call is not None:
                call["arguments"] += piece
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        **self._where(call),
                        "delta": piece,
                    }
                )
        return events

    def close(self, status: str) -> list[dict]:
        """The open item finished (status: completed, or incomplete when output stopped in it)."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where = self._where(item)
        events = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            done = {"type": f"response.{kind}.done", **where, "content_index": 0}
            done["text"] = part["text"]
            if kind == "output_text":
                done["logprobs"] = []
            events.append(done)
            events.append(
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part}
            )
        else:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        events.append(
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": item,
            }
        )
        return events


class ResponsesServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    def chat_request(self, body: ResponsesRequest) -> ChatCompletionRequest:
        try:
            return ChatCompletionRequest.model_validate(chat_body(body))
        except ValidationError as e:
            err = e.errors()[0]
            param = responses_param(error_param(err.get("loc", ()))) or "input"
            msg = str(err.get("msg")).removeprefix("Value error, ")
            raise protocol.invalid(param, msg) from e

    def head(self, body: ResponsesRequest, rid: str, created: int) -> dict:
        """The response object's fields that echo the request."""
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "model": self.serving.model_name,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "background": False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": fmt},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "truncation": "disabled",
            "user": body.user,
            "usage": None,
        }

    async def finished(self, head: dict, items: OutputItems, d: Delta) -> dict:
        """The whole response once its request finished (Delta d: its last)."""
        incomplete = d.finish_reason == "length"
        reasoning_tokens = 0
        if items.reasoning_text:
            text = items.reasoning_text
            reasoning_tokens = await self.serving.prepare(
                lambda e: len(e.tokenizer.encode(text, add_special_tokens=False))
            )
        u = usage([d])
        return head | {
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": items.items,
            "usage": {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": d.cached_tokens},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": u["total_tokens"],
            },
            "ddtree": self.serving.ext([d]),
        }

    async def create(self, body: ResponsesRequest, request: Request):
        try:
            chat = self.chat_request(body)
            (st,), (out,) = await self.serving.start_chat(chat, peer(request))
        except APIError as e:
            raise responses_error(e) from e
        head = self.head(body, _id("resp"), int(time.time()))
        items = OutputItems()
        if body.stream:
            return self.stream(head, st, out, items)
        d = await self.serving.final_delta(st, request)
        items.feed(out.feed(d.text, final=True))
        items.close("incomplete" if d.finish_reason == "length" else "completed")
        return await self.finished(head, items, d)

    def stream(self, head: dict, st, out: ChatOutput, items: OutputItems) -> SSEResponse:
        merged = Interleaved([st])
        seq = iter(range(1 << 62))

        def event(e: dict) -> str:
            e["sequence_number"] = next(seq)
            return f"event: {e['type']}\ndata: {json.dumps(e, separators=(',', ':'))}\n\n"

        async def events():
            yield event({"type": "response.created", "response": head})
            yield event({"type": "response.in_progress", "response": head})
            async for _, d in merged:
                if d.error is not None:
                    err = {"code": d.error_code, "message": d.error}
                    yield event({"type": "error", **err, "param": None})
                    failed = head | {"status": "failed", "error": err, "output": items.items}
                    yield event({"type": "response.failed", "response": failed})
                    return
                for e in items.feed(out.feed(d.text, final=d.finish_reason is not None)):
                    yield event(e)
                if d.finish_reason is not None:
                    incomplete = d.finish_reason == "length"
                    for e in items.close("incomplete" if incomplete else "completed"):
                        yield event(e)
                    final = await self.finished(head, items, d)
                    kind = "response.incomplete" if incomplete else "response.completed"
                    yield event({"type": kind, "response": final})

        return SSEResponse(events(), lambda: merged.close(self.serving.aengine))


def responses_router(serving: OpenAIServing) -> APIRouter:
    responses = ResponsesServing(serving)
    router = APIRouter(prefix="/v1")

    @router.post("/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await responses.create(body, request)

    @router.get("/responses/{response_id}")
    async def get_response(response_id: str):
        raise APIError(
            404,
            f"response {response_id[:64]!r} not found: this server stores no responses",
            param="response_id",
            code="not_found",
        )

    return router
