"""The reasoning and tool-call parsers against the real formats: the fixture templates
(tests/qwen_templates.py) render the public Qwen3 / Qwen3.5 strings for tools, calls, tool results
and thinking (checked here string for string), the parsers read back the calls those templates
render, and every split of an output into stream chunks (tags cut anywhere) gives the same result
as the whole output. ~2 s."""

import json
import random

import pytest
from qwen_templates import QWEN3, QWEN35

from ddtree.assets import PACKAGE_PAIR
from ddtree.server import limits
from ddtree.server.chat_tools import ChatOutput, ChatTools, complete_items
from ddtree.server.protocol import ChatCompletionRequest, chat_messages
from ddtree.server.reasoning import ReasoningParser, prompt_opens_reasoning
from ddtree.server.tool_parsers import ToolParser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(f"{PACKAGE_PAIR}/target")


def render(tok, template, messages, **kw):
    return tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True, **kw
    )


TOOL_JSON = json.dumps(WEATHER, ensure_ascii=False)
QWEN3_WANT = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
    f"XML tags:\n<tools>\n{TOOL_JSON}\n</tools>\n\nFor each function call, return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 2}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\nsunny\n'
    "</tool_response><|im_end|>\n<|im_start|>assistant\n"
)
QWEN35_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


def test_qwen3_template_renders_the_public_format(tok):
    assert render(tok, QWEN3, CONVERSATION, tools=[WEATHER]) == QWEN3_WANT
    plain = [{"role": "user", "content": "hi"}]
    assert render(tok, QWEN3, plain) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render(tok, QWEN3, plain, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    past = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2", "reasoning_content": "\nadd\n"},
        {"role": "user", "content": "and 2+2?"},
    ]
    assert "<|im_start|>assistant\n<think>\nadd\n</think>\n\n2<|im_end|>" in render(
        tok, QWEN3, past
    )


def test_qwen35_template_renders_the_public_format(tok):
    text = render(tok, QWEN35, CONVERSATION, tools=[WEATHER])
    assert text.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n"
        f"<tools>\n{TOOL_JSON}\n</tools>\n\nIf you choose to call a function ONLY reply in the "
        "following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
    )
    assert "</tool_call>\n\nBe brief.<|im_end|>\n" in text
    assert f"<|im_start|>assistant\n{QWEN35_CALL}<|im_end|>\n" in text
    assert "<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    assert prompt_opens_reasoning(text)
    off = render(tok, QWEN35, CONVERSATION[:2], enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n") and not prompt_opens_reasoning(off)


def assistant_text(rendered: str) -> str:
    """The last assistant turn's body in a rendered conversation."""
    body = rendered.rsplit("<|im_start|>assistant\n", 2)[-2]
    return body.split("<|im_end|>")[0]


@pytest.mark.parametrize("template,kind", [(QWEN3, "hermes"), (QWEN35, "qwen3_coder")])
def test_parser_reads_what_the_template_renders(tok, template, kind):
    two = dict(CALL, function={"name": "get_weather", "arguments": {"city": "Rome"}})
    msgs = CONVERSATION[:2] + [
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, two]}
    ]
    text = assistant_text(render(tok, template, msgs, tools=[WEATHER]))
    p = ToolParser(kind, [WEATHER])
    content, _ = p.feed(text, final=True)
    assert content == "Checking.\n"
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_weather", {"city": "Rome"}),
    ]


def streamed_tools(kind, text, rng):
    p, content, names, args, i = ToolParser(kind, [WEATHER]), "", {}, {}, 0
    while i <= len(text):
        j = i + rng.randint(1, 6)
        c, deltas = p.feed(text[i:j], final=j > len(text))
        content, i = content + c, j
        assert len({d["index"] for d in deltas}) == len(deltas)  # one entry per call per feed
        for d in deltas:
            if "id" in d:
                assert d["index"] not in names
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    return content, [(names[k], args[k]) for k in sorted(names)]


@pytest.mark.parametrize(
    "kind,text",
    [
        (
            "hermes",
            'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}b\\""}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
        ),
        ("hermes", "<tool_call>\nnot json\n</tool_call> so text"),
        ("hermes", "a <tool_ b <tool_call"),
        ("qwen3_coder", "x\n" + QWEN35_CALL + "\n" + QWEN35_CALL),
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon"),
    ],
)
def test_tool_stream_equals_whole(kind, text):
    p = ToolParser(kind, [WEATHER])
    content, _ = p.feed(text, final=True)
    whole = (content, [(c.name, c.arguments) for c in p.calls])
    for seed in range(40):
        assert streamed_tools(kind, text, random.Random(seed)) == whole
    for _, a in whole[1]:
        json.loads(a)  # a qwen3_coder call cut by the end is closed after its whole parameters


def chat_tools(**body) -> ChatTools:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **body)
    return ChatTools.of(req, "qwen3_coder")


TWO_CODER_CALLS = "Sure.\n" + QWEN35_CALL + "\n" + QWEN35_CALL.replace("Paris", "Rome")


@pytest.mark.parametrize(
    "body,text",
    [
        ({"tools": [WEATHER], "tool_choice": "auto"}, TWO_CODER_CALLS),
        (
            {"tools": [WEATHER], "tool_choice": "required"},
            json.dumps([{"name": "get_weather", "parameters": {"city": "A"}}] * 3),
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            '{"city": "Paris", "days": 2}',
        ),
        (
            {"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}},
            '{"city": "Paris"}',
        ),
    ],
    ids=["auto", "required", "named", "legacy"],
)
def test_stream_deltas_send_calls_as_openai_does(body, text):
    """One call per chunk, in index order: its header (id, type, name, arguments "") alone, then
    its argument text; the pieces add up to the non-streamed message (a legacy `functions`
    request: the same as `function_call`)."""
    whole = ChatOutput(None, chat_tools(**body), "")
    whole.feed(text, final=True)
    want = whole.message()
    for seed in range(20):
        rng, out, i = random.Random(seed), ChatOutput(None, chat_tools(**body), ""), 0
        calls, content, fn = [], "", {}
        while i <= len(text):
            j = i + rng.randint(1, 8)
            for d in out.stream_deltas(text[i:j], final=j > len(text)):
                content += d.get("content", "")
                for k, v in d.get("function_call", {}).items():
                    fn[k] = fn.get(k, "") + v
                entries = d.get("tool_calls", [])
                assert len(entries) <= 1
                for e in entries:
                    if "id" in e:  # a new call, after the previous one's last piece
                        assert e["index"] == len(calls) and e["function"]["arguments"] == ""
                        calls.append(dict(e, function=dict(e["function"])))
                    else:
                        assert e["index"] == len(calls) - 1 and set(e) == {"index", "function"}
                        calls[-1]["function"]["arguments"] += e["function"]["arguments"]
            i = j
        assert content == (want["content"] or "")
        streamed = [{k: c[k] for k in ("id", "type", "function")} for c in calls]
        assert streamed == out.message().get("tool_calls", [])
        assert [c["function"] for c in streamed] == [
            c["function"] for c in want.get("tool_calls", [])
        ]
        assert fn == want.get("function_call", {})
    if "functions" in body:
        assert "tool_calls" not in want and whole.finish_reason("stop") == "function_call"


def test_grammar_calls_are_calls_where_the_prompt_opens_thinking():
    """Qwen3.5's generation prompt opens <think>; a named or required call's grammar holds the
    output from its first token, so it is the call, not reasoning."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = ChatOutput("qwen3", chat_tools(tools=[WEATHER], tool_choice=named), "<think>\n")
    out.feed('{"city": "Paris"}', final=True)
    msg = out.message()
    assert "reasoning_content" not in msg
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize(
    "args,members",
    [
        # cut by max_tokens: the members that finished ("days": 2 may have been cut from 21)
        ('{"city": "Paris", "days": 2', {"city": "Paris"}),
        ('{"city": "Paris", "days": 2,', {"city": "Paris", "days": 2}),
        ('{"cit', {}),
        ("[1]", {}),
        ("not json", {}),
        ("", {}),
    ],
)
def test_arguments_that_are_no_json_object_render(tok, args, members):
    """OpenAI takes any string as a call's arguments; both templates render what was certain of
    it (Qwen3.5's iterates `arguments|items`, which a string would fail)."""
    call = dict(CALL, function={"name": "get_weather", "arguments": args})
    msgs = chat_messages(
        ChatCompletionRequest(
            messages=CONVERSATION[1:2]
            + [{"role": "assistant", "content": "", "tool_calls": [call]}]
        )
    )
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == members
    want = '{"name": "get_weather", "arguments": ' + json.dumps(members) + "}"
    assert want in render(tok, QWEN3, msgs, tools=[WEATHER])
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in members.items())
    assert f"<function=get_weather>\n{params}</function>" in render(
        tok, QWEN35, msgs, tools=[WEATHER]
    )


@pytest.mark.parametrize(
    "kind,prompt,text,want",
    [
        ("qwen3", "", "<think>\nStep one.\n</think>\n\nFour.", ("Step one.", "Four.")),
        ("qwen3", "<|im_start|>assistant\n<think>\n", "hm\n</think>\n\nYes", ("hm", "Yes")),
        ("qwen3", "", "No block <think>x</think>", (None, "No block <think>x</think>")),
        ("qwen3", "", "<think>cut by max_tok", ("cut by max_tok", "")),
        ("qwen3", "<think>\n\n</think>\n\n", "Direct.", (None, "Direct.")),
        ("deepseek-r1", "", "reasoning</think>answer", ("reasoning", "answer")),
        ("qwen3", "", "<thi", (None, "<thi")),
        # issue 54: without a block the answer is the output byte for byte (indented code, a
        # lone space of max_tokens 1, leading newlines); after a block only the template's
        # newlines go, the answer's indentation stays
        ("qwen3", "", "    def __init__(self):", (None, "    def __init__(self):")),
        ("qwen3", "", " ", (None, " ")),
        ("qwen3", "", "\n\n  x = 1\n", (None, "\n\n  x = 1\n")),
        ("qwen3", "", "<think>\nr\n</think>\n\n    pass", ("r", "    pass")),
        ("qwen3", "<|im_start|>assistant\n<think>\n", "r</think>\n\tx", ("r", "\tx")),
    ],
)
def test_reasoning_split_and_stream(kind, prompt, text, want):
    assert ReasoningParser(kind, prompt).parse(text) == want
    for seed in range(40):
        rng, p, r, c, i = random.Random(seed), ReasoningParser(kind, prompt), "", "", 0
        while i <= len(text):
            j = i + rng.randint(1, 4)
            dr, dc = p.feed(text[i:j], final=j > len(text))
            r, c, i = r + dr, c + dc, j
        assert ((r if p.saw_reasoning else None), c) == want


DEEP = "[" * 5000 + "]" * 5000


def test_model_output_nested_deep_is_no_call_and_no_error():
    """Issue 54: the parsers read JSON out of the model's text through limits.loads_bounded; text
    nested thousands deep (a RecursionError in json.loads) is not a call and raises nothing."""
    p = ToolParser("hermes")
    content, _ = p.feed(f'<tool_call>\n{{"name": "f", "arguments": {DEEP}}}\n</tool_call>', True)
    assert p.calls == [] or p.calls[0].name == "f"
    coder = ToolParser("qwen3_coder")
    coder.feed(
        f"<tool_call>\n<function=f>\n<parameter=x>\n{DEEP}\n</parameter>\n</function>\n", True
    )
    assert json.loads(coder.calls[0].arguments) == {"x": DEEP}  # kept as text
    assert complete_items(f'[{{"name": "f", "parameters": {DEEP}}}]') == []
    assert complete_items('[{"name": "f", "parameters": {}}, {"na') == [
        {"name": "f", "parameters": {}}
    ]


@pytest.mark.parametrize(
    "text,depth",
    [("1", 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4), ('["[[[", "\\"]]"]', 1), (DEEP, 5000)],
)
def test_json_depth_skips_brackets_in_strings(text, depth):
    assert limits.json_depth(text) == depth
    if depth <= limits.MAX_JSON_DEPTH:
        assert limits.loads_bounded(text) == json.loads(text)
    else:
        with pytest.raises(limits.JSONBoundError, match="nests 5000 levels deep"):
            limits.loads_bounded(text)
    with pytest.raises(limits.JSONBoundError, match="characters"):
        limits.loads_bounded(text + " " * 10, max_chars=len(text) + 9)
