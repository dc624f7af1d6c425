"""The OpenAI Responses API request (`POST /v1/responses`) and its translation into a chat request.

A Responses request runs as the chat completion it describes (server/responses.py): `input` (a
string, or a list of items) and `instructions` become chat messages, `max_output_tokens` becomes
`max_completion_tokens`, `text.format` becomes `response_format`, the flat function tools and
`tool_choice` become chat's nested ones; the chat template, tool parser, reasoning parser and
grammars are the chat route's. Errors the chat layer raises name the Responses field
(`responses_error`).

Input items: messages (`type` "message" or omitted; roles user / system / developer / assistant;
content a string or a list of `input_text` / `output_text` parts), `function_call` (an assistant
turn's call; consecutive calls are one assistant message, as chat has them) and
`function_call_output` (a `tool` message answering its `call_id`), and `reasoning` (its text is the
next assistant message's `reasoning_content`). Images, files, `item_reference` and hosted-tool
items are refused naming the item.

Refused by name (400, code `unsupported_parameter`), as nothing is stored: `previous_response_id`,
`store: true` (vLLM drops it silently; a client told no cannot count on a stored response),
`background: true`, `conversation`, `prompt`, `truncation: "auto"`, `context_management`, and
tools other than `function` (web_search, file_search, mcp, ...).
Accepted without effect: `metadata` (echoed back), `user`, `safety_identifier`, `service_tier`,
`prompt_cache_key`, `prompt_cache_retention`, `max_tool_calls` (it bounds hosted tools, none run
here), `reasoning` (the reasoning parser decides what is reasoning), `stream_options`, and
`include: ["reasoning.encrypted_content"]` (there is nothing to encrypt). vLLM's and SGLang's
sampling extensions (`top_k`, `seed`, `stop`, `regex`, `chat_template_kwargs`, ...) pass through to
the chat request as they are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ddtree.server.limits import (
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_TOOLS,
    Finite,
    Name,
    Text,
    text,
)
from ddtree.server.protocol import APIError, invalid

MAX_METADATA = 16  # OpenAI: 16 key-value pairs, values of up to 512 characters
MAX_METADATA_CHARS = 512
MAX_INCLUDES = 32
MetadataValue = text(MAX_METADATA_CHARS)

# include values accepted: without meaning here (no reasoning is encrypted)
INCLUDES = ("reasoning.encrypted_content",)
# chat-completions fields a Responses request names differently: refused, naming the right one
CHAT_FIELDS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": None,
    "top_logprobs": None,
    "functions": "tools",
    "function_call": "tool_choice",
    "n": None,
}


class ResponsesRequest(BaseModel):
    # undeclared fields (vLLM's / SGLang's extensions) pass to the chat request, which checks them
    model_config = ConfigDict(extra="allow")

    model: Name | None = None
    input: Text | Annotated[list[Any], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    stream: StrictBool = False
    text: dict[str, Any] | None = None
    tools: Annotated[list[Any], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    include: Annotated[list[Name], Field(max_length=MAX_INCLUDES)] | None = None
    metadata: Annotated[dict[Name, MetadataValue], Field(max_length=MAX_METADATA)] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: Name | None = None
    store: StrictBool | None = None
    background: StrictBool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    # accepted without effect (see the module docstring)
    user: Name | None = None
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None
    prompt_cache_retention: Name | None = None
    service_tier: Name | None = None
    max_tool_calls: StrictInt | None = None
    stream_options: dict[str, Any] | None = None


def unsupported(param: str, why: str) -> APIError:
    return invalid(param, f"is not supported by this server: {why}", "unsupported_parameter")


def check_refused(body: ResponsesRequest) -> None:
    """The stateful and hosted features this server does not have, refused by name."""
    if body.previous_response_id is not None:
        raise unsupported(
            "previous_response_id", "responses are not stored; send the whole conversation as input"
        )
    if body.store:
        raise unsupported("store", "responses are not stored; leave it unset or false")
    if body.background:
        raise unsupported("background", "there are no background responses; leave it false")
    for name in ("conversation", "prompt", "context_management"):
        if getattr(body, name) not in (None, [], {}):
            raise unsupported(name, "leave it unset")
    if body.truncation == "auto":
        raise unsupported("truncation", "'auto' is not supported; a prompt too long is a 400")
    for i, value in enumerate(body.include or ()):
        if value not in INCLUDES:
            raise unsupported(f"include.{i}", f"{value!r} (supported: {', '.join(INCLUDES)})")
    if body.model_extra.get("top_logprobs") or body.model_extra.get("logprobs"):
        name = "top_logprobs" if body.model_extra.get("top_logprobs") else "logprobs"
        raise unsupported(name, "log-probs are not returned on /v1/responses; use chat completions")
    for name, other in CHAT_FIELDS.items():
        value = body.model_extra.get(name)
        if value is None or other is None and value in (1, 0, False):
            continue
        why = f"use {other}" if other else "a response has one output"
        raise invalid(name, f"is a chat completions field; {why}", "unsupported_parameter")


def _text(value, param: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(param, "must be a string or a list of input_text parts")
    out = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
            raise unsupported(f"{param}.{j}.type", f"{kind!r} (only text parts are accepted)")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{param}.{j}.text", "must be a string")
        out.append(text)
    return "".join(out)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise invalid(f"{where}.{key}", "is required (a non-empty string)")
    if len(value) > MAX_NAME_CHARS and key != "arguments":
        raise invalid(f"{where}.{key}", f"is over {MAX_NAME_CHARS} characters")
    return value


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat messages (the chat request's `messages`)."""
    out: list[dict] = []
    if body.instructions:  # OpenAI: instructions come first, as a system message
        out.append({"role": "system", "content": body.instructions})
    if body.input is None or body.input == "" or body.input == []:
        raise invalid("input", "is required (a string or a list of input items)")
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    reasoning: str | None = None  # a reasoning item's text, for the next assistant message
    calls: dict | None = None  # the assistant message collecting consecutive function calls
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise invalid(where, "must be an input item object")
        kind = item.get("type", "message")
        if kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            args = item.get("arguments", "")
            if not isinstance(args, str):
                raise invalid(f"{where}.arguments", "must be a string (JSON)")
            names[call_id] = name
            if calls is None:  # one turn: the assistant's text (if just before) and its calls
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and "tool_calls" not in last:
                    calls = last
                else:
                    calls = {"role": "assistant", "content": ""}
                    out.append(calls)
                if reasoning is not None:
                    calls["reasoning_content"], reasoning = reasoning, None
                calls["tool_calls"] = []
            fn = {"name": name, "arguments": args}
            calls["tool_calls"].append({"id": call_id, "type": "function", "function": fn})
            continue
        calls = None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role", "must be user, system, developer or assistant")
            msg = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            msg = {
                "role": "tool",
                "tool_call_id": call_id,
                "content": _text(item.get("output", ""), f"{where}.output"),
            }
            if call_id in names:
                msg["name"] = names[call_id]
            out.append(msg)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, f"{where}.content")
        else:
            raise unsupported(
                f"{where}.type",
                f"{kind!r} (accepted: message, function_call, function_call_output, reasoning)",
            )
    return out


def chat_tools(body: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """The flat Responses function tools and tool_choice in chat's nested form."""
    tools = None
    if body.tools is not None:
        tools = []
        for i, t in enumerate(body.tools):
            if not isinstance(t, dict):
                raise invalid(f"tools.{i}", "must be an object")
            kind = t.get("type")
            if kind != "function":
                raise unsupported(f"tools.{i}.type", f"{kind!r} (only function tools run here)")
            fn = {k: v for k, v in t.items() if k != "type"}
            tools.append({"type": "function", "function": fn})
    choice = body.tool_choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind != "function":
            raise unsupported("tool_choice.type", f"{kind!r} (a named choice is type function)")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools or None, choice


def response_format(body: ResponsesRequest) -> dict | None:
    """`text.format` as chat's `response_format` (json_schema: name, schema, strict)."""
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("text.format", "must be an object with a `type`")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise invalid(
            "text.format.type", f"must be text, json_object or json_schema (got {kind!r})"
        )
    if "schema" not in fmt:
        raise invalid("text.format.schema", "is required with type json_schema")
    js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": js}


def chat_body(body: ResponsesRequest) -> dict:
    """The chat completion request this Responses request is (validated by the chat schema)."""
    check_refused(body)
    tools, choice = chat_tools(body)
    mapped = {
        "messages": chat_messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body),
    }
    extra = {k: v for k, v in (body.model_extra or {}).items() if k not in CHAT_FIELDS}
    return extra | {k: v for k, v in mapped.items() if v is not None}


# the chat request's field -> the Responses field it came from, for errors the chat layer raises
PARAMS = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function", "tool_choice"),
)


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    parts = param.split(".")
    if parts[0] == "tools" and len(parts) > 2 and parts[2] == "function":  # flat tools
        return ".".join(parts[:2] + parts[3:])
    for chat, ours in PARAMS:
        if param == chat or param.startswith(chat + "."):
            return ours + param[len(chat) :] if chat != "messages" else ours
    return param


def responses_error(e: APIError) -> APIError:
    """An error of the chat layer, naming the Responses field."""
    param = responses_param(e.param)
    if param == e.param:
        return e
    message = e.message
    if e.param and message.startswith(e.param):
        message = param + message[len(e.param) :]
    return APIError(e.status, message, param, e.code, e.type, e.headers)
