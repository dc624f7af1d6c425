"""Emitted-token log-probs rendered for the APIs: OpenAI completions (legacy `tokens` /
`token_logprobs` / `top_logprobs` / `text_offset`), OpenAI chat (`content: [{token, logprob, bytes,
top_logprobs}]`) and SGLang's native `output_token_logprobs` / `output_top_logprobs` (`[logprob,
token_id, text or None]`). Prompt log-probs (`decode_prompt_entries`) go through the same
entries and functions: an echoed completion's `logprobs` (null at the first position), vLLM's
`prompt_logprobs` and SGLang's `input_token_logprobs` / `input_top_logprobs`.

Token strings come from decoding each id alone (`token_id:<id>` without a tokenizer): emitted
tokens' on the engine thread, a prompt's on a tokenizer thread (openai_serving.py); a token's
`bytes` are its own (`TokenBytes`), so a token holding part of a UTF-8 character reports that part,
not the U+FFFD its decoded string shows. -inf is reported as -9999.0 (OpenAI's floor): JSON has no
infinity.
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import re
from dataclasses import dataclass

from ddtree.engine.round.logprobs import TokenLogprob

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class LogprobEntry:
    token: str
    token_id: int
    logprob: float | None  # None: a prompt's first reported position (nothing predicts it)
    # (token, id, log-prob, bytes), likeliest first; None at a prompt's first position
    top: tuple[tuple[str, int, float, bytes], ...] | None
    bytes: bytes = b""  # the token's own bytes (TokenBytes)
    special: bool = False  # a special token (not in the text with skip_special_tokens)
    rank: int | None = None  # prompt tokens: vLLM's rank


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Qwen's tokenizers too): the printable character that stands
    for each byte in a token's string."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


BYTE_LEVEL = _byte_level_alphabet()
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class TokenBytes:
    """A token id's own bytes, from the tokenizer's vocabulary rather than decode(): byte-level BPE
    strings map back through the GPT-2 alphabet, SentencePiece byte-fallback tokens are their byte
    (`▁` a space); other tokenizers (and added tokens) give the UTF-8 of the decoded string.
    Cached per id (at most the vocabulary); engine thread only."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, bytes] = {}
        # the decoder's own JSON (the whole tokenizer's would be megabytes, on the engine thread)
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        spec = decoder.__getstate__().decode() if decoder is not None else ""
        self.byte_level = '"ByteLevel"' in spec
        self.byte_fallback = '"ByteFallback"' in spec
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {i: t.content for i, t in added.items()}
        self.special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def __call__(self, i: int) -> bytes:
        b = self.cache.get(i)
        if b is None:
            b = self.cache[i] = self._bytes(i)
        return b

    def _bytes(self, i: int) -> bytes:
        if self.tok is None:
            return f"token_id:{i}".encode()
        if i in self.added:
            return self.added[i].encode()
        piece = self.tok.convert_ids_to_tokens(i)
        if isinstance(piece, str):
            if self.byte_level and all(c in BYTE_LEVEL for c in piece):
                return bytes(BYTE_LEVEL[c] for c in piece)
            if self.byte_fallback:
                m = BYTE_FALLBACK.fullmatch(piece)
                if m:
                    return bytes([int(m.group(1), 16)])
                return piece.replace("\u2581", " ").encode()
        return self.tok.decode([i]).encode("utf-8", errors="replace")


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def decode_entries(
    tokenizer, lps: list[TokenLogprob], token_bytes: TokenBytes
) -> list[LogprobEntry]:

    def text(i: int) -> str:
        return f"token_id:{i}" if tokenizer is None else tokenizer.decode([i])

    return [
        LogprobEntry(
            text(e.token_id),
            e.token_id,
            _finite(e.logprob),
            tuple((text(i), i, _finite(v), token_bytes(i)) for i, v in e.top),
            token_bytes(e.token_id),
            e.token_id in token_bytes.special,
            e.rank,
        )
        for e in lps
    ]


def decode_prompt_entries(tokenizer, plp, token_bytes: TokenBytes) -> list[LogprobEntry]:
    """A request's prompt log-probs (`engine.prompt_logprobs.PromptLogprobs`) as entries: the
    first position without a log-prob or top list (nothing predicts it), then one per token."""
    lps = plp.entries()
    first = decode_entries(tokenizer, [TokenLogprob(plp.tokens[0], 0.0)], token_bytes)[0]
    return [
        dataclasses.replace(first, logprob=None, top=None),
        *decode_entries(tokenizer, lps[1:], token_bytes),
    ]


def top_k(entries: list[LogprobEntry], k: int) -> list[LogprobEntry]:
    """Each entry's top list cut to k (a request that asked two ks computed the larger)."""
    return [e if e.top is None else dataclasses.replace(e, top=e.top[:k]) for e in entries]


class TextOffsets:
    """`text_offset`s of a choice's tokens, chunk after chunk: the characters of the returned text
    before each token. The tokens' own bytes go through an incremental UTF-8 decoder (invalid bytes
    one U+FFFD each, as the detokenizer's text has them), so a token that ends inside a character
    does not count it: that token and the one completing the character both get the offset of the
    character, as vLLM's incrementally decoded tokens ("" then "é") give. A special token adds
    nothing where skip_special_tokens keeps it out of the text."""

    def __init__(self, skip_special_tokens: bool = True):
        self.skip_special = skip_special_tokens
        self.chars = 0
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, entries: list[LogprobEntry]) -> list[int]:
        out = []
        for e in entries:
            out.append(self.chars)
            if not (e.special and self.skip_special):
                self.chars += len(self.utf8.decode(e.bytes))
        return out


def completion_logprobs(entries: list[LogprobEntry], offsets: TextOffsets) -> dict:
    """The legacy completions object; `text_offset` from offsets (which has counted the choice's
    earlier chunks). Each position's `top_logprobs` holds the top-k and the emitted token, like
    vLLM."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.top is None else {t[0]: t[2] for t in e.top} | {e.token: e.logprob}
            for e in entries
        ],
        "text_offset": offsets.take(entries),
    }


def _chat_token(token: str, logprob: float, raw: bytes) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(entries: list[LogprobEntry]) -> dict:
    return {
        "content": [
            _chat_token(e.token, e.logprob, e.bytes)
            | {"top_logprobs": [_chat_token(t, v, b) for t, _, v, b in e.top]}
            for e in entries
        ]
    }


def native_logprobs(entries: list[LogprobEntry], with_text: bool) -> dict:
    def item(token: str, i: int, v: float) -> list:
        return [v, i, token if with_text else None]

    return {
        "output_token_logprobs": [item(e.token, e.token_id, e.logprob) for e in entries],
        "output_top_logprobs": [[item(*t[:3]) for t in e.top] for e in entries],
    }


def vllm_prompt_logprobs(entries: list[LogprobEntry]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob,
    rank, decoded_token}} holding the prompt token (its own rank) and the top-k (ranks 1..k)."""
    out: list[dict | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        pos = {
            str(i): {"logprob": v, "rank": r + 1, "decoded_token": t}
            for r, (t, i, v, _) in enumerate(e.top)
        }
        pos[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}
        out.append(pos)
    return out


def native_prompt_logprobs(entries: list[LogprobEntry], with_text: bool) -> dict:
    """SGLang's `input_token_logprobs` ([log-prob or None, id, text or None] per position from
    logprob_start_len) and `input_top_logprobs` (None first, then the top-k lists)."""

    def item(token: str, i: int, v: float | None) -> list:
        return [v, i, token if with_text else None]

    return {
        "input_token_logprobs": [item(e.token, e.token_id, e.logprob) for e in entries],
        "input_top_logprobs": [
            None if e.top is None else [item(*t[:3]) for t in e.top] for e in entries
        ],
    }
