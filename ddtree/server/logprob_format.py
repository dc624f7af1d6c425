"""Emitted-token log-probs rendered for the APIs: OpenAI completions (legacy `tokens` /
`token_logprobs` / `top_logprobs` / `text_offset`), OpenAI chat (`content: [{token, logprob, bytes,
top_logprobs}]`) and SGLang's native `output_token_logprobs` / `output_top_logprobs` (`[logprob,
token_id, text or None]`).

Token strings come from decoding each id alone (`token_id:<id>` without a tokenizer), on the engine
thread (the only one that touches the tokenizer). -inf is reported as -9999.0 (OpenAI's floor): JSON
has no infinity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddtree.engine.logprobs import TokenLogprob

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class LogprobEntry:
    token: str
    token_id: int
    logprob: float
    top: tuple[tuple[str, int, float], ...]  # (token, id, log-prob), most likely first


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def decode_entries(tokenizer, lps: list[TokenLogprob]) -> list[LogprobEntry]:
    def text(i: int) -> str:
        return f"token_id:{i}" if tokenizer is None else tokenizer.decode([i])

    return [
        LogprobEntry(
            text(e.token_id),
            e.token_id,
            _finite(e.logprob),
            tuple((text(i), i, _finite(v)) for i, v in e.top),
        )
        for e in lps
    ]


def completion_logprobs(entries: list[LogprobEntry], offset: int) -> dict:
    """The legacy completions object; `text_offset` counts characters from `offset` (the text before
    this chunk). Each position's `top_logprobs` holds the top-k and the emitted token, like vLLM."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t: v for t, _, v in e.top} | {e.token: e.logprob} for e in entries],
        "text_offset": offsets,
    }


def _chat_token(token: str, logprob: float) -> dict:
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def chat_logprobs(entries: list[LogprobEntry]) -> dict:
    return {
        "content": [
            _chat_token(e.token, e.logprob)
            | {"top_logprobs": [_chat_token(t, v) for t, _, v in e.top]}
            for e in entries
        ]
    }


def native_logprobs(entries: list[LogprobEntry], with_text: bool) -> dict:
    def item(token: str, i: int, v: float) -> list:
        return [v, i, token if with_text else None]

    return {
        "output_token_logprobs": [item(e.token, e.token_id, e.logprob) for e in entries],
        "output_top_logprobs": [[item(*t) for t in e.top] for e in entries],
    }
