"""Request bounds and value checks, declared on the request schemas (server/protocol.py for the
OpenAI routes, server/native_protocol.py for `/generate`: the same bounds on both).

Every list and string field of a request has a limit; a request over it, a non-finite number or a
string with a lone UTF-16 surrogate gets a 400 naming the field (api.py renders pydantic's errors).
The limits keep the host work one request causes bounded, so a hostile request cannot slow the
others: stop strings are checked on the engine thread at every step (engine/outputs/detokenizer.py's
StopMatcher, O(max stop length) per token). Tokenizing and chat-template rendering run on the
server's tokenizer threads (openai_serving.py), never on the engine thread.

| field                                        | limit                                           |
|----------------------------------------------|-------------------------------------------------|
| `stop` (`sampling_params.stop`)              | MAX_STOP_STRINGS strings of 1..MAX_STOP_CHARS   |
| `stop_token_ids`                             | MAX_STOP_TOKEN_IDS ids                          |
| `messages`                                   | MAX_MESSAGES messages, MAX_CONTENT_PARTS parts  |
| prompt / message / `text` characters         | PROMPT_CHARS_PER_TOKEN x context length chars   |
|                                              | (checked before tokenizing), then context tokens |
| `n`                                          | protocol.MAX_N                                  |
| `/generate`, `/v1/completions` batch:        | MAX_BATCH_REQUESTS requests (and as many        |
| prompts x `n`                                |                                                 |
|                                              | `sampling_params` / `rid` entries)              |
| `logprobs`, `top_logprobs`, `prompt_logprobs`,| engine/logprobs.MAX_TOP_LOGPROBS per position;  |
| `top_logprobs_num` (prompt ones included)    | prompt positions: the context                   |
| `model`, `user`, `rid`, other names          | MAX_NAME_CHARS characters                       |
| a grammar (`response_format`'s schema,       | MAX_GRAMMAR_CHARS characters; compiled within   |
| `json_schema`, `regex`, `ebnf`, `guided_*`,  | GRAMMAR_COMPILE_TIMEOUT_S on one of             |
| `structured_outputs`, `tools`' grammar)      | GRAMMAR_COMPILE_WORKERS threads, at most        |
|                                              | GRAMMAR_COMPILES_PER_CLIENT per client (server/structured.py) |
| `tools`                                      | MAX_TOOLS functions                             |
| `chat_template_kwargs`                       | MAX_TEMPLATE_KWARGS_CHARS characters as JSON    |
| JSON the server parses out of a string (a    | MAX_JSON_DEPTH levels of nesting, the field's   |
| grammar's schema, a tool call's `arguments`) | size limit (`loads_bounded`)                    |
| unknown fields (server/request_fields.py)    | MAX_UNKNOWN_FIELDS names of MAX_NAME_CHARS      |
| the whole body                               | 8 MiB (server/http.py's BodyLimit)              |
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Annotated

from pydantic import AfterValidator, AllowInfNan, Field, StrictFloat

MAX_STOP_STRINGS = 16  # OpenAI allows 4
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_NAME_CHARS = 256
# requests one /generate or /v1/completions call admits (prompts x n): one call is one client's
# work, and admitting it holds the engine thread for one hop; a larger batch is split by the client
MAX_BATCH_REQUESTS = 256
MAX_GRAMMAR_CHARS = 65536
# a grammar that has not compiled by then is refused (400); the compile thread finishes it into the
# cache (xgrammar cannot be interrupted), so a run of such requests can keep the workers busy but
# never the engine thread
GRAMMAR_COMPILE_TIMEOUT_S = 10.0  # counted from the compile's start, not its wait for a worker
GRAMMAR_COMPILE_WORKERS = 8  # threads, started on demand
# compiles one client (peer address) may have queued or running, abandoned ones included: a client
# sending slow grammars holds at most this many workers, the rest stay free for the others (and for
# its own simple grammars while fewer than this are in flight)
GRAMMAR_COMPILES_PER_CLIENT = 4
# how long a request waits for a compile worker before a 503 (the server is busy compiling)
GRAMMAR_COMPILE_QUEUE_S = 5.0
MAX_TOOLS = 128
MAX_TEMPLATE_KWARGS_CHARS = 16384  # `chat_template_kwargs` as JSON
# JSON parsed out of a string (loads_bounded): Python's parser recurses once per level and raises
# RecursionError (an HTTP 500) near 1000 levels; real schemas and arguments nest a few dozen at
# most, and the grammar compiler and chat templates walk what is parsed recursively too
MAX_JSON_DEPTH = 128
MAX_JSON_CHARS = 8 << 20  # as large as a request body (server/http.py)
MAX_UNKNOWN_FIELDS = 64  # fields neither vLLM nor SGLang declares, per request (object)
# a prompt string longer than this many characters per context token cannot fit once tokenized (no
# tokenizer packs more into one token in practice); refused before the engine thread spends time
# tokenizing
PROMPT_CHARS_PER_TOKEN = 32


def no_surrogates(text: str) -> str:
    """Lone UTF-16 surrogates (JSON "\\ud800") are valid JSON but not Unicode: no tokenizer takes
    them and no response can echo them, so they are a client error, found here instead of deep in
    the engine."""
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            raise ValueError(
                f"contains a lone UTF-16 surrogate U+{ord(ch):04X} at index {i}; send valid "
                "Unicode (a surrogate pair encodes one character)"
            )
    return text


def text(max_length: int | None = None):
    """A request string: valid Unicode, at most max_length characters when given."""
    return Annotated[str, Field(max_length=max_length), AfterValidator(no_surrogates)]


Text = text()
Name = text(MAX_NAME_CHARS)
StopString = text(MAX_STOP_CHARS)  # empty ones: protocol.sampling_params names them
# NaN and +-Infinity parse from JSON (Python's json accepts them) but mean nothing as a sampling
# knob
Finite = Annotated[StrictFloat, AllowInfNan(False)]


def prompt_chars_limit(max_context: int) -> int:
    return PROMPT_CHARS_PER_TOKEN * max_context


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a string literal, escapes included
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JSONBoundError(ValueError):
    """JSON over a size or nesting bound (loads_bounded): a client error, never a parse attempt."""


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets inside strings do not
    count), without recursion and at C speed: strings are cut out, then the running sum of the
    bracket steps peaks at the depth. Text that is not JSON gets some number: the parse that follows
    refuses it."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def check_json_bounds(
    text: str, max_chars: int = MAX_JSON_CHARS, max_depth: int = MAX_JSON_DEPTH
) -> None:
    """Raises JSONBoundError when text is over max_chars characters or nests deeper than
    max_depth."""
    if len(text) > max_chars:
        raise JSONBoundError(f"has {len(text)} characters; at most {max_chars} are accepted")
    if text.count("[") + text.count("{") <= max_depth:  # cannot nest deeper: no scan
        return
    depth = json_depth(text)
    if depth > max_depth:
        raise JSONBoundError(f"nests {depth} levels deep; at most {max_depth} are accepted")


def loads_bounded(text: str, max_chars: int = MAX_JSON_CHARS, max_depth: int = MAX_JSON_DEPTH):
    """json.loads for every JSON the server parses out of a string (request fields and model
    output alike): over a bound it raises JSONBoundError, a ValueError like a parse error, so a
    deep `"[" * 5000` is refused by name instead of reaching the recursive parser."""
    check_json_bounds(text, max_chars, max_depth)
    return json.loads(text)
