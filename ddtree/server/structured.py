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
(limits.GRAMMAR_COMPILE_TIMEOUT_S): a source over limits.MAX_GRAMMAR_CHARS, one xgrammar rejects
or one that does not compile in time is a 400 naming the field, and the engine thread never
compiles more than a cache hit. A server without the grammar engine answers these requests with
a 400 saying so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from ddtree.grammar import GrammarError, GrammarSpec, GrammarUnavailable
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
    matcher is a cache hit), each within GRAMMAR_COMPILE_TIMEOUT_S."""

    def __init__(self, engine, workers: int = limits.GRAMMAR_COMPILE_WORKERS):
        self.engine = engine
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()

    def _compile(self, spec: GrammarSpec) -> None:
        with self._lock:  # one thread builds the tokenizer's grammar compiler
            grammars = self.engine.grammars
        grammars.compile(spec)

    async def compile(self, spec: GrammarSpec | None) -> None:
        if spec is None:
            return
        fut = asyncio.get_running_loop().run_in_executor(self.pool, self._compile, spec)
        try:
            await asyncio.wait_for(fut, limits.GRAMMAR_COMPILE_TIMEOUT_S)
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

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
