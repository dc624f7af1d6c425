"""SGLang-style engine log lines (logger "ddtree", INFO): one per prefill batch, and one every
`--decode-log-interval` decode steps with the running batch, the KV in use, the mean accept length
and the generation throughput since the previous decode line (over the time the engine was busy:
its steps, prefill and decode, and the server's loop around them; idle waits for requests are not
counted), and the queue:

    Prefill batch. #new-seq: 2, #new-token: 37, #cached-token: 0, token usage: 0.01,
        #running-req: 1, #queue-req: 0
    Decode batch. #running-req: 3, #token: 412, token usage: 0.05, accept len: 3.42,
        gen throughput (token/s): 97.31, #queue-req: 0, budget: 15.2, predicted accept: 3.61,
        round: 8.12 ms, host: 0.41 ms, server: 0.10 ms

(each on one line). `accept len` counts the tokens the rounds emitted (accepted drafts + bonus) per
request per round; 1.00 for plain AR. Since the previous decode line: `budget` is the mean DDTree
budget per request-round (the chain's 15 for DFLASH at block 16, 0 for AR), `predicted accept` the
budget policy's mean prediction of the same accept len (`-` without `auto`), and per round:
`round` the decoder round's wall time (its launches and the wait for the device), `host` the
engine step's time outside it (scheduling, emission, detokenisation, stop checks), `server` the
server loop's time outside the step (publishing / streaming, commands, metrics; 0 offline).

`#cached-token` counts the prompt tokens the prefix cache served to the batch's new requests;
`token usage` is the fraction of KV pages in use.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("ddtree")

DEFAULT_DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval


class BatchLog:
    def __init__(self, scheduler, interval: int = DEFAULT_DECODE_LOG_INTERVAL):
        if interval < 1:
            raise ValueError(f"--decode-log-interval must be at least 1, got {interval}")
        self.scheduler, self.interval = scheduler, interval
        self.steps = self.tokens = self.req_rounds = 0
        self.busy_s = 0.0  # engine steps (prefill and decode) and their server time since the line
        self._reset_round_stats()

    def _reset_round_stats(self) -> None:
        self.budget_sum = self.pred_sum = 0.0
        self.pred_n = self.timed = 0
        self.round_s = self.host_s = self.server_s = 0.0

    def server_time(self, seconds: float) -> None:
        """The server loop's time outside the latest decode step (added to its round)."""
        self.server_s += seconds
        self.busy_s += seconds

    def _usage(self) -> float:
        bm = self.scheduler.bm
        return 1.0 - bm.num_available_pages / bm.num_pages if bm.num_pages else 0.0

    def prefill(self, q_lens: list[int], step_s: float = 0.0) -> None:
        """After one prefill batch (its chunks' lengths, the step's seconds); #running-req: the
        requests outside it."""
        self.busy_s += step_s
        if not logger.isEnabledFor(logging.INFO):
            return
        s = self.scheduler
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(q_lens),
            sum(q_lens),
            s.last_cached_tokens,
            self._usage(),
            len(s.running) - len(q_lens),
            len(s.waiting),
        )

    def decode(self, emitted: list[list[int]], rec=None) -> None:
        """After one decode step: `emitted` holds each request's tokens of the round; rec its
        RoundRecord (budgets, predictions, timings) when known."""
        self.steps += 1
        self.tokens += sum(len(t) for t in emitted)
        self.req_rounds += len(emitted)
        if rec is not None:
            self.budget_sum += sum(rec.budgets)
            self.pred_sum += sum(rec.predicted) + len(rec.predicted)
            self.pred_n += len(rec.predicted)
            self.round_s += rec.timing.round_s
            self.host_s += rec.timing.host_s
            self.busy_s += rec.timing.round_s + rec.timing.host_s
            self.timed += 1
        if self.steps % self.interval:
            return
        s = self.scheduler
        n, rounds = max(self.req_rounds, 1), max(self.timed, 1)
        pred = f"{self.pred_sum / self.pred_n:.2f}" if self.pred_n else "-"
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, accept len: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d, budget: %.1f, predicted accept: %s, "
            "round: %.2f ms, host: %.2f ms, server: %.2f ms",
            len(s.running),
            sum(r.kv_len for r in s.running),
            self._usage(),
            self.tokens / n,
            self.tokens / self.busy_s if self.busy_s > 0 else 0.0,
            len(s.waiting),
            self.budget_sum / n,
            pred,
            1e3 * self.round_s / rounds,
            1e3 * self.host_s / rounds,
            1e3 * self.server_s / rounds,
        )
        self.tokens = self.req_rounds = 0
        self.busy_s = 0.0
        self._reset_round_stats()
