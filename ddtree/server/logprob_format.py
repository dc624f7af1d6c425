"""Emitted-token log-probs rendered for the APIs: OpenAI completions (legacy `tokens` /
`token_logprobs` / `top_logprobs` / `text_offset`), OpenAI chat (`content: [{token, logprob, bytes,
top_logprobs}]`) and SGLang's native `output_token_logprobs` / `output_top_logprobs` (`[logprob,
token_id, text or None]`). Prompt log-probs (`decode_prompt_entries`) go through the same
entries and functions: an echoed completion's `logprobs` (null at the first position), vLLM's
`prompt_logprobs` and SGLang's `input_token_logprobs` / `input_top_logprobs`.

Token strings come from decoding each id alone (`token_id:<id>` without a tokenizer): emitted
tokens' on the engine thread, a prompt's on a tokenizer thread (openai_serving.py). -inf is
reported as -9999.0 (OpenAI's floor): JSON has no infinity.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ddtree.engine.logprobs import TokenLogprob

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class LogprobEntry:
    token: str
    token_id: int
    logprob: float | None  # None: a prompt's first reported position (nothing predicts it)
    top: tuple[tuple[str, int, float], ...] | None  # (token, id, log-prob), most likely first
    rank: int | None = None  # prompt tokens: vLLM's rank


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
            e.rank,
        )
        for e in lps
    ]


def decode_prompt_entries(tokenizer, plp) -> list[LogprobEntry]:
    """A request's prompt log-probs (`engine.prompt_logprobs.PromptLogprobs`) as entries: the
    first position without a log-prob or top list (nothing predicts it), then one per token."""
    lps = plp.entries()
    first = decode_entries(tokenizer, [TokenLogprob(plp.tokens[0], 0.0)])[0]
    return [dataclasses.replace(first, logprob=None, top=None), *decode_entries(tokenizer, lps[1:])]


def top_k(entries: list[LogprobEntry], k: int) -> list[LogprobEntry]:
    """Each entry's top list cut to k (a request that asked two ks computed the larger)."""
    return [e if e.top is None else dataclasses.replace(e, top=e.top[:k]) for e in entries]


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
        "top_logprobs": [
            None if e.top is None else {t: v for t, _, v in e.top} | {e.token: e.logprob}
            for e in entries
        ],
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
            for r, (t, i, v) in enumerate(e.top)
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
            None if e.top is None else [item(*t) for t in e.top] for e in entries
        ],
    }
