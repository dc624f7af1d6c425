"""Incremental detokenization and stop-string matching, one token at a time so a stop string that
completes inside an accepted block cuts the output exactly there."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Emits text as tokens arrive; holds back bytes of an unfinished UTF-8 character (U+FFFD)."""

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

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


def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> int:
    """Index in `text` where the earliest stop string begins, considering only matches that overlap the last
    `new_len` characters; -1 if none."""
    best = -1
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best
