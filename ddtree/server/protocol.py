"""OpenAI request schemas, OpenAI-style error bodies, and the translation of a request into SamplingParams.

Parameters this server cannot honour (OpenAI's, vLLM's and SGLang's) are rejected with 400 naming
the field when set to anything but their neutral value, so a client never gets unconstrained text
for a constrained request: the declared ones below (UNSUPPORTED), the rest in
server/request_fields.py, which also says what happens to a field nobody knows (ignored, with a
warning). `seed` is honoured, `user` accepted. Sizes and value checks of every field:
server/limits.py. Structured outputs (`response_format`, SGLang's `json_schema` / `regex` /
`ebnf`, vLLM's `guided_*` and `structured_outputs`): server/structured.py; tools and reasoning:
server/chat_tools.py. Extensions beyond OpenAI (vLLM's and SGLang's names): `top_k`,
`stop_token_ids`, `ignore_eos`, `include_stop_str_in_output` (SGLang: `no_stop_trim`),
`skip_special_tokens`, `spaces_between_special_tokens`, `add_special_tokens` (default false: the
prompt is tokenized as given), chat's `add_generation_prompt` and `continue_final_message`, and
`ddtree_budget` (this request's DDTree budget; values above the server's
`--speculative-ddtree-budget` are capped at it).

`logprobs` (completions: an int, the top-k per position; chat: a bool, with `top_logprobs`) report
the target's log-softmax at each emitted position before temperature / top-k / top-p, as vLLM does
by default. Prompt log-probs (engine/round/prompt_logprobs.py): a completion's `echo` puts the prompt (text
and, with `logprobs`, its log-probs: null at the first position) before each choice's output, and
`max_tokens: 0` is accepted with `echo` (the prompt alone); vLLM's `prompt_logprobs: k` (<= 20; its
-1 is refused; not with `stream`, as vLLM) adds `prompt_logprobs` per completion choice, or to a chat
response. `prompt` may be a list of strings or of token-id lists (OpenAI's batch): prompts x `n` <=
limits.MAX_BATCH_REQUESTS, choice index = prompt index x n + choice, usage counting each prompt
once. `n` (up to MAX_N) runs n independent requests; with a `seed`, choice i samples with seed + i.
Any `model` name is accepted (the one served model answers, as SGLang does); responses report the
served name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ddtree.engine.round.logprobs import MAX_TOP_LOGPROBS
from ddtree.engine.scheduling.request import SamplingParams
from ddtree.grammar import GrammarSpec
from ddtree.server import limits, request_fields
from ddtree.server.limits import (
    MAX_BATCH_REQUESTS,
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    Finite,
    Name,
    StopString,
    Text,
)

MAX_SEED = 2**63
MAX_N = 16


class APIError(Exception):
    """A request failure with its HTTP status, rendered as {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers  # e.g. Retry-After on a 503 for back-pressure

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def json_field(text: str, param: str, max_chars: int = limits.MAX_JSON_CHARS):
    """JSON a request carries inside a string (a schema, a tool call's arguments), parsed within
    limits.loads_bounded's bounds: too large, too deep or not JSON is a 400 naming param."""
    try:
        return limits.loads_bounded(text, max_chars)
    except limits.JSONBoundError as e:
        raise invalid(param, str(e)) from e
    except ValueError as e:
        raise invalid(param, f"is not valid JSON: {e}") from e


def json_text(value, param: str) -> str:
    """A request's JSON value (from the body: its nesting is under Python's recursion limit, not
    under MAX_JSON_DEPTH) as text for json_field; nesting too deep to serialise is a 400."""
    try:
        return json.dumps(value)
    except RecursionError as e:
        raise invalid(param, f"nests deeper than {limits.MAX_JSON_DEPTH} levels") from e


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far
    continuous_usage_stats: StrictBool = False


class GrammarFields(BaseModel):
    """The structured-output fields every route takes (vLLM's and SGLang's spellings; at most one
    set, `server/structured.py` turns it into a GrammarSpec)."""

    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None

    GRAMMAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "json_schema",
        "regex",
        "ebnf",
        "guided_json",
        "guided_regex",
        "guided_grammar",
        "guided_choice",
        "structured_outputs",
    )

    def grammar_fields(self) -> dict:
        return {name: getattr(self, name) for name in self.GRAMMAR_FIELDS}


class _SamplingFields(GrammarFields):
    # undeclared fields are kept (model_extra) for request_fields.check_extra
    model_config = ConfigDict(extra="allow")

    model: Name | None = None
    max_tokens: StrictInt | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    no_stop_trim: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    add_special_tokens: StrictBool = False
    ddtree_budget: StrictInt | None = None
    n: StrictInt | None = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    min_p: Finite | None = None
    min_tokens: StrictInt | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: Any = None
    # vLLM's: the top-k log-probs of every prompt position (server/prompt_logprobs docs below)
    prompt_logprobs: StrictInt | None = None

    GRAMMAR_FIELDS: ClassVar[tuple[str, ...]] = ("response_format", *GrammarFields.GRAMMAR_FIELDS)

    # (field, neutral values): set to anything else, the request is rejected instead of silently ignored
    UNSUPPORTED: ClassVar[tuple] = (
        ("presence_penalty", (None, 0)),
        ("frequency_penalty", (None, 0)),
        ("repetition_penalty", (None, 1)),
        ("min_p", (None, 0)),
        ("min_tokens", (None, 0)),
        ("logit_bias", (None, {})),
    )


class CompletionRequest(_SamplingFields):
    prompt: (
        Text
        | list[StrictInt]
        | Annotated[list[Text], Field(max_length=MAX_BATCH_REQUESTS)]
        | Annotated[list[list[StrictInt]], Field(max_length=MAX_BATCH_REQUESTS)]
    )
    echo: StrictBool | None = None
    suffix: Text | None = None
    logprobs: StrictInt | None = None
    best_of: int | None = None

    UNSUPPORTED: ClassVar[tuple] = _SamplingFields.UNSUPPORTED + (
        ("suffix", (None, "")),
        ("best_of", (None, 1)),
    )


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    # an assistant turn's calls, a tool result's call id / name, a thinking turn's reasoning: passed
    # to the chat template as they are (a call's JSON-string arguments as an object)
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    function_call: dict[str, Any] | None = None  # legacy: an assistant turn's one call
    tool_call_id: Name | None = None
    name: Name | None = None
    reasoning_content: Text | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    parallel_tool_calls: StrictBool | None = None
    # passed to the tokenizer's chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # with --reasoning-parser: reasoning_content apart from content (SGLang's default: true)
    separate_reasoning: StrictBool = True


def check_extra(extra: dict | None, refused: dict[str, tuple], route: str) -> None:
    """A request's undeclared fields (request_fields.refused_field): one that changes the output
    is a 400 naming it; unknown ones over their bounds a 400 naming the bound."""
    try:
        name = request_fields.refused_field(extra, refused, route)
    except request_fields.UnknownFieldsOverBound as e:
        raise APIError(400, str(e), code="too_many_unknown_fields") from e
    if name is not None:
        raise invalid(
            name, "is not supported by this server; leave it unset", "unsupported_parameter"
        )


def check_supported(req: _SamplingFields) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise invalid("n", f"must be in 1..{MAX_N} (got {req.n})")
    if req.seed is not None and (req.n or 1) > 1 and req.seed + req.n - 1 >= MAX_SEED:
        raise invalid("seed", f"with n={req.n}, seeds seed..seed+{req.n - 1} must be below 2**63")
    for name, neutral in req.UNSUPPORTED:
        if getattr(req, name) not in neutral:
            raise invalid(
                name,
                "is not supported by this server; leave it unset",
                code="unsupported_parameter",
            )
    chat = isinstance(req, ChatCompletionRequest)
    refused = request_fields.CHAT_REFUSED if chat else request_fields.SAMPLING_REFUSED
    route = "/v1/chat/completions" if chat else "/v1/completions"
    check_extra(req.model_extra, refused, route)
    if chat and req.add_generation_prompt and req.continue_final_message:
        raise invalid(
            "continue_final_message",
            "cannot be used with add_generation_prompt: true (set it to false)",
        )


def logprob_fields(req: _SamplingFields) -> tuple[bool, int]:
    """(report log-probs, top-k per position) of a completion (`logprobs: int`) or chat request
    (`logprobs: bool`, `top_logprobs: int`); a bad value raises a 400 naming its field."""
    if isinstance(req, ChatCompletionRequest):
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid("top_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS} (got {top})")
        if top and not req.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        return bool(req.logprobs), top
    lp = getattr(req, "logprobs", None)
    if lp is not None and not 0 <= lp <= MAX_TOP_LOGPROBS:
        raise invalid("logprobs", f"must be in 0..{MAX_TOP_LOGPROBS} (got {lp})")
    return lp is not None, lp or 0


def completion_prompts(req: CompletionRequest) -> tuple[list[str | list[int]], bool]:
    """(the prompts, whether a list was sent) of a completion request: one string or token-id
    list, or a list of them (OpenAI's, vLLM's and SGLang's batch), at most MAX_BATCH_REQUESTS
    requests with `n`."""
    p = req.prompt
    batch = isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))
    prompts = list(p) if batch else [p]
    for i, one in enumerate(prompts):
        if len(one) == 0:
            raise invalid(f"prompt.{i}" if batch else "prompt", "is empty")
    total = len(prompts) * (req.n or 1)
    if total > MAX_BATCH_REQUESTS:
        raise invalid(
            "prompt",
            f"{len(prompts)} prompts x n={req.n or 1} make {total} requests; at most "
            f"{MAX_BATCH_REQUESTS} per call (split the batch)",
        )
    return prompts, batch


def prompt_logprob_k(req: _SamplingFields) -> int | None:
    """The top-k of the request's prompt log-probs (None: none asked): vLLM's `prompt_logprobs`,
    or a completion's `echo` with `logprobs` (the echoed prompt's log-probs); the larger when
    both are set, each rendered with its own k."""
    k = req.prompt_logprobs
    if k is not None:
        if not 0 <= k <= MAX_TOP_LOGPROBS:  # vLLM's -1 (the whole vocabulary) is unbounded
            raise invalid("prompt_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS} (got {k})")
        if req.stream:  # vLLM refuses them too: they come back in the final body only
            raise invalid("prompt_logprobs", "is not available with stream: true")
    echo_k = req.logprobs if isinstance(req, CompletionRequest) and req.echo else None
    if echo_k is None:
        return k
    return echo_k if k is None else max(k, echo_k)


def complete_members(text: str) -> dict:
    """The complete members of a JSON object's text, which may be cut anywhere ({} when it is no
    object's start)."""
    dec, out = json.JSONDecoder(), {}
    i = _skip_space(text, 0)
    if text[i : i + 1] != "{":
        return out
    i += 1
    while True:
        try:
            key, i = dec.raw_decode(text, _skip_space(text, i, ","))
            i = _skip_space(text, i)
            if not isinstance(key, str) or text[i : i + 1] != ":":
                return out
            value, i = dec.raw_decode(text, _skip_space(text, i + 1))
        except (ValueError, RecursionError):  # the cut (or a value nested past the stack)
            return out
        if i == len(text) and type(value) in (int, float):  # "n": 3 may have been cut from 35
            return out
        out[key] = value


def _skip_space(text: str, i: int, also: str = "") -> int:
    while i < len(text) and text[i] in " \t\r\n" + also:
        i += 1
    return i


def tool_arguments(args: str, param: str) -> dict:
    """A tool call's JSON-string arguments as the chat template takes them: a mapping (Qwen3.5 /
    3.6 iterate `arguments|items`; transformers hands templates plain JSON types only, so no
    object can be a string to some and a mapping to others). Arguments that are not a JSON object
    are accepted, as OpenAI accepts any string (a call cut by max_tokens is sent back so by every
    agent loop): their complete members, the call as far as it was certain. Too large or too deep
    (limits.loads_bounded) is a 400 naming param."""
    try:
        value = limits.loads_bounded(args) if args.strip() else {}
    except limits.JSONBoundError as e:
        raise invalid(param, str(e)) from e
    except ValueError:
        return complete_members(args)
    return value if isinstance(value, dict) else {}


def _call_for_template(call: dict, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid(
            where, "a tool call is {'id', 'type': 'function', 'function': {'name', 'arguments'}}"
        )
    args = fn.get("arguments", {})
    if isinstance(args, str):  # templates iterate the arguments (Qwen3.5: `arguments|items`)
        args = tool_arguments(args, f"{where}.function.arguments")
    return dict(call, function=dict(fn, arguments=args))


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as the chat template takes them. Legacy turns are read as today's:
    an assistant's `function_call` as its one tool call, a `function` message as a tool result."""
    if not req.messages:
        raise invalid("messages", "is empty")
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg = {"role": "tool" if m.role == "function" else m.role, "content": content or ""}
        calls = m.tool_calls
        if not calls and m.function_call is not None:
            calls = [{"type": "function", "function": m.function_call}]
        for j, c in enumerate(calls or ()):
            where = (
                f"messages.{i}.tool_calls.{j}" if m.tool_calls else f"messages.{i}.function_call"
            )
            msg.setdefault("tool_calls", []).append(_call_for_template(c, where))
        for key in ("tool_call_id", "name", "reasoning_content"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


def check_prompt_ids(ids: list[int], vocab_size: int, max_context: int, param: str) -> None:
    if not ids:
        raise invalid(param, "is empty (no tokens after tokenization)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid(param, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_context:
        raise APIError(
            400,
            f"{param}: has {len(ids)} tokens but this model's context length is {max_context} "
            "tokens (prompt plus at least one generated token must fit)",
            param=param,
            code="context_length_exceeded",
        )


def sampling_params(
    req: _SamplingFields,
    prompt_len: int,
    max_context: int,
    default_max_tokens: int | None,
    grammar: GrammarSpec | None = None,
) -> SamplingParams:
    """Validated SamplingParams; each bad value raises a 400 naming its field. default_max_tokens None means
    'up to the context length'."""
    room = max_context - prompt_len
    max_tokens = req.max_tokens
    name = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    echo = isinstance(req, CompletionRequest) and bool(req.echo)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens == 0 and echo:
        pass  # the prompt alone comes back (with its log-probs): lm-eval's loglikelihood
    elif max_tokens <= 0:
        with_echo = " (0 with echo: true)" if isinstance(req, CompletionRequest) else ""
        raise invalid(name, f"must be at least 1{with_echo} (got {max_tokens})")
    elif max_tokens > room:
        raise APIError(
            400,
            f"{name}: {max_tokens} is too large: the prompt has {prompt_len} tokens and this "
            f"model's context length is {max_context}, so at most {room} tokens can be generated",
            param=name,
            code="context_length_exceeded",
        )
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < 0:
        raise invalid("temperature", f"must be >= 0 (got {temperature})")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise invalid("top_p", f"must be in (0, 1] (got {top_p})")
    top_k = -1 if req.top_k is None else req.top_k
    if top_k < -1:
        raise invalid("top_k", f"must be -1 or 0 (disabled) or a positive count (got {top_k})")
    if req.seed is not None and not 0 <= req.seed < MAX_SEED:
        raise invalid("seed", f"must be in [0, 2**63) (got {req.seed})")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise invalid("stop", "stop strings must be non-empty")
    if any(t < 0 for t in req.stop_token_ids or ()):
        raise invalid("stop_token_ids", "token ids must be non-negative")
    if req.ddtree_budget is not None and req.ddtree_budget < 1:
        raise invalid("ddtree_budget", f"must be >= 1 (got {req.ddtree_budget})")
    want_logprobs, top_logprobs = logprob_fields(req)
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            ddtree_budget=req.ddtree_budget,
            logprobs=want_logprobs,
            top_logprobs=top_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output or req.no_stop_trim,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            grammar=grammar,
            prompt_logprobs=prompt_logprob_k(req),
        )
    except ValueError as e:
        raise APIError(400, str(e)) from e
