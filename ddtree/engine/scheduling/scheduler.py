"""Continuous batching: requests join and leave the running set every step. A step is either a
prefill batch (new prompts and chunks of long ones, at most `prefill_budget` tokens) or one decoding
round of every running request. A newly arrived request that can be admitted is prefilled before the
next decoding round (SGLang's prefill-first order: its time to first token is the step it waits for
plus its own prefill, not a decoding round more), at most `MAX_PREFILL_STREAK` prefill steps in a
row. The rest of a long prompt alternates with decoding rounds, so a long prompt prefills one chunk
per step and the running requests decode in between: their time per output token grows by one
chunk, not by the whole prompt. When KV pages run out, unreferenced cached pages are evicted
first (least recently used), then the newest running request is preempted (its KV freed, its full
pages left in the prefix cache) and recomputed later. A request is admitted with its cached prefix
attached (`ModelRunner.match_prefix` / `admit`) and prefills from there."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.scheduling.request import Req, ReqStatus

# prefill steps in a row (new arrivals) before the running requests decode again: a burst of
# arrivals delays a decoding round by at most this many prefills
MAX_PREFILL_STREAK = 4


@dataclass
class Batch:
    is_prefill: bool
    reqs: list[Req]
    q_lens: list[int]


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        max_running: int,
        chunk_tokens: int,
        verify_width: int,
        max_prefill_tokens: int | None = None,
    ):
        self.runner, self.bm = runner, runner.bm
        self.max_running, self.verify_width = max_running, verify_width
        # tokens of one prefill batch: --chunked-prefill-size (<= 0: no chunking) capped by
        # --max-prefill-tokens; a prompt longer than the budget is prefilled in budget-sized chunks
        # either way
        caps = [c for c in (chunk_tokens, max_prefill_tokens) if c is not None and c > 0]
        if not caps:
            raise ValueError(
                "a prefill budget needs --chunked-prefill-size > 0 or --max-prefill-tokens"
            )
        self.prefill_budget = min(caps)
        # hybrid + prefix cache: a prompt's prefill stops once at its last page boundary, where the
        # runner checkpoints the recurrent state (0: no alignment)
        self.align = runner.checkpoint_align
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_preemptions = 0
        self.last_cached_tokens = 0  # prefix-cache hits admitted by the last prefill batch
        self.last_was_prefill = False
        self.prefill_streak = 0  # prefill steps since the last decoding round

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> Batch | None:
        # NOTE: the order only decides which step runs first; tokens are the same either way
        # (lossless tests)
        admissible = self._head_admissible()
        # a new arrival goes before the decoding round (its first token is one prefill away);
        # the next chunk of a prompt already running waits for it (the alternation)
        new_first = admissible and self.prefill_streak < MAX_PREFILL_STREAK
        decode_turn = (
            self.last_was_prefill
            and not new_first
            and any(not r.needs_prefill for r in self.running)
        )
        if decode_turn:
            batch = self._schedule_decode() or self._schedule_prefill(admissible)
        else:
            batch = self._schedule_prefill(admissible) or self._schedule_decode()
        self.last_was_prefill = batch is not None and batch.is_prefill
        self.prefill_streak = self.prefill_streak + 1 if self.last_was_prefill else 0
        return batch

    def _head_admissible(self) -> bool:
        """The head of the queue can be admitted now (a slot, and its pages beside its cached
        prefix)."""
        head = self.waiting[0] if self.waiting else None
        return (
            head is not None
            and len(self.running) < self.max_running
            and self.bm.can_admit(
                head, head.prefill_len + self.verify_width, self.runner.match_prefix(head)
            )
        )

    def _schedule_prefill(self, admissible: bool) -> Batch | None:
        budget = self.prefill_budget
        # while requests wait, unfinished chunked prefills take at most half the budget: a short
        # prompt that arrives behind a long one is admitted at the next prefill step, not after the
        # whole prompt
        share = budget // 2 if admissible else budget
        self.last_cached_tokens = 0
        reqs, q_lens = [], []
        suspect = next((r for r in self.running if r.needs_prefill and r.suspect), None)
        if suspect is not None:  # fault isolation: a suspect's chunk runs alone
            return Batch(True, [suspect], [self._chunk(suspect, budget)])
        for r in self.running:  # unfinished chunked prefills first
            if r.needs_prefill and share > 0:
                q = self._chunk(r, share)
                reqs.append(r)
                q_lens.append(q)
                budget -= q
                share -= q
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            r = self.waiting[0]
            if r.suspect and reqs:
                break  # a suspect is prefilled alone, in a step of its own
            hit = self.runner.match_prefix(r)
            # admit only when the whole prompt plus one verify width fits, so admission never
            # thrashes
            if not self.bm.can_admit(r, r.prefill_len + self.verify_width, hit):
                break
            self.waiting.popleft()
            self.runner.admit(r, hit)  # kv_len = the cached prefix
            self.last_cached_tokens += r.kv_len
            q = self._chunk(r, budget)
            # the whole prompt's pages now, not the first chunk's: admission counted them as
            # available, and requests admitted after this one must not take its later chunks'
            self.bm.allocate(r, r.prefill_len)
            r.status = ReqStatus.RUNNING
            r.times.scheduled = r.times.scheduled or time.monotonic()
            self.running.append(r)
            reqs.append(r)
            q_lens.append(q)
            budget -= q
            if r.suspect:
                break
        return Batch(True, reqs, q_lens) if reqs else None

    def _chunk(self, r: Req, budget: int) -> int:
        q = min(budget, r.prefill_len - r.kv_len)
        if self.align:
            edge = r.prefill_len // self.align * self.align
            if r.kv_len < edge < r.kv_len + q:
                q = edge - r.kv_len
        return q

    def _schedule_decode(self) -> Batch | None:
        ready = [r for r in self.running if not r.needs_prefill]
        suspect = next((r for r in ready if r.suspect), None)
        if suspect is not None:  # fault isolation: a suspect decodes alone, one at a time
            ready = [suspect]
        while ready:
            need = sum(self.bm.extra_pages(r, r.kv_len + self.verify_width) for r in ready)
            if need <= self.bm.num_available_pages:
                break
            victim = ready.pop()  # newest running request
            self.preempt(victim)
        return Batch(False, ready, [self.verify_width] * len(ready)) if ready else None

    def preempt(self, req: Req) -> None:
        self._requeue(req)
        self.num_preemptions += 1

    def _requeue(self, req: Req) -> None:
        self.running.remove(req)
        self.runner.release(req)  # frees the pages and sets kv_len to 0
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Req) -> None:
        """The request leaves for good (its pages and slot are freed even when caching its prefix
        raises: `BlockManager.free`)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED
        self.runner.release(req)

    def roll_back(self, reqs: list[Req]) -> None:
        """A batched step failed with `reqs` in it (all running): each is requeued at the head
        with its KV, recurrent state and slot freed (recomputed from its tokens when admitted
        again) and runs alone until a round of its own succeeds (engine/faults.py)."""
        for r in reversed(reqs):  # each goes to the queue's head: keep their order
            r.suspect = True
            if r in self.running:
                self._requeue(r)
