"""Conformance: the `openai` SDK's own helpers against a real server, checking what they return, so
a protocol slip fails here the way it fails a user. One DDTREE server on the embedded pair (CPU,
fp32; speculation on) with `--reasoning-parser qwen3 --tool-call-parser hermes`, started once.

Responses API: `responses.create` (string input, a message list with instructions, function calls
and their outputs as input, `max_output_tokens` -> status incomplete), `responses.stream()` and
`create(stream=True)` (OpenAI's event order and sequence numbers, the final response's text equal
to the deltas), `responses.parse(text_format=PydanticModel)`, function tools with tool_choice named
and required (`function_call` items whose arguments parse), reasoning items, a failure mid-stream
(an `error` event, then `response.failed`), and the features refused by name. Chat side:
`chat.completions.stream()` and `chat.completions.parse()` (a pydantic response_format and a
strict pydantic function tool).

The embedded pair writes Python-like code whatever the prompt, so the checks are of protocol
structure and grammar-constrained validity, never of content. Every request is a few tokens."""

import json
import os
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_fixtures import server_argv, thread_server

from ddtree.assets import PACKAGE_PAIR

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "unit": {"type": "string", "enum": ["c", "f"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
CLOCK = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
        "required": ["zone"],
    },
}
THINK = r"<think>[a-z]{2,6}( [a-z]{2,6})?</think>\n\n[a-z]{2,6}"  # a forced reasoning block


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


class Lookup(BaseModel):
    """A strict function tool for chat's parse helper."""

    city: str = Field(max_length=6)


@pytest.fixture(scope="module")
def server(one_torch_thread):
    pair = (os.path.join(PACKAGE_PAIR, "target"), os.path.join(PACKAGE_PAIR, "drafter"))
    argv = server_argv(
        pair, "DDTREE", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"
    )
    with thread_server(argv) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def create(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 6)
    return client.responses.create(model="m", **kw)


def test_create_string_and_message_list(client):
    r = create(client, input="def add(a, b):")
    assert r.object == "response" and r.id.startswith("resp_") and r.model
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "incomplete"
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text
    u = r.usage
    assert u.output_tokens == 6 and u.total_tokens == u.input_tokens + u.output_tokens
    assert r.model_extra["ddtree"]["algorithm"] == "DDTREE"  # speculation on
    # a message list with instructions is the chat request it describes: same prompt, same tokens
    items = [
        {"role": "developer", "content": "Write Python."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x = "}]},
    ]
    r = create(client, input=items, instructions="# module", max_output_tokens=4)
    chat = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "# module"},
            {"role": "developer", "content": "Write Python."},
            {"role": "user", "content": "x = "},
        ],
        temperature=0,
        max_tokens=4,
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "# module" and r.store is False


def test_stream_event_order(client):
    events = list(create(client, input="def f(x):", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # stopped by max_output_tokens, as OpenAI ends it
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas == events[-4].text and final.usage.output_tokens == 6
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {final.output[0].id}


def test_stream_helper_and_parse(client):
    with client.responses.stream(model="m", input="color:", text_format=Pick, temperature=0) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text == deltas
    assert isinstance(final.output_parsed, Pick)
    r = client.responses.parse(model="m", input="color:", text_format=Pick, temperature=0)
    assert r.output_parsed == final.output_parsed  # T=0: the same answer
    # json_object: an object
    r = create(client, input="{", text={"format": {"type": "json_object"}}, max_output_tokens=40)
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def test_function_tools(client):
    named = {"type": "function", "name": "get_weather"}
    r = create(
        client, input="weather?", tools=[WEATHER, CLOCK], tool_choice=named, max_output_tokens=40
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    args = json.loads(call.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    # streamed: the argument deltas are the arguments
    events = list(
        create(
            client,
            input="weather?",
            tools=[WEATHER, CLOCK],
            tool_choice=named,
            max_output_tokens=40,
            stream=True,
        )
    )
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == done.arguments == events[-1].response.output[0].arguments == call.arguments
    # required: at least one call among the tools, arguments that parse
    r = create(
        client,
        input="time?",
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time")
    json.loads(calls[0].arguments)
    # the call and its output as the next turn's input (an agent loop); none: no call
    follow = [
        {"role": "user", "content": "weather?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 20}'},
    ]
    r = create(client, input=follow, tools=[WEATHER], tool_choice="none", max_output_tokens=3)
    assert [o.type for o in r.output] == ["message"] and r.usage.input_tokens > 0


def test_reasoning_items(client):
    r = create(client, input="why?", max_output_tokens=40, extra_body={"regex": THINK})
    reasoning, msg = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text and msg.type == "message" and "<think>" not in r.output_text
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(
        create(client, input="why?", max_output_tokens=40, extra_body={"regex": THINK}, stream=True)
    )
    r_deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    t_deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (r_deltas, t_deltas) == (reasoning.content[0].text, r.output_text)
    assert events[-1].type == "response.completed"


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"extra_body": {"regex": "(unclosed"}}, "regex"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content.0.type",
        ),
    ],
)
def test_refused_by_name(client, kw, param):
    kw.setdefault("input", "x")
    with pytest.raises(openai.BadRequestError) as e:
        create(client, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_nothing_stored(client):
    r = httpx.get(str(client.base_url) + "responses/resp_1", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_a_failure_mid_stream_is_an_error_event_then_failed(server, client, monkeypatch):
    engine = server.engine
    real = engine.decoder.round

    def round_(reqs, max_context):
        if any(engine.tokenizer.decode(r.prompt_ids).startswith("#poison") for r in reqs):
            raise RuntimeError("injected failure")
        return real(reqs, max_context)

    monkeypatch.setattr(engine.decoder, "round", round_)
    events = list(create(client, input="#poison", max_output_tokens=8, stream=True))
    monkeypatch.undo()
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    error, failed = events[-2:]
    assert error.type == "error" and "injected failure" in error.message
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.message == error.message
    assert create(client, input="x", max_output_tokens=2).status == "incomplete"


def test_chat_stream_and_parse_helpers(client):
    messages = [{"role": "user", "content": "color:"}]
    with client.chat.completions.stream(
        model="m", messages=messages, response_format=Pick, temperature=0
    ) as s:
        deltas = "".join(e.delta for e in s if e.type == "content.delta")
        final = s.get_final_completion()
    assert final.choices[0].message.content == deltas
    parsed = final.choices[0].message.parsed
    assert isinstance(parsed, Pick)
    r = client.chat.completions.parse(
        model="m", messages=messages, response_format=Pick, temperature=0
    )
    assert r.choices[0].message.parsed == parsed
    r = client.chat.completions.parse(
        model="m",
        messages=messages,
        tools=[openai.pydantic_function_tool(Lookup)],
        tool_choice={"type": "function", "function": {"name": "Lookup"}},
        temperature=0,
        max_tokens=40,
    )
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Lookup)
