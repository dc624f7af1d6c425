"""Appending a round's tokens to a request: EOS, stop tokens, stop strings and max_tokens are checked token
by token, so a stop that falls inside an accepted block cuts the output exactly there.

What stopped a request stays in its token ids but not in its text, as in vLLM and SGLang: a stop
string cuts the text where it begins, a stop / EOS token is not detokenised; with
`include_stop_str_in_output` (SGLang: `no_stop_trim`) the text ends after the stop string, or with
the stop token's text.

Detokenisation is deferred for requests without stop strings (their text decides nothing): `emit`
only appends the ids, and `flush` brings `req.text` up to date when something reads it (the server's
publishing, which runs under the next round's device work, or the finish). A request with stop strings
is detokenised token by token in `emit`, as the stop check needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from ddtree.engine.outputs.detokenizer import IncrementalDetokenizer, match_stop
from ddtree.engine.round.logprobs import TokenLogprob
from ddtree.engine.scheduling.request import Req


@dataclass
class RequestOutput:
    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    rounds: int
    accept_lengths: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # per token_ids entry, when SamplingParams.logprobs
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    error: str | None = None  # why serving it failed (finish_reason "abort"), engine/faults.py
    # SamplingParams.prompt_logprobs: per prompt position from prompt_logprobs_start on, None first
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @classmethod
    def of(cls, req: Req) -> "RequestOutput":
        return cls(
            req.rid,
            list(req.prompt_ids),
            list(req.output_ids),
            req.text,
            req.finish_reason,
            req.stats.rounds,
            list(req.stats.accept_lengths),
            list(req.logprobs) if req.params.logprobs else None,
            req.cached_tokens,
            req.error,
            _prompt_entries(req),
        )


def _prompt_entries(req: Req) -> list[TokenLogprob | None] | None:
    plp = req.prompt_logprobs
    return plp.entries() if plp is not None and plp.done else None


class TokenEmitter:
    def __init__(self, tokenizer, eos_ids: tuple[int, ...], max_context: int):
        self.tokenizer, self.eos_ids, self.max_context = tokenizer, eos_ids, max_context
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.lag: dict[str, int] = {}  # rid -> trailing output tokens not in req.text yet

    def start(self, req: Req) -> None:
        if self.tokenizer is not None:
            p = req.params
            self.detok[req.rid] = IncrementalDetokenizer(
                self.tokenizer,
                req.prompt_ids,
                p.skip_special_tokens,
                p.spaces_between_special_tokens,
            )

    def flush(self, req: Req) -> None:
        """Detokenise the request's deferred tokens into `req.text`."""
        n, detok = self.lag.pop(req.rid, 0), self.detok.get(req.rid)
        if n and detok is not None:
            req.text += detok.extend(req.output_ids[-n:])

    def emit(self, req: Req, tokens: list[int]) -> None:
        """Append tokens until one finishes the request; the rest of the round's tokens are dropped."""
        p = req.params
        detok = self.detok.get(req.rid)
        defer = detok is not None and not p.stop
        for tok in tokens:
            stop_token = (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids
            if stop_token and not p.include_stop_str_in_output:
                self._finish(
                    req, "stop"
                )  # the text so far (deferred: the lagging tokens before it)
                req.output_ids.append(tok)  # counted, never detokenised
                return
            req.output_ids.append(tok)
            if defer:
                self.lag[req.rid] = self.lag.get(req.rid, 0) + 1
            elif detok is not None:
                new = detok.append(tok)
                req.text += new
                if p.stop and new:
                    hit = match_stop(req.text, len(new), p.stop)
                    if hit is not None:
                        cut, req.stop_hit = hit
                        keep = cut + len(req.stop_hit) if p.include_stop_str_in_output else cut
                        req.text = req.text[:keep]
                        self._finish(req, "stop")
                        return
            if stop_token:
                self._finish(req, "stop")
                return
            if req.num_output_tokens >= p.max_tokens or req.seq_len >= self.max_context:
                self._finish(req, "length")
                return

    def finish(self, req: Req, reason: str) -> None:
        """End the request for a reason of its own (the grammar ended it)."""
        self._finish(req, reason)

    def _finish(self, req: Req, reason: str) -> None:
        self.flush(req)
        req.finish_reason = reason
        self.detok.pop(req.rid, None)

    def drop(self, rid: str) -> None:
        """Forget an aborted request's detokenizer state."""
        self.detok.pop(rid, None)
        self.lag.pop(rid, None)
