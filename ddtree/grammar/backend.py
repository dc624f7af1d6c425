"""Grammar engine seam: a `GrammarSpec` compiles (once per spec, cached) into a grammar whose
`Matcher`s accept tokens, fill next-token bitmasks, roll back and report termination.

The engine is xgrammar (SGLang's default), chosen by measurement against llguidance on a Qwen3-size
vocabulary (`scripts/grammar_engines.py`, docs/design-numbers.md): a tree walk is dominated by
accept / rollback and per-node mask fills, where xgrammar is an order of magnitude faster.
xgrammar pays at compile time instead (llguidance compiles lazily): compilation runs off the engine
thread (`server/structured.py`) and its result is cached by spec. xgrammar
also rolls back natively (any depth) and fills a mask per draft-tree node in C++
(`traverse_draft_tree`), the two things a tree walk needs.

The dependency is a runtime one (pyproject), but imported lazily: a server that cannot import it
serves every request without a grammar and answers those with one with a 400 naming the field
(`GrammarUnavailable`), never a crash.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ddtree.grammar.regex import translate

KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice")
CACHE_ENTRIES = 256  # compiled grammars kept (LRU); a compiled grammar is ~KBs to a few MB


class GrammarUnavailable(RuntimeError):
    """The grammar engine cannot be imported on this server."""


class GrammarError(ValueError):
    """The grammar source is invalid (the message says why)."""


class MaskCancelled(RuntimeError):
    """The matcher's request gave up on it (its mask work ran past its budget): no more fills."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. kind: json_schema (source: the schema as JSON
    text), json_object (any JSON object; source ignored), regex, ebnf (xgrammar's GBNF dialect,
    root rule `root`), choice (source: a JSON list of strings, the output is one of them).
    `param` names the request field it came from, for error messages."""

    kind: str
    source: str = ""
    param: str = "grammar"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()

    @classmethod
    def json_schema(cls, schema, param: str = "json_schema") -> GrammarSpec:
        # key order kept: a schema's property order is the output's
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text, param)

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> GrammarSpec:
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, options: list[str], param: str = "choice") -> GrammarSpec:
        return cls("choice", json.dumps(list(options)), param)


def _xgrammar():
    try:
        import xgrammar
    except Exception as e:  # noqa: BLE001 - any import failure means: no grammars here
        raise GrammarUnavailable(
            f"structured outputs need the xgrammar package, which cannot be imported here "
            f"({type(e).__name__}: {e}); install it with `pip install xgrammar`"
        ) from e
    return xgrammar


def _ebnf_of_choice(options: list[str]) -> str:
    if not options or not all(isinstance(o, str) and o for o in options):
        raise GrammarError("must be a non-empty list of non-empty strings")
    # JSON string escapes are the GBNF literal escapes xgrammar reads
    return "root ::= " + " | ".join(json.dumps(o) for o in options)


class Grammars:
    """One tokenizer's grammar compiler and its cache of compiled grammars, keyed by spec hash.
    Thread-safe: the server compiles on worker threads while the engine thread makes matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        # xgrammar sees the tokenizer's ids only: the embedding rows past them (padding, up to
        # the model's vocab_size) have no text, so a grammar never allows them, and xgrammar
        # would list each as a special token that every accept_token scans (a cost linear in
        # the padding: BENCHMARKS.md, grammars). The masks keep the model's width; the words
        # past the tokenizer's stay 0 (Matcher.fill).
        ids = tokenizer.get_vocab().values()
        tokenizer_vocab = min(vocab_size, max(ids, default=-1) + 1)
        if any(t >= tokenizer_vocab for t in self.stop_token_ids):
            tokenizer_vocab = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=tokenizer_vocab, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        self.tokenizer_vocab = tokenizer_vocab

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec.key in self._cache

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of spec (cached); GrammarError when the source is invalid."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec):
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                # compact separators, no free whitespace: a model cannot pad the output forever
                return c.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                # an object, not any JSON value (the builtin JSON grammar also takes arrays); as
                # vLLM does, the schema of any object
                return c.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if spec.kind == "regex":
                return c.compile_regex(translate(spec.source))
            if spec.kind == "ebnf":
                return c.compile_grammar(spec.source)
            return c.compile_grammar(_ebnf_of_choice(json.loads(spec.source)))
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises several types for a bad source
            msg = str(e).strip().splitlines()
            raise GrammarError(msg[0] if msg else type(e).__name__) from e

    def matcher(self, spec: GrammarSpec) -> Matcher:
        return Matcher(self.compile(spec), self.words, self.tokenizer_vocab)

    def probe(self, spec: GrammarSpec) -> float:
        """Seconds one mask fill of spec's start state takes (compiled: a cache hit)."""
        import torch

        m = self.matcher(spec)
        m.fill(torch.empty((1, self.words), dtype=torch.int32), 0)
        return m.fill_s


class Matcher:
    """One request's grammar state: the tokens emitted so far. `fill` writes the next-token
    bitmask row (bit t of word t // 32 set = token t allowed); `accept` advances (False: the token
    is not allowed, nothing changes); `rollback` undoes the last accepted tokens."""

    def __init__(self, compiled, words: int, tokenizer_vocab: int):
        xgr = _xgrammar()
        self.m = xgr.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar >= 0.2
        self.words = words
        # the words xgrammar fills (its vocabulary: the tokenizer's), and the last one's valid bits
        self._own_words = (tokenizer_vocab + 31) // 32
        self._tail = (1 << (tokenizer_vocab % 32)) - 1 if tokenizer_vocab % 32 else 0
        self.accepted = 0  # tokens accepted and not rolled back
        # what the fills cost: seconds in all, and the slowest since `slowest_fill_s` was reset
        # (engine/round/grammar_jobs.py sizes the request's tree and bounds its work by them)
        self.fill_s = 0.0
        self.slowest_fill_s = 0.0
        # set by the engine thread when it stops waiting for this matcher: a worker still walking
        # a tree on it stops at its next fill (a fill under way cannot be interrupted)
        self.cancelled = False

    def sync(self, tokens: int) -> None:
        """Back to the state after the first `tokens` accepted tokens (a rolled-back step may
        have advanced it past the request's kept tokens)."""
        if self.accepted > tokens:
            self.rollback(self.accepted - tokens)

    def accept(self, token: int) -> bool:
        ok = self.m.accept_token(int(token))
        self.accepted += ok
        return ok

    def accept_all(self, tokens) -> int:
        """Accept tokens in order until one is refused or the grammar has accepted its stop token
        (what follows that is not the grammar's: never offered to it); returns how many were
        accepted."""
        for i, t in enumerate(tokens):
            if self.terminated or not self.accept(t):
                return i
        return len(tokens)

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)
            self.accepted -= n

    def fill(self, masks, index: int) -> None:
        """Write the next-token bitmask into row `index` of masks (an int32 CPU torch tensor
        [rows, words])."""
        if self.cancelled:
            raise MaskCancelled("the request stopped waiting for its grammar's masks")
        t0 = time.perf_counter()
        try:
            self._fill(masks, index)
        finally:
            dt = time.perf_counter() - t0
            self.fill_s += dt
            self.slowest_fill_s = max(self.slowest_fill_s, dt)

    def _fill(self, masks, index: int) -> None:
        own = self._own_words
        if own == self.words:
            self.m.fill_next_token_bitmask(masks, index)
            return
        self.m.fill_next_token_bitmask(masks[index : index + 1, :own], 0)
        row = masks.numpy()[index]  # numpy indexing: cheaper per node than torch's
        row[own:] = 0  # the ids past the tokenizer's: no text, never allowed
        if self._tail:
            row[own - 1] &= self._tail

    @property
    def terminated(self) -> bool:
        return self.m.is_terminated()


def allowed(row: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """bool per token id: is it set in the bitmask row."""
    return ((row[tokens >> 5] >> (tokens & 31)) & 1).astype(bool)


def only_token(row: np.ndarray) -> int:
    """The single allowed token of a bitmask row, -1 when zero or several are allowed."""
    # count first: no index array for the common row that allows many words' tokens
    if np.count_nonzero(row) != 1:
        return -1
    i = int(np.argmax(row != 0))
    word = int(row[i]) & 0xFFFFFFFF
    if word & (word - 1):
        return -1
    return i * 32 + word.bit_length() - 1
