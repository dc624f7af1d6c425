"""The Responses API's translation, without a server: input items -> chat messages (an agent loop's
history: a message then its calls, the calls' outputs, reasoning carried to its assistant turn),
the chat layer's parameter names -> the Responses fields, and chat output deltas -> output items
and their events (indices and item ids consistent, a new kind of output closing the open item)."""

import pytest

from ddtree.server.protocol import APIError
from ddtree.server.responses import OutputItems
from ddtree.server.responses_protocol import (
    ResponsesRequest,
    chat_body,
    chat_messages,
    responses_error,
    responses_param,
)


def messages(**kw):
    return chat_messages(ResponsesRequest(**kw))


def test_string_input_and_instructions():
    assert messages(input="hi", instructions="be brief") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


def test_an_agent_loops_history():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'}
    out = messages(
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "r"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "let me look", "annotations": []}],
            },
            call,
            call | {"call_id": "c2", "name": "g"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "2"}],
            },
            call | {"call_id": "c3"},
        ]
    )
    assert out == [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "let me look",
            "reasoning_content": "r",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"a": 1}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "g", "arguments": '{"a": 1}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1", "name": "f"},
        {"role": "tool", "tool_call_id": "c2", "content": "2", "name": "g"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c3", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
    ]


@pytest.mark.parametrize(
    "item, param",
    [
        ({"type": "item_reference", "id": "x"}, "input.0.type"),
        ({"role": "tool", "content": "x"}, "input.0.role"),
        ({"role": "user", "content": [{"type": "input_file"}]}, "input.0.content.0.type"),
        ({"type": "function_call", "name": "f"}, "input.0.call_id"),
        ({"type": "function_call_output", "call_id": "c", "output": 3}, "input.0.output"),
    ],
)
def test_bad_items_are_named(item, param):
    with pytest.raises(APIError) as e:
        messages(input=[item])
    assert e.value.param == param and e.value.status == 400


def test_chat_body_maps_the_fields():
    body = chat_body(
        ResponsesRequest(
            input="x",
            max_output_tokens=5,
            tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            tool_choice={"type": "function", "name": "f"},
            text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
            top_k=3,
        )
    )
    assert body["max_completion_tokens"] == 5 and body["top_k"] == 3
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}


@pytest.mark.parametrize(
    "chat, ours",
    [
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("tools.2.function.name", "tools.2.name"),
        ("messages.3.tool_calls.0.function.arguments", "input"),
        ("top_k", "top_k"),
    ],
)
def test_chat_params_name_the_responses_field(chat, ours):
    assert responses_param(chat) == ours
    e = responses_error(APIError(400, f"{chat}: bad", param=chat))
    assert (e.param, e.message) == (ours, f"{ours}: bad")


def test_output_items_and_their_events():
    items = OutputItems()
    events = items.feed({"reasoning_content": "think"})
    events += items.feed({"content": "a"})
    events += items.feed({"content": "b"})
    header = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    events += items.feed({"tool_calls": [header, {"index": 0, "function": {"arguments": "{}"}}]})
    events += items.feed({"content": "after"})
    events += items.close("incomplete")
    kinds = [(e["type"], e.get("output_index")) for e in events]
    assert [k for k, _ in kinds if k.endswith("item.added")] == ["response.output_item.added"] * 4
    assert [i for k, i in kinds if k == "response.output_item.done"] == [0, 1, 2, 3]
    assert [o["type"] for o in items.items] == ["reasoning", "message", "function_call", "message"]
    assert [o["status"] for o in items.items] == ["completed"] * 3 + ["incomplete"]
    assert items.items[1]["content"][0]["text"] == "ab"
    assert items.items[2] | {"id": None} == {
        "id": None,
        "type": "function_call",
        "call_id": "call_1",
        "name": "f",
        "arguments": "{}",
        "status": "completed",
    }
    # each delta names its item, and the added event shows the item as it started
    for e in events:
        if "item_id" in e:
            assert items.items[e["output_index"]]["id"] == e["item_id"]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added[1]["content"] == [] and added[1]["status"] == "in_progress"
