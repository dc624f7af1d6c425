"""A chat request's tools and the chat output they and the reasoning parser make.

Request side (`ChatTools.of`): `tools` (or the legacy `functions`) validated (a function needs a
name; at most limits.MAX_TOOLS), `tool_choice` (or `function_call`): `none` renders no tools and
parses none; `auto` renders them and parses calls with `--tool-call-parser` (required for it);
`required` and a named function are enforced by a grammar, as vLLM does: the output is a JSON
array of `{"name", "parameters"}` objects (at least one, each name one of the tools and its
parameters valid for its schema), or for a named function its arguments object alone; neither
needs a parser. A `functions` request is answered as OpenAI answers it: one `function_call`
(parallel calls off), `finish_reason: "function_call"`.

Output side (`ChatOutput`): per choice, text -> (reasoning_content, content, tool_calls),
incrementally for streams (`feed`, `stream_deltas`) and at once otherwise (`feed(text,
final=True)`): the same code, so a stream's deltas concatenate to the non-streamed message.
"""

from __future__ import annotations

import json

from ddtree.grammar import GrammarSpec
from ddtree.server import limits
from ddtree.server.protocol import invalid
from ddtree.server.reasoning import ReasoningParser
from ddtree.server.tool_parsers import ToolCall, ToolParser


def _function(t, i: int, param: str) -> dict:
    if not isinstance(t, dict):
        raise invalid(f"{param}.{i}", "must be an object")
    f = t.get("function") if param == "tools" else t
    where = f"{param}.{i}.function" if param == "tools" else f"{param}.{i}"
    if param == "tools" and t.get("type", "function") != "function":
        raise invalid(f"{param}.{i}.type", "must be 'function'")
    if not isinstance(f, dict):
        raise invalid(where, "must be an object with a name")
    name = f.get("name")
    if not isinstance(name, str) or not name.strip():
        raise invalid(f"{where}.name", "is required (a non-empty string)")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise invalid(f"{where}.parameters", "must be a JSON schema object")
    return {"type": "function", "function": dict(f, parameters=params)}


class ChatTools:
    def __init__(
        self,
        tools: list[dict],
        choice: str,
        named: str | None,
        parser: str | None,
        parallel: bool = True,
        legacy: bool = False,
    ):
        self.tools, self.choice, self.named, self.parser = tools, choice, named, parser
        self.parallel = parallel  # parallel_tool_calls: false = at most one call (required: one)
        # the request named `functions`: answered with one `function_call`, as OpenAI does
        self.legacy = legacy

    @classmethod
    def of(cls, body, parser: str | None) -> ChatTools | None:
        tools, param = body.tools, "tools"
        choice = body.tool_choice
        if tools is None and body.functions is not None:
            tools, param, choice = body.functions, "functions", body.function_call
        if not tools:
            for name in ("tool_choice", "function_call"):
                if getattr(body, name) not in (None, "none", "auto"):
                    raise invalid(
                        name, f"needs {'tools' if name == 'tool_choice' else 'functions'}"
                    )
            return None
        if len(tools) > limits.MAX_TOOLS:
            raise invalid(param, f"has {len(tools)} tools; at most {limits.MAX_TOOLS}")
        fns = [_function(t, i, param) for i, t in enumerate(tools)]
        names = [f["function"]["name"] for f in fns]
        cparam = "tool_choice" if param == "tools" else "function_call"
        named = None
        if choice is None:
            choice = "auto"
        if isinstance(choice, dict):
            fn = choice.get("function") if param == "tools" else choice
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str):
                raise invalid(
                    cparam, "a named choice is {'type': 'function', 'function': {'name'}}"
                )
            if name not in names:
                raise invalid(cparam, f"names the function {name!r}, which is not in {param}")
            choice, named = "named", name
        elif choice not in ("none", "auto", "required"):
            raise invalid(
                cparam, f"must be none, auto, required or a named function (got {choice!r})"
            )
        if choice == "auto" and parser is None:
            raise invalid(
                param,
                "tool_choice 'auto' needs a tool-call parser: start the server with "
                "--tool-call-parser hermes (Qwen3) or qwen3_coder (Qwen3.5 / 3.6)",
                code="unsupported_parameter",
            )
        legacy = param == "functions"
        parallel = body.parallel_tool_calls is not False and not legacy
        return cls(fns, choice, named, parser, parallel, legacy)

    @property
    def render(self) -> list[dict] | None:
        """The tools the chat template renders (none with tool_choice none)."""
        return None if self.choice == "none" else self.tools

    def grammar(self) -> GrammarSpec | None:
        if self.choice == "named":
            fn = next(f["function"] for f in self.tools if f["function"]["name"] == self.named)
            return GrammarSpec("json_schema", json.dumps(fn["parameters"]), "tool_choice")
        if self.choice != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [f["function"]["name"]]},
                    "parameters": f["function"]["parameters"],
                },
                "required": ["name", "parameters"],
            }
            for f in self.tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return GrammarSpec("json_schema", json.dumps(schema), "tool_choice")


def complete_items(text: str) -> list:
    """The complete elements of a JSON array's text, which may be cut anywhere; none when it nests
    deeper than limits.MAX_JSON_DEPTH (the parser recurses: a RecursionError, not a call)."""
    dec, items = json.JSONDecoder(), []
    i = text.find("[") + 1
    if i == 0:
        return items
    try:
        limits.check_json_bounds(text)
    except limits.JSONBoundError:
        return items
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            item, i = dec.raw_decode(text, i)
        except ValueError:
            return items
        items.append(item)


class ChatOutput:
    """One choice's text -> message fields. feed() returns the delta fields it completes
    (reasoning_content, content, tool_calls - one entry per call index - or, for a `functions`
    request, function_call: only the non-empty ones); stream_deltas() the same as the deltas of
    consecutive chunks, shaped as OpenAI streams them."""

    def __init__(self, reasoning: str | None, tools: ChatTools | None, prompt: str):
        self.tools = tools
        mode = tools.choice if tools is not None else "none"
        self.parser = (
            ToolParser(tools.parser, tools.tools) if mode == "auto" and tools.parser else None
        )
        self.grammar_calls = mode in ("required", "named")
        # the calls' grammar holds the output from its first token: no reasoning in it, even
        # where the prompt left a <think> block open (Qwen3.5 / 3.6)
        self.reasoning = (
            ReasoningParser(reasoning, prompt) if reasoning and not self.grammar_calls else None
        )
        self.legacy = tools is not None and tools.legacy
        self.raw = ""  # required / named: the JSON the grammar made
        self.named_call: ToolCall | None = None
        self.reasoning_text, self.content = [], []
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> dict:
        return self._legacy(self._feed(text, final))

    def stream_deltas(self, text: str, final: bool = False) -> list[dict]:
        """feed() as the deltas of consecutive chunks (at least one; [{}] when there is nothing),
        shaped as OpenAI streams calls: one call per chunk, in order, a call's header (index, id,
        type, name, arguments "") in a chunk of its own and its argument text from the next.
        Clients rely on it: the SDK's stream helper takes a call as finished (and parses its
        arguments) when a chunk moves on to the next index."""
        delta = self._feed(text, final)
        pieces = []
        for c in delta.pop("tool_calls", ()):
            if "id" in c:
                pieces.append(dict(c, function=dict(c["function"], arguments="")))
                args = c["function"]["arguments"]
                if not args:
                    continue
                c = {"index": c["index"], "function": {"arguments": args}}
            pieces.append(c)
        deltas = [delta | ({"tool_calls": pieces[:1]} if pieces else {})]
        deltas += [{"tool_calls": [c]} for c in pieces[1:]]
        return [d for d in map(self._legacy, deltas) if d] or [{}]

    def _legacy(self, delta: dict) -> dict:
        """A `functions` request's delta: its first call as `function_call` (the name in the
        first piece), no tool_calls."""
        if not self.legacy or "tool_calls" not in delta:
            return delta
        first = [c["function"] for c in delta.pop("tool_calls") if c["index"] == 0]
        return delta | ({"function_call": dict(first[0])} if first else {})

    def _feed(self, text: str, final: bool) -> dict:
        delta: dict = {}
        if self.reasoning is not None:
            r, text = self.reasoning.feed(text, final)
            if r:
                delta["reasoning_content"] = r
                self.reasoning_text.append(r)
        if self.grammar_calls:
            calls = self._grammar_calls(text, final)
            if calls:
                delta["tool_calls"] = calls
            return delta
        calls = []
        if self.parser is not None:
            text, calls = self.parser.feed(text, final)
            self.calls = self.parser.calls
        if text:
            delta["content"] = text
            self.content.append(text)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _grammar_calls(self, text: str, final: bool) -> list[dict]:
        self.raw += text
        if self.tools.choice == "named":  # the arguments, streamed as they come
            call = self.named_call
            if call is None:
                call = self.named_call = ToolCall(0, name=self.tools.named)
                self.calls = [call]
                call.arguments = text
                return [call.header(text)]
            call.arguments += text
            return [{"index": 0, "function": {"arguments": text}}] if text else []
        if not final:
            return []
        items = complete_items(self.raw)  # cut by max_tokens: the calls that finished
        out = []
        for i, it in enumerate(items):
            call = ToolCall(i, name=it["name"], arguments=json.dumps(it["parameters"]))
            self.calls.append(call)
            out.append(call.header(call.arguments))
        return out

    def message(self) -> dict:
        msg: dict = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning is not None and self.reasoning.saw_reasoning:
            msg["reasoning_content"] = "".join(self.reasoning_text)
        if self.calls and self.legacy:
            call = self.calls[0]
            msg["function_call"] = {"name": call.name, "arguments": call.arguments}
        elif self.calls:
            msg["tool_calls"] = [c.as_message() for c in self.calls]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg

    def finish_reason(self, reason: str) -> str:
        if not self.calls or reason != "stop":
            return reason
        return "function_call" if self.legacy else "tool_calls"
