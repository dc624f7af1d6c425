"""`--tool-call-parser hermes | qwen3_coder`: tool calls parsed out of a chat output, incrementally.

hermes (Qwen3): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, one block per
call. qwen3_coder (Qwen3.5 / 3.6, Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=P>\\n
VALUE\\n</parameter>\\n...</function>\\n</tool_call>`, a parameter's value raw text converted by the
tool's schema (strings stay text; other types are read as JSON when they parse).

Text outside the blocks is content; a tag split across chunks is held back until it can be told
apart. A stream yields, per call, a first entry with its index, id and name (and the argument
text certain by then), then argument text as it becomes certain (hermes: the arguments JSON as
generated; qwen3_coder: one `"P": value` piece per finished parameter, the braces around them);
never two entries of one call from one feed. A call's argument pieces concatenate to its
non-streamed `arguments`. A block that does not parse stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ddtree.server.limits import loads_bounded

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "qwen3_coder")


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def json_value_end(text: str) -> int | None:
    """End index of the JSON value text starts with (after whitespace), None if incomplete."""
    depth, i, in_str, esc, started = 0, 0, False, False, False
    while i < len(text):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif ch in " \t\r\n" and not started:
            pass
        elif ch == '"':
            in_str, started = True, True
        elif ch in "{[":
            depth, started = depth + 1, True
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and started and ch in ",}] \n":
            return i
        else:
            started = True
        i += 1
    return None


@dataclass
class ToolCall:
    index: int
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    name: str | None = None
    arguments: str = ""
    sent_header: bool = False
    sent_args: int = 0

    def header(self, arguments: str = "") -> dict:
        """The call's first stream entry: its index, id and name, and the arguments so far."""
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }

    def as_message(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolParser:
    """feed(text) -> (content delta, tool-call deltas); `calls` holds the finished calls."""

    def __init__(self, kind: str, tools: list[dict] | None = None):
        if kind not in PARSERS:
            raise ValueError(f"tool-call parser must be one of {PARSERS}, got {kind!r}")
        self.kind = kind
        self.schemas = {
            t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()
        }
        self.buf = ""
        self.in_call = False
        self.calls: list[ToolCall] = []
        self.current: ToolCall | None = None
        self.content_lead = False  # after a call: whitespace before more content is dropped

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buf += text
        content, deltas = [], []
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i >= 0:
                    content.append(self._content(self.buf[:i]))
                    self.buf, self.in_call = self.buf[i + len(OPEN) :], True
                    self.current = ToolCall(len(self.calls))
                    continue
                keep = 0 if final else _partial_suffix(self.buf, OPEN)
                content.append(self._content(self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep :]
                break
            j = self.buf.find(CLOSE)
            body = self.buf if j < 0 else self.buf[:j]
            call = self.current
            ok = self._progress(call, body, done=j >= 0 or final)
            deltas += self._deltas(call)
            if j < 0:
                if final:  # cut off inside a block: what parsed is a call, else content
                    if call.sent_header:
                        self.calls.append(call)
                    else:
                        content.append(OPEN + self.buf)
                    self.buf = ""
                break
            self.buf, self.in_call = self.buf[j + len(CLOSE) :], False
            if ok:
                self.calls.append(call)
                self.content_lead = True
            else:
                content.append(OPEN + body + CLOSE)
            self.current = None
        return "".join(content), deltas

    def _content(self, text: str) -> str:
        if self.content_lead:
            text = text.lstrip()
            if text:
                self.content_lead = False
        return text

    def _deltas(self, call: ToolCall) -> list[dict]:
        """At most one entry for the call (a client merges the entries of a chunk by index)."""
        header = call.name is not None and not call.sent_header
        call.sent_header = call.sent_header or header
        piece = call.arguments[call.sent_args :] if call.sent_header else ""
        call.sent_args += len(piece)
        if header:
            return [call.header(piece)]
        return [{"index": call.index, "function": {"arguments": piece}}] if piece else []

    # ---- formats ------------------------------------------------------------------------------------
    def _progress(self, call: ToolCall, body: str, done: bool) -> bool:
        if self.kind == "hermes":
            return self._hermes(call, body, done)
        return self._coder(call, body, done)

    def _hermes(self, call: ToolCall, body: str, done: bool) -> bool:
        if call.name is None:
            m = re.match(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body)
            if m:
                call.name = json.loads(f'"{m.group(1)}"')
        m = re.search(r'"arguments"\s*:\s*', body)
        if call.name is not None and m:
            rest = body[m.end() :]
            end = json_value_end(rest)
            call.arguments = rest if end is None else rest[:end]
        if not done:
            return True
        try:
            obj = loads_bounded(body)  # model output may nest thousands deep: never a 500
        except ValueError:
            return call.sent_header
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return call.sent_header
        if call.name is None:
            call.name = obj["name"]
        if not call.arguments:
            call.arguments = json.dumps(obj.get("arguments", {}))
        return True

    def _coder(self, call: ToolCall, body: str, done: bool) -> bool:
        if call.name is None:
            m = re.match(r"\s*<function=([^>\n]+)>", body)
            if not m:
                return False
            call.name = m.group(1).strip()
        props = (self.schemas.get(call.name) or {}).get("properties") or {}
        pieces = []
        for m in re.finditer(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", body, re.S):
            key, raw = m.group(1).strip(), m.group(2)
            pieces.append(f"{json.dumps(key)}: {json.dumps(_convert(raw, props.get(key)))}")
        closed = "</function>" in body
        args = "{" + ", ".join(pieces)
        if closed:
            args += "}"
        # only whole parameters are certain: keep what was sent as a prefix
        call.arguments = args if pieces or closed else ""
        if done and not closed:
            call.arguments = args + "}"
        return True


def _convert(raw: str, schema: dict | None):
    """A parameter's raw text as its schema's type: strings stay text, the rest JSON if it parses
    (a parameter without a schema too), else text."""
    if (schema or {}).get("type") == "string":
        return raw
    try:
        return loads_bounded(raw)
    except ValueError:
        return raw
