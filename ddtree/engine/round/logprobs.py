"""Log-probabilities of emitted tokens under the target, for the requests that ask for them.

Every emitted token was drawn at one node of the verified tree: an accepted draft at its parent, the
bonus at the deepest accepted node, so token j of a round comes from node `path[j]` (AR and prefill:
node 0). Its log-prob is the log-softmax of the target's raw logits at that node: before
temperature, top-k and top-p, as vLLM reports by default (`raw_logprobs`). The rows are gathered,
normalised and top-k'd on the device for the asking requests only, and come back in the round's
single device->host copy with the emitted tokens.

Invariant: `req.logprobs[i]` belongs to `req.output_ids[i]`. A round appends one entry per token it
returns; the emitter may drop a finished round's tail, and the engine trims those entries when the
request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs; OpenAI's chat limit


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-prob), most likely first
    rank: int | None = None  # prompt tokens: 1 + the tokens more likely (vLLM's rank)


def node_logprobs(
    reqs, logits: torch.Tensor, nodes: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor | None:
    """logits [b, n, V] (any float dtype), nodes [b, m] the node each emitted token was drawn at,
    tokens [b, m] the emitted tokens (-1 = none). Returns float64 [b', m, 1 + 2k] for the b'
    requests that asked, in batch order: the token's log-prob, the top-k log-probs, the top-k ids
    (k = the largest top_logprobs asked); None when no request asked (then nothing runs)."""
    rows = [i for i, r in enumerate(reqs) if r.params.logprobs]
    if not rows:
        return None
    idx = torch.tensor(rows, device=logits.device)
    nodes, tokens = nodes.index_select(0, idx), tokens.index_select(0, idx)
    picked = logits.index_select(0, idx).gather(
        1, nodes[..., None].expand(-1, -1, logits.shape[-1])
    )
    lp = torch.log_softmax(picked.float(), dim=-1)
    parts = [lp.gather(-1, tokens.clamp(min=0)[..., None])]
    k = max(reqs[i].params.top_logprobs for i in rows)
    if k:
        top = lp.topk(k, dim=-1)
        parts += [top.values, top.indices.to(torch.float64)]  # ids < 2**53 are exact in float64
    return torch.cat([p.to(torch.float64) for p in parts], dim=-1)


def read_back(reqs, out: torch.Tensor, lp: torch.Tensor | None) -> tuple[list[list[int]], list]:
    """One device->host copy of the round's int64 `out` [b, w] and its log-probs (float64, exact for
    token ids). Returns (out as host rows, per request its log-prob rows or None)."""
    host, lp_rows = read_back_tensor(reqs, out, lp)
    return host.tolist(), lp_rows


def read_back_tensor(reqs, out: torch.Tensor, lp: torch.Tensor | None) -> tuple[torch.Tensor, list]:
    """`read_back` with `out` as a host int64 tensor (the caller lists only the columns it walks
    in Python)."""
    if lp is None:
        return out.cpu(), [None] * len(reqs)
    flat = torch.cat([out.flatten().to(torch.float64), lp.flatten()]).cpu()
    host = flat[: out.numel()].view(out.shape).to(torch.int64)
    lp_rows = iter(flat[out.numel() :].view(lp.shape).tolist())
    return host, [next(lp_rows) if r.params.logprobs else None for r in reqs]


def append(req, rows: list | None, tokens: list[int]) -> None:
    """Record the log-probs of `tokens` (this round's, in order) from their read-back rows."""
    if rows is None:
        return
    k = req.params.top_logprobs
    kmax = (len(rows[0]) - 1) // 2 if rows else 0
    for tok, row in zip(tokens, rows):
        top = tuple((int(row[1 + kmax + j]), row[1 + j]) for j in range(k))
        req.logprobs.append(TokenLogprob(tok, row[0], top))


def trim(req) -> None:
    """Drop the entries of tokens the emitter cut off (a stop or the length limit mid-round)."""
    del req.logprobs[req.num_output_tokens :]
