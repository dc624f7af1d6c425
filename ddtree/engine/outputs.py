"""Appending a round's tokens to a request: EOS, stop tokens, stop strings and max_tokens are checked token
by token, so a stop that falls inside an accepted block cuts the output exactly there."""

from __future__ import annotations

from dataclasses import dataclass, field

from ddtree.engine.detokenizer import IncrementalDetokenizer, find_stop
from ddtree.engine.logprobs import TokenLogprob
from ddtree.engine.request import Req


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
        )


class TokenEmitter:
    def __init__(self, tokenizer, eos_ids: tuple[int, ...], max_context: int):
        self.tokenizer, self.eos_ids, self.max_context = tokenizer, eos_ids, max_context
        self.detok: dict[str, IncrementalDetokenizer] = {}

    def start(self, req: Req) -> None:
        if self.tokenizer is not None:
            self.detok[req.rid] = IncrementalDetokenizer(self.tokenizer, req.prompt_ids)

    def emit(self, req: Req, tokens: list[int]) -> None:
        """Append tokens until one finishes the request; the rest of the round's tokens are dropped."""
        p = req.params
        detok = self.detok.get(req.rid)
        for tok in tokens:
            req.output_ids.append(tok)
            if detok is not None:
                new = detok.append(tok)
                req.text += new
                if p.stop and new:
                    cut = find_stop(req.text, len(new), p.stop)
                    if cut >= 0:
                        req.stop_hit = req.text[cut:]
                        req.text = req.text[:cut]
                        self._finish(req, "stop")
                        return
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self._finish(req, "stop")
                return
            if req.num_output_tokens >= p.max_tokens or req.seq_len >= self.max_context:
                self._finish(req, "length")
                return

    def _finish(self, req: Req, reason: str) -> None:
        req.finish_reason = reason
        self.detok.pop(req.rid, None)
