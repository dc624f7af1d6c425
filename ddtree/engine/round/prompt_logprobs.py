"""Prompt log-probs (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`, SGLang's input
log-probs): the target's log-softmax over the prompt, taken from the prefill's own hidden states.

Row p of a prefill (the final-normed hidden state after prompt token p) predicts token p + 1, so a
request that asks from prompt position s needs rows s .. n-2 (n = prompt length): entry s has no
log-prob (nothing predicts it; OpenAI, vLLM and SGLang report null there) and row n-1 predicts the
first output token, whose log-prob is the emitted token's (`logprobs.py`). The rows are the exact
fp32 log-softmax of the target's logits, before temperature / top-k / top-p, as for emitted tokens;
prefill is the same in every decoding mode, so the numbers are the no-speculation server's.

Cost: only asking requests pay, and only for their own rows. Each prefill chunk computes its rows'
logits in slices of at most ROW_ELEMENTS logits, keeps the prompt token's log-prob, its rank and
the top-k, and drops the rest: no [prompt_len, vocab] tensor ever exists, across chunks or within
one. A batch with rows to compute runs the eager prefill (the extend graphs return the last row's
logits only). The kept rows stay on the device until the request's last row is done, then come to
the host in one copy.

Prefix cache: a row exists only where a forward runs over its position, so a request that still
needs row r takes no cached prefix longer than r tokens (`ModelRunner.match_prefix`) and recomputes
the pages past it. That is exact and simple; caching per-token log-probs beside the pages would
have to keep, per page, the top-k of the largest k any later request may ask, and the prompt token's
rank. The pages such a request prefills enter the cache as any others do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddtree.engine.round.logprobs import TokenLogprob

# logits held at once while a chunk's rows are reduced (fp32: 64 MiB, and as much for the
# log-softmax); a slice is at least one row
ROW_ELEMENTS = 1 << 24


@dataclass
class PromptLogprobs:
    """One request's prompt log-probs: rows start .. end-1 (end = prompt length - 1), each
    [log-prob, rank, top-k log-probs, top-k ids] in float64 (ids < 2**53 are exact)."""

    start: int
    top: int
    end: int
    tokens: list[int]  # the prompt's tokens from `start` on (what each row predicts, and the first)
    rows: int = 0  # rows computed so far (start .. start + rows - 1)
    chunks: list[torch.Tensor] = field(default_factory=list)  # device, until `done`
    host: torch.Tensor | None = None  # [end - start, 2 + 2 * top] once done

    @classmethod
    def of(cls, params, prompt_ids: list[int]) -> PromptLogprobs | None:
        if params.prompt_logprobs is None:
            return None
        start, n = params.prompt_logprobs_start, len(prompt_ids)
        if not 0 <= start < n:
            raise ValueError(f"prompt_logprobs_start {start} is outside the prompt's {n} tokens")
        plp = cls(start, params.prompt_logprobs, n - 1, list(prompt_ids[start:]))
        if plp.next_row >= plp.end:  # from the last position: nothing to compute (SGLang's default)
            plp._finish()
        return plp

    @property
    def next_row(self) -> int:
        """The first row still to compute (a cached prefix may not reach past it)."""
        return self.start + self.rows

    @property
    def done(self) -> bool:
        return self.host is not None

    def entries(self) -> list[TokenLogprob | None]:
        """Per prompt position start .. n-1: None first, then the prompt token's log-prob, its
        rank and the top-k (host only; any thread)."""
        assert self.host is not None, "prompt log-probs read before the prompt was prefilled"
        k, out = self.top, [None]
        for j, row in enumerate(self.host.tolist()):
            top = tuple((int(row[2 + k + i]), row[2 + i]) for i in range(k))
            out.append(TokenLogprob(self.tokens[1 + j], row[0], top, int(row[1])))
        return out

    def _finish(self) -> None:
        width = 2 + 2 * self.top
        rows = torch.cat(self.chunks) if self.chunks else torch.zeros(0, width, dtype=torch.float64)
        self.host, self.chunks = rows.cpu(), []


def row_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, logits_of, k: int, vocab: int
) -> torch.Tensor:
    """hidden [r, H] rows, targets [r] the tokens they predict -> float64 [r, 2 + 2k]: the
    target's log-prob, its rank (vLLM's: the tokens at least as likely, itself included), top-k
    log-probs, top-k ids. `logits_of(hidden) -> [r, V]` (the target's LM head); fp32 throughout,
    ROW_ELEMENTS logits at a time."""
    step = max(1, ROW_ELEMENTS // vocab)
    out = []
    for i in range(0, hidden.shape[0], step):
        lp = torch.log_softmax(logits_of(hidden[i : i + step]).float(), dim=-1)
        tok = lp.gather(1, targets[i : i + step, None])
        parts = [tok, (lp >= tok).sum(-1, keepdim=True)]
        if k:
            top = lp.topk(k, dim=-1)
            parts += [top.values, top.indices]
        out.append(torch.cat([p.to(torch.float64) for p in parts], dim=-1))
    return torch.cat(out)


def compute(reqs, q_lens: list[int], hidden: torch.Tensor, logits_of, vocab: int) -> None:
    """After a prefill chunk's forward (before kv_len moves): each asking request's rows in it.
    hidden [sum(q_lens), H] holds request i's q_lens[i] positions from its kv_len on."""
    offset = 0
    for r, q in zip(reqs, q_lens):
        plp = r.prompt_logprobs
        if plp is not None and not plp.done:
            lo, hi = plp.next_row, min(r.kv_len + q, plp.end)
            if r.kv_len > lo:  # the cache or a chunk skipped rows it needs: never silently
                raise RuntimeError(
                    f"request {r.rid}: prompt log-prob row {lo} was not computed "
                    f"(its prefill starts at {r.kv_len})"
                )
            if hi > lo:
                rows = hidden[offset + lo - r.kv_len : offset + hi - r.kv_len]
                targets = torch.tensor(r.prompt_ids[lo + 1 : hi + 1], device=hidden.device)
                plp.chunks.append(row_logprobs(rows, targets, logits_of, plp.top, vocab))
                plp.rows += hi - lo
            if plp.next_row >= plp.end:
                plp._finish()
        offset += q


def wants_rows(reqs, q_lens: list[int]) -> bool:
    """Some request has prompt log-prob rows in this chunk (its batch runs eagerly)."""
    return any(
        r.prompt_logprobs is not None
        and not r.prompt_logprobs.done
        and r.kv_len + q > r.prompt_logprobs.next_row
        for r, q in zip(reqs, q_lens)
    )
