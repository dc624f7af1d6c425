"""Incremental detokenization and stop-string matching, one token at a time so a stop string that
completes inside an accepted block cuts the output exactly there."""

from __future__ import annotations

import functools
import re


class IncrementalDetokenizer:
    """Emits text as tokens arrive; holds back bytes of an unfinished UTF-8 character (U+FFFD).
    `skip_special_tokens` / `spaces_between_special_tokens`: the request's (SamplingParams)."""

    def __init__(
        self,
        tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.kw = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:  # the default of every tokenizer that has the knob
            self.kw["spaces_between_special_tokens"] = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, clean_up_tokenization_spaces=False, **self.kw)

    def append(self, token: int) -> str:
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new
        return ""

    def extend(self, tokens: list[int]) -> str:
        """`append` of each token, in two decodes for the whole run (a deferred flush holds ~7
        tokens per round: one at a time, the two decodes per token were most of the server's
        host time per round at concurrency 32). A run ending in a partial UTF-8 character goes
        one token at a time, so its complete characters still come out now."""
        if len(tokens) > 1:
            n = len(self.ids)
            self.ids.extend(tokens)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if not full.endswith("\ufffd"):
                if len(full) <= len(prefix):
                    return ""
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                return full[len(prefix) :]
            del self.ids[n:]
        return "".join(self.append(t) for t in tokens)


class StopMatcher:
    """Stop-string checks whose cost does not grow with the output: `find` scans only the window
    that the newest characters can complete (one regex pass for every stop string at once),
    `holdback` only the last `max_len - 1` characters. Per call: O(new + max_len) for find,
    O(max_len^2) for holdback, whatever the text length; the request bounds (server/limits.py) cap
    the stop count and lengths."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.max_len = max(map(len, stops), default=0)
        # longest first, so at one start index the regex reports a stop rather than its own prefix
        alts = sorted(set(stops), key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, alts))) if alts else None
        # hashes of every proper prefix: a suffix of the text is looked up in O(1), then confirmed
        self.prefix_hashes = frozenset(hash(s[:k]) for s in alts for k in range(1, len(s)))

    def find(self, text: str, new_len: int) -> int:
        """Index where the earliest stop string begins among matches that overlap the last `new_len`
        characters; -1 if none. (Earlier text holds no stop: it would have finished the request.)"""
        hit = self.match(text, new_len)
        return -1 if hit is None else hit[0]

    def match(self, text: str, new_len: int) -> tuple[int, str] | None:
        """(index, stop string) of the earliest match overlapping the last `new_len` characters."""
        if self.pattern is None:
            return None
        m = self.pattern.search(text, max(0, len(text) - new_len - self.max_len + 1))
        return (m.start(), m.group()) if m else None

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string:
        characters that a later token may still turn into a stop (and cut), so they are not streamed
        yet."""
        for k in range(min(self.max_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if hash(tail) in self.prefix_hashes and any(
                len(s) > k and s.startswith(tail) for s in self.stops
            ):
                return k
        return 0


@functools.lru_cache(maxsize=64)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """One matcher per distinct stop tuple (requests usually share a few); built once, reused every
    step."""
    return StopMatcher(stops)


def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> int:
    """Index in `text` where the earliest stop string begins, considering only matches that overlap
    the last `new_len` characters; -1 if none."""
    return stop_matcher(tuple(stops)).find(text, new_len)


def match_stop(text: str, new_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """`find_stop`'s match as (index, the stop string that matched), or None."""
    return stop_matcher(tuple(stops)).match(text, new_len)


def stop_holdback(text: str, stops: tuple[str, ...]) -> int:
    """See StopMatcher.holdback."""
    return stop_matcher(tuple(stops)).holdback(text) if stops else 0
