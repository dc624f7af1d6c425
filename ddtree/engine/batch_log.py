"""SGLang-style engine log lines (logger "ddtree", INFO): one per prefill batch, and one every
`--decode-log-interval` decode steps with the running batch, the KV in use, the mean accept length
and the generation throughput since the previous decode line, and the queue:

    Prefill batch. #new-seq: 2, #new-token: 37, #cached-token: 0, token usage: 0.01,
        #running-req: 1, #queue-req: 0
    Decode batch. #running-req: 3, #token: 412, token usage: 0.05, accept len: 3.42,
        gen throughput (token/s): 97.31, #queue-req: 0

(each on one line). `accept len` counts the tokens the rounds emitted (accepted drafts + bonus) per
request per round; 1.00 for plain AR.

`#cached-token` is always 0 (there is no prefix cache); `token usage` is the fraction of KV pages in
use.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("ddtree")

DEFAULT_DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval


class BatchLog:
    def __init__(self, scheduler, interval: int = DEFAULT_DECODE_LOG_INTERVAL):
        if interval < 1:
            raise ValueError(f"--decode-log-interval must be at least 1, got {interval}")
        self.scheduler, self.interval = scheduler, interval
        self.steps = self.tokens = self.req_rounds = 0
        self.since = time.perf_counter()

    def _usage(self) -> float:
        bm = self.scheduler.bm
        return 1.0 - bm.num_available_pages / bm.num_pages if bm.num_pages else 0.0

    def prefill(self, q_lens: list[int]) -> None:
        """After one prefill batch (its chunks' lengths); #running-req: the requests outside it."""
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

    def decode(self, emitted: list[list[int]]) -> None:
        """After one decode step: `emitted` holds each request's tokens of the round."""
        self.steps += 1
        self.tokens += sum(len(t) for t in emitted)
        self.req_rounds += len(emitted)
        if self.steps % self.interval:
            return
        now = time.perf_counter()
        s = self.scheduler
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, accept len: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            len(s.running),
            sum(r.kv_len for r in s.running),
            self._usage(),
            self.tokens / max(self.req_rounds, 1),
            self.tokens / max(now - self.since, 1e-9),
            len(s.waiting),
        )
        self.tokens = self.req_rounds = 0
        self.since = now
