"""Structured outputs: a request's grammar fields -> one `GrammarSpec`, compiled off the engine
thread before the request is admitted.

Accepted on every route (at most one per request; two -> 400 naming the second):
- OpenAI `response_format`: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}` (`text`: none);
- SGLang's `json_schema` (a JSON string), `regex`, `ebnf` (xgrammar's GBNF, rule `root`), on the
  OpenAI routes and in /generate's `sampling_params`;
- vLLM's `guided_json` (object or string), `guided_regex`, `guided_grammar`, `guided_choice`
  (a list of strings) and `structured_outputs` ({json | regex | grammar | choice | json_object}).

Compilation (`GrammarCompiler.compile`) runs on a worker thread with a time limit
(limits.GRAMMAR_COMPILE_TIMEOUT_S): a source over limits.MAX_GRAMMAR_CHARS, one xgrammar rejects,
one that does not compile in time or whose first mask fill alone is over a step's mask budget is
a 400 naming the field, and the engine thread never compiles more than a cache hit. Workers are
shared fairly between clients (`GrammarCompiler`): a client over its share gets a 429, a request
that waits too long for a worker a 503 saying the server is busy compiling. A server without the
grammar engine answers these requests with a 400 saying so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections import OrderedDict

from ddtree.engine.boundary import FrontendProtocol
from ddtree.engine.round.grammar_jobs import MASK_ROUND_S
from ddtree.grammar import GrammarError, GrammarSpec, GrammarUnavailable
from ddtree.grammar.backend import CACHE_ENTRIES
from ddtree.server import limits
from ddtree.server.protocol import APIError, invalid, json_field, json_text


def _text(value, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json_text(value, param)
    raise invalid(param, "must be a JSON schema (an object or a JSON string)")


def _schema_spec(value, param: str) -> GrammarSpec:
    text = _text(value, param)
    # bounded: a string nested thousands deep was a RecursionError (500) here; the same bound for a
    # schema given as an object
    schema = json_field(text, param, limits.MAX_GRAMMAR_CHARS)
    if not isinstance(schema, (dict, bool)):
        raise invalid(param, "must be a JSON schema object")
    return GrammarSpec("json_schema", text, param)


def _string(value, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(param, "must be a non-empty string")
    return value


def _choice(value, param: str) -> GrammarSpec:
    if not isinstance(value, list) or not value or not all(isinstance(x, str) and x for x in value):
        raise invalid(param, "must be a non-empty list of non-empty strings")
    return GrammarSpec.choice(value, param)


def _response_format(rf) -> GrammarSpec | None:
    if not isinstance(rf, dict):
        raise invalid("response_format", "must be an object with a `type`")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise invalid("response_format.json_schema", "is required with type json_schema")
        if "schema" not in js:
            raise invalid("response_format.json_schema.schema", "is required")
        return _schema_spec(js["schema"], "response_format.json_schema.schema")
    raise invalid(
        "response_format.type", f"must be text, json_object or json_schema (got {kind!r})"
    )


def _structured_outputs(so) -> GrammarSpec | None:
    if not isinstance(so, dict):
        raise invalid("structured_outputs", "must be an object")
    out = []
    for key in ("json", "regex", "grammar", "choice", "json_object"):
        v = so.get(key)
        if v is None or v is False:
            continue
        param = f"structured_outputs.{key}"
        if key == "json":
            out.append(_schema_spec(v, param))
        elif key == "regex":
            out.append(GrammarSpec("regex", _string(v, param), param))
        elif key == "grammar":
            out.append(GrammarSpec("ebnf", _string(v, param), param))
        elif key == "choice":
            out.append(_choice(v, param))
        else:
            out.append(GrammarSpec("json_object", "", param))
    if len(out) > 1:
        raise invalid(out[1].param, f"conflicts with {out[0].param}: give one constraint")
    return out[0] if out else None


def grammar_spec(fields: dict, prefix: str = "") -> GrammarSpec | None:
    """The one grammar a request's fields ask for (None: none). fields: name -> value of the
    request's grammar fields (unset ones None); prefix: where they sit ("sampling_params.")."""
    found: list[GrammarSpec] = []

    def add(spec):
        if spec is not None:
            found.append(spec)

    for name, value in fields.items():
        if value is None:
            continue
        param = prefix + name
        if name == "response_format":
            spec = _response_format(value)
        elif name in ("json_schema", "guided_json"):
            spec = _schema_spec(value, param)
        elif name in ("regex", "guided_regex"):
            spec = GrammarSpec("regex", _string(value, param), param)
        elif name in ("ebnf", "guided_grammar"):
            spec = GrammarSpec("ebnf", _string(value, param), param)
        elif name == "guided_choice":
            spec = _choice(value, param)
        elif name == "structured_outputs":
            spec = _structured_outputs(value)
        else:
            continue
        if spec is not None and spec.param != param and not spec.param.startswith(param):
            spec = GrammarSpec(spec.kind, spec.source, param)
        add(spec)
    if len(found) > 1:
        raise invalid(found[1].param, f"conflicts with {found[0].param}: give one constraint")
    if found and len(found[0].source) > limits.MAX_GRAMMAR_CHARS:
        raise invalid(
            found[0].param,
            f"has {len(found[0].source)} characters; at most {limits.MAX_GRAMMAR_CHARS} are accepted",
        )
    return found[0] if found else None


class GrammarCompiler:
    """Compiles specs on worker threads (the engine's `Grammars` cache: a later admission's
    matcher is a cache hit), each within GRAMMAR_COMPILE_TIMEOUT_S of starting, and times one
    mask fill of the compiled grammar's start state: a grammar whose first mask alone takes more
    than a decoding step's mask budget (engine/round/grammar_jobs.py) could never decode, and is
    refused here instead of after stalling a step.

    xgrammar cannot be interrupted: a compile past its limit finishes on its thread. So the
    workers are shared fairly: one client (the peer address) has at most
    GRAMMAR_COMPILES_PER_CLIENT compiles in flight, its abandoned ones included (more: a 429), a
    request waits at most GRAMMAR_COMPILE_QUEUE_S for a worker (then a 503 saying the server is
    busy compiling, with Retry-After), and the time limit counts from the compile's start: a
    grammar is called too complex only for its own compile time. A cached grammar takes no
    worker."""

    def __init__(self, engine: FrontendProtocol, workers: int | None = None):
        self.engine = engine
        self.pool = concurrent.futures.ThreadPoolExecutor(
            workers or limits.GRAMMAR_COMPILE_WORKERS, thread_name_prefix="grammar"
        )
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}  # client -> compiles queued or running
        # spec key -> why its grammar is refused (its compile succeeded: the cache holds it)
        self._refused: OrderedDict[str, str] = OrderedDict()

    def _compile(self, spec: GrammarSpec, started) -> None:
        started()
        with self._lock:  # one thread builds the tokenizer's grammar compiler
            grammars = self.engine.grammars
        grammars.compile(spec)
        fill_s = grammars.probe(spec)
        if fill_s > MASK_ROUND_S:
            why = (
                f"its first next-token mask took {fill_s:.2f} s, more than a decoding step's "
                f"{MASK_ROUND_S:g} s; simplify the grammar"
            )
            with self._lock:
                self._refused[spec.key] = why
                while len(self._refused) > CACHE_ENTRIES:
                    self._refused.popitem(last=False)

    def _check(self, spec: GrammarSpec) -> bool:
        """True: compiled and accepted before (no worker needed); raises if refused before."""
        with self._lock:
            why = self._refused.get(spec.key)
        if why is not None:
            raise invalid(spec.param, why, code="grammar_too_complex")
        return self.engine.grammar_cached(spec)

    def _admit(self, client: str) -> None:
        with self._lock:
            n = self._in_flight.get(client, 0)
            if n >= limits.GRAMMAR_COMPILES_PER_CLIENT:
                raise APIError(
                    429,
                    f"{n} grammars of this client are still compiling (at most "
                    f"{limits.GRAMMAR_COMPILES_PER_CLIENT} at once); retry when they finish",
                    code="too_many_grammar_compiles",
                    headers={"Retry-After": str(math.ceil(limits.GRAMMAR_COMPILE_TIMEOUT_S))},
                )
            self._in_flight[client] = n + 1

    def _release(self, client: str) -> None:
        with self._lock:
            n = self._in_flight.get(client, 1) - 1
            if n > 0:
                self._in_flight[client] = n
            else:
                self._in_flight.pop(client, None)

    async def compile(self, spec: GrammarSpec | None, client: str = "") -> None:
        """spec compiled (or cached) and accepted, or an APIError: 400 for the grammar itself,
        429 / 503 when this client / the server has too many compiles in flight."""
        if spec is None or self._check(spec):
            return
        self._admit(client)
        loop = asyncio.get_running_loop()
        began = asyncio.Event()
        try:
            fut = self.pool.submit(
                self._compile, spec, lambda: loop.call_soon_threadsafe(began.set)
            )
        except RuntimeError:  # shut down
            self._release(client)
            raise
        fut.add_done_callback(lambda _: self._release(client))
        try:
            await asyncio.wait_for(began.wait(), limits.GRAMMAR_COMPILE_QUEUE_S)
        except asyncio.TimeoutError as e:
            if fut.cancel():
                raise APIError(
                    503,
                    "the server is busy compiling other requests' grammars; retry",
                    param=spec.param,
                    code="grammar_compiler_busy",
                    headers={"Retry-After": str(math.ceil(limits.GRAMMAR_COMPILE_QUEUE_S))},
                ) from e
        try:
            await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(fut)), limits.GRAMMAR_COMPILE_TIMEOUT_S
            )
        except asyncio.TimeoutError as e:
            raise invalid(
                spec.param,
                f"could not be compiled within {limits.GRAMMAR_COMPILE_TIMEOUT_S:g} s; "
                "simplify the grammar",
                code="grammar_too_complex",
            ) from e
        except GrammarUnavailable as e:
            raise APIError(
                400, f"{spec.param}: {e}", param=spec.param, code="unsupported_parameter"
            ) from e
        except GrammarError as e:
            raise invalid(spec.param, f"is not a valid {spec.kind} grammar: {e}") from e
        except ValueError as e:  # no tokenizer
            raise invalid(spec.param, str(e)) from e
        self._check(spec)  # refused by its probe fill

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def peer(request) -> str:
    """The client a request's compile counts against: its peer address (behind a proxy, every
    client shares one)."""
    client = getattr(request, "client", None)
    return client.host if client is not None else ""
