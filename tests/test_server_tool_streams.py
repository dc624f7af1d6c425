"""Tool calls and JSON as the `openai` SDK consumes them (issue 55): one DDTREE server on the
embedded pair with the Qwen3.5 fixture template, `--tool-call-parser qwen3_coder --reasoning-parser
qwen3`. Streamed calls in every tool_choice mode read back by `chat.completions.stream()` (one
entry per call index per chunk, OpenAI's header-then-arguments shape, parallel calls on distinct
indices), `json_object` giving objects across seeds, a call cut by max_tokens accepted back as
history, the legacy `functions` answered with `function_call`, and vLLM's
`continuous_usage_stats`. ~45 s on 2 shared cores."""

import json
import os
import shutil

import httpx
import pytest
from qwen_templates import QWEN35
from server_fixtures import server_argv, thread_server

from ddtree.assets import PACKAGE_PAIR


def _tool(name: str, properties: dict) -> dict:
    params = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    # strict: the SDK's stream helper parses only strict tools' arguments
    return {"type": "function", "function": {"name": name, "parameters": params, "strict": True}}


WEATHER = _tool(
    "get_weather",
    {"city": {"type": "string", "maxLength": 10}, "unit": {"type": "string", "enum": ["c", "f"]}},
)
CLOCK = _tool("get_time", {"zone": {"type": "string", "enum": ["utc", "cet"]}})
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# tool_choice auto: the tiny model never calls a tool of its own, so a regex makes it write two
# qwen3_coder blocks (the parser, not a grammar, reads them)
TWO_CALLS = (
    r"<tool_call>\n<function=get_weather>\n<parameter=city>\n[a-z]{2,8}\n</parameter>\n"
    r"<parameter=unit>\n(c|f)\n</parameter>\n</function>\n</tool_call>\n"
    r"<tool_call>\n<function=get_time>\n<parameter=zone>\n(utc|cet)\n</parameter>\n"
    r"</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35_pair")
    target = root / "target"
    shutil.copytree(os.path.join(PACKAGE_PAIR, "target"), target)
    (target / "chat_template.jinja").write_text(QWEN35)
    pair = (str(target), os.path.join(PACKAGE_PAIR, "drafter"))
    argv = server_argv(
        pair, "DDTREE", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3"
    )
    with thread_server(argv) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def raw_chunks(client, state=None, **kw) -> list[dict]:
    """The stream's chunks as sent (the SDK's objects would hide a repeated index), each also
    handed to `state` (the SDK's ChatCompletionStreamState, what `.stream()` runs)."""
    stream = client.chat.completions.create(
        model="m", messages=USER, temperature=0, stream=True, **kw
    )
    out = []
    for ch in stream:
        if state is not None:
            state.handle_chunk(ch)
        out.append(ch.model_dump(exclude_unset=True))
    return out


def check_call_entries(chunks: list[dict]) -> dict[int, str]:
    """Every chunk holds at most one entry per call index; a call's first entry is OpenAI's
    header (id, type, name, arguments "") and the later ones arguments only. Returns each
    index's arguments."""
    args: dict[int, str] = {}
    for ch in chunks:
        for choice in ch["choices"]:
            entries = choice["delta"].get("tool_calls") or []
            indices = [e["index"] for e in entries]
            assert len(indices) == len(set(indices)), ch
            for e in entries:
                if e["index"] not in args:
                    assert e["id"] and e["type"] == "function" and e["function"]["name"], e
                    assert e["function"]["arguments"] == "", e
                    args[e["index"]] = ""
                else:
                    assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                    args[e["index"]] += e["function"]["arguments"]
    return args


def stream_helper(client, **kw):
    kw.setdefault("extra_body", NO_THINKING)
    with client.chat.completions.stream(model="m", messages=USER, temperature=0, **kw) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion().choices[0]


def test_named_tool_choice_streamed_reads_back_as_one_call(client):
    choice = stream_helper(client, tools=[WEATHER, CLOCK], tool_choice=NAMED, max_tokens=100)
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}
    chunks = raw_chunks(
        client, tools=[WEATHER, CLOCK], tool_choice=NAMED, max_tokens=100, extra_body=NO_THINKING
    )
    assert check_call_entries(chunks) == {0: call.function.arguments}


def test_required_and_auto_streamed_calls_have_distinct_indices(client):
    required = dict(tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=60)
    choice = stream_helper(client, **required, parallel_tool_calls=False)
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls"
    assert isinstance(json.loads(call.function.arguments), dict)
    # the tiny model repeats calls until max_tokens: the finished ones come at the end, in order
    chunks = raw_chunks(client, **(required | {"max_tokens": 100}), extra_body=NO_THINKING)
    args = check_call_entries(chunks)
    assert len(args) > 1 and all(isinstance(json.loads(a), dict) for a in args.values())
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState(input_tools=[WEATHER, CLOCK])
    chunks = raw_chunks(
        client,
        state,
        tools=[WEATHER, CLOCK],
        tool_choice="auto",
        max_tokens=200,
        extra_body=NO_THINKING | {"regex": TWO_CALLS},
    )
    calls = state.get_final_completion().choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2
    assert [set(json.loads(c.function.arguments)) for c in calls] == [{"city", "unit"}, {"zone"}]
    assert check_call_entries(chunks) == {i: c.function.arguments for i, c in enumerate(calls)}


def test_json_object_is_an_object_on_every_route(client, server):
    # sampled, several seeds: any JSON value let `[1]` through on most; an object's text starts
    # with "{" (no free whitespace), and one that finished parses as an object
    outs = [
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Some JSON:"}],
            response_format={"type": "json_object"},
            max_tokens=40,
            temperature=1,
            seed=seed,
            extra_body=NO_THINKING,
        ).choices[0]
        for seed in range(6)
    ]
    assert all(o.message.content.startswith("{") for o in outs), [o.message.content for o in outs]
    finished = [json.loads(o.message.content) for o in outs if o.finish_reason == "stop"]
    assert finished and all(isinstance(x, dict) for x in finished)
    text = client.completions.create(
        model="m",
        prompt="x=",
        max_tokens=20,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert text.choices[0].text.startswith("{")
    r = httpx.post(
        server.base_url + "/generate",
        json={
            "text": "x=",
            "sampling_params": {"max_new_tokens": 20, "structured_outputs": {"json_object": True}},
        },
        timeout=60,
    )
    assert r.json()["text"].startswith("{")


def test_call_cut_by_max_tokens_is_accepted_back(client):
    resp = client.chat.completions.create(
        model="m",
        messages=USER,
        tools=[WEATHER],
        tool_choice=NAMED,
        max_tokens=3,
        temperature=0,
        extra_body=NO_THINKING,
    )
    choice = resp.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "error: arguments cut"},
    ]
    again = client.chat.completions.create(
        model="m", messages=history, tools=[WEATHER], max_tokens=3, extra_body=NO_THINKING
    )
    assert again.choices[0].finish_reason == "length"


def test_legacy_functions_answer_with_function_call(client):
    fn = WEATHER["function"]
    legacy = dict(functions=[fn], function_call={"name": "get_weather"}, max_tokens=100)
    resp = client.chat.completions.create(
        model="m", messages=USER, temperature=0, extra_body=NO_THINKING, **legacy
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    call = choice.message.function_call
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
    pieces = [
        c["choices"][0]["delta"]["function_call"]
        for c in raw_chunks(client, extra_body=NO_THINKING, **legacy)
        if c["choices"] and "function_call" in c["choices"][0]["delta"]
    ]
    assert pieces[0] == {"name": "get_weather", "arguments": ""}
    assert all(set(p) == {"arguments"} for p in pieces[1:])
    assert "".join(p["arguments"] for p in pieces) == call.arguments
    # the legacy history: the assistant's function_call and the function's result
    history = USER + [
        {"role": "assistant", "content": None, "function_call": call.model_dump()},
        {"role": "function", "name": "get_weather", "content": '{"temp": 20}'},
    ]
    again = client.chat.completions.create(
        model="m", messages=history, functions=[fn], function_call="none", max_tokens=3
    )
    assert again.choices[0].finish_reason == "length"


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_on_every_chunk(client, route):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model="m", max_tokens=12, temperature=0, n=2, stream=True, stream_options=opts)
    if route == "chat":
        stream = client.chat.completions.create(messages=USER, **kw)
    else:
        stream = client.completions.create(prompt="Once upon a time", **kw)
    chunks = list(stream)
    *choice_chunks, last = chunks
    assert not last.choices and last.usage.completion_tokens == 24
    seen = {0: 0, 1: 0}
    for ch in choice_chunks:
        (c,) = ch.choices
        u = ch.usage
        assert u.prompt_tokens == last.usage.prompt_tokens
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert u.completion_tokens >= seen[c.index]
        seen[c.index] = u.completion_tokens
    assert seen == {0: 12, 1: 12}
