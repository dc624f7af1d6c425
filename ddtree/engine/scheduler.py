"""Continuous batching: requests join and leave the running set every step. Prefill (chunked) goes first;
otherwise every running request takes one decoding round. When KV pages run out, the newest running
request is preempted (its KV freed) and recomputed later."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.request import Req, ReqStatus


@dataclass
class Batch:
    is_prefill: bool
    reqs: list[Req]
    q_lens: list[int]


class Scheduler:
    def __init__(self, runner: ModelRunner, max_running: int, chunk_tokens: int, verify_width: int):
        self.runner, self.bm = runner, runner.bm
        self.max_running, self.chunk_tokens, self.verify_width = max_running, chunk_tokens, verify_width
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_preemptions = 0

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> Batch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> Batch | None:
        budget = self.chunk_tokens
        reqs, q_lens = [], []
        for r in self.running:  # unfinished chunked prefills first
            if r.needs_prefill and budget > 0:
                q = min(budget, r.prefill_len - r.kv_len)
                reqs.append(r)
                q_lens.append(q)
                budget -= q
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            r = self.waiting[0]
            q = min(budget, r.prefill_len)
            # admit only when the whole prompt plus one verify width fits, so admission never thrashes
            if not self.bm.can_allocate(r, r.prefill_len + self.verify_width):
                break
            self.waiting.popleft()
            self.bm.allocate(r, q)
            r.status = ReqStatus.RUNNING
            self.running.append(r)
            reqs.append(r)
            q_lens.append(q)
            budget -= q
        return Batch(True, reqs, q_lens) if reqs else None

    def _schedule_decode(self) -> Batch | None:
        ready = [r for r in self.running if not r.needs_prefill]
        while ready:
            need = sum(self.bm.extra_pages(r, r.kv_len + self.verify_width) for r in ready)
            if need <= self.bm.num_free_pages:
                break
            victim = ready.pop()  # newest running request
            self.preempt(victim)
        return Batch(False, ready, [self.verify_width] * len(ready)) if ready else None

    def preempt(self, req: Req) -> None:
        self.running.remove(req)
        self.runner.release(req)
        req.kv_len = 0
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.runner.release(req)
        req.status = ReqStatus.FINISHED
