"""`DPEngine`: what the HTTP routes drive in a `--dp-size` server, in place of the one-engine
`AsyncEngine` (the same methods: `submit`, `abort`, `health_problem`, `degraded`, `fail_all`,
`pool_snapshot`, `render_metrics`, `start`, `shutdown`, and `engine`, what a request's `prepare`
reads).

A request is prepared here, in the HTTP process (`prepare(Frontend)`: tokenize, render the chat
template, validate, build its SamplingParams), then dispatched whole (token ids + params) to the
replica the policy picks (`policy.py`); a replica that dies before admitting it, or whose queue is
full (--max-queued-requests holds per replica), passes it to the next; 503 with Retry-After when
every one is full. An unseeded sampled request gets its seed here, from the --random-seed stream in arrival
order, as one engine draws it: so a seeded server samples the same whatever the --dp-size.

Health: 503 until every replica has started (warmed up, or died trying); then 200 while at least
one replica serves, with a "degraded" body naming the others (`degraded`); 503 when none does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import threading
import time
import weakref

from ddtree.server.async_engine import SHUTTING_DOWN, EngineUnavailable, Stream
from ddtree.server.dp import messages as m
from ddtree.server.dp.client import ReplicaBusy, ReplicaClient, ReplicaGone
from ddtree.server.dp.policy import make_policy

CALL_TIMEOUT_S = 10.0  # /get_server_info and /metrics wait this long for a replica's answer
STOP_TIMEOUT_S = 40.0  # a replica's engine thread joins within 30 s (AsyncEngine.shutdown)


class Frontend:
    """What the request path reads of an engine in a --dp-size server's HTTP process (the
    replicas hold the engines): the tokenizer and the context length for `prepare`, and the
    grammar compiler the routes validate a structured-output request with before it is
    dispatched (built as `LLMEngine.grammars` is, from the replicas' vocabulary and EOS ids; the
    replica compiles it again, off its engine thread, before admitting it)."""

    def __init__(self, tokenizer, max_context: int, vocab_size: int, eos_ids: tuple[int, ...]):
        self.tokenizer, self.max_context = tokenizer, max_context
        self.vocab_size, self.eos_ids = vocab_size, tuple(eos_ids)
        self._grammars = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self):
        """`ddtree.grammar.Grammars` for this tokenizer (GrammarUnavailable without the grammar
        engine, ValueError without a tokenizer), as `LLMEngine.grammars`."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("grammars need a tokenizer; this model directory has none")
                from ddtree.grammar import Grammars

                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._grammars

    def grammar_cached(self, spec) -> bool:
        """spec's grammar is compiled already (False before any grammar was)."""
        with self._grammars_lock:
            grammars = self._grammars
        return grammars is not None and grammars.cached(spec)

    def shutdown(self) -> None:
        """Nothing here: `DPEngine.shutdown` stops the replicas."""


class DPEngine:
    def __init__(self, args, clients: list[ReplicaClient], frontend: Frontend, metrics=None):
        self.args, self.clients, self.engine, self.metrics = args, clients, frontend, metrics
        self.policy = make_policy(args.load_balance_method, len(clients), clients[0].page_size)
        for c in clients:
            c.on_finish = self._on_finish
            c.keep_ids = self.policy.wants_outputs
            self.policy.set_capacity(c.rank, c.info["kv_pages_total"])
        self._owner: dict[str, ReplicaClient] = {}
        self._forgotten: set[int] = set()
        self._rids = itertools.count()
        self._seeds = random.Random(args.random_seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._started = False  # every replica warmed up (or died) once
        self._stopped = False
        weakref.finalize(self, _kill, list(clients))  # an exit without shutdown leaves none behind

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for c in self.clients:
            c.loop = self._loop

    def release(self) -> None:
        """Nothing here: each replica's engine is released where it runs."""

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop every replica and wait for it (after the drain: nothing is in flight)."""
        if self._stopped:
            return
        self._stopped = self._closing = True
        for c in self.clients:
            c.stop()
        for c in self.clients:
            c.join(timeout)

    def fail_all(self, message: str = SHUTTING_DOWN) -> None:
        """End every in-flight request with 503 and admit no new one; safe from a signal handler
        (the pipes are written from the event loop, whose send it may have interrupted)."""
        self._closing = True

        def send():
            for c in self.clients:
                c.send((m.FAIL_ALL, message))

        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(send)
        else:
            send()

    # ---- health ----------------------------------------------------------------------------------
    def health_problem(self) -> str | None:
        if self._closing:
            return SHUTTING_DOWN
        problems = [c.problem() for c in self.clients]
        down = [p for p in problems if p is not None]
        if not self._started:
            if any(p is not None and c.failure is None for p, c in zip(problems, self.clients)):
                return "; ".join(down)  # still starting or warming up
            self._started = True
        return "; ".join(down) if len(down) == len(self.clients) else None

    def degraded(self) -> str | None:
        down = [p for p in (c.problem() for c in self.clients) if p is not None]
        if not down:
            return None
        serving = len(self.clients) - len(down)
        return f"{serving} of {len(self.clients)} replicas serving; " + "; ".join(down)

    # ---- requests --------------------------------------------------------------------------------
    async def submit(self, prepare, arrival: float | None = None) -> Stream:
        arrival = arrival or time.monotonic()
        if self._closing:
            raise EngineUnavailable(SHUTTING_DOWN)
        ids, params = prepare(self.engine)
        if not params.greedy and params.seed is None:
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        tried: set[int] = set()
        busy: ReplicaBusy | None = None
        while True:
            self._forget_dead()
            loads = {
                c.rank: c.load for c in self.clients if c.rank not in tried and c.problem() is None
            }
            if not loads and busy is not None:  # every serving replica's queue is full
                raise EngineUnavailable(f"every replica is at capacity: {busy}", retry_after=1)
            if not loads:
                raise EngineUnavailable(self.health_problem() or "no replica is serving")
            client = self.clients[self.policy.pick(ids, loads)]
            st = Stream(f"req-{next(self._rids)}", len(ids), asyncio.Queue(), self._loop)
            try:
                await client.add(st, ids, params, arrival)
            except ReplicaBusy as e:
                tried.add(client.rank)
                busy = e
                continue
            except ReplicaGone:
                tried.add(client.rank)
                continue
            self._owner[st.rid] = client
            if self.metrics is not None:
                self.metrics.dispatched.labels(str(client.rank)).inc()
            return st

    def abort(self, rid: str) -> None:
        client = self._owner.pop(rid, None)
        if client is not None:
            client.abort(rid)

    def _on_finish(self, client: ReplicaClient, rid: str, ids: list[int] | None) -> None:
        self._owner.pop(rid, None)
        if ids is not None and client.failure is None:
            self.policy.on_finish(client.rank, ids)

    def _forget_dead(self) -> None:
        for c in self.clients:
            if c.failure is not None and c.rank not in self._forgotten:
                self._forgotten.add(c.rank)
                self.policy.forget(c.rank)

    # ---- what the routes read --------------------------------------------------------------------
    async def pool_snapshot(self) -> dict:
        """/get_server_info: the replicas' pool numbers summed (those that answered), and each
        replica's own under "replicas" (its state, GPUs, requests dispatched and in flight)."""
        answers = await asyncio.gather(*(c.call(m.INFO, CALL_TIMEOUT_S) for c in self.clients))
        per, got = [], []
        for c, info in zip(self.clients, answers):
            entry = {
                "dp_rank": c.rank,
                "pid": c.proc.pid,
                "gpus": c.gpus,  # indices among this process's visible GPUs
                "device": c.info["device"] if c.info else None,  # as the replica names it
                "problem": c.problem(),
                "dispatched": c.dispatched,
                "in_flight": c.load,
            }
            if info is not None:
                got.append((c.rank, info))
                entry |= info
            per.append(entry)
        return merge_snapshots(got) | {
            "dp_size": len(self.clients),
            "replicas_serving": sum(c.problem() is None for c in self.clients),
            "replicas": per,
        }

    async def render_metrics(self) -> bytes:
        texts = await asyncio.gather(*(c.call(m.METRICS, CALL_TIMEOUT_S) for c in self.clients))
        for c in self.clients:
            self.metrics.in_flight.labels(str(c.rank)).set(c.load)
            self.metrics.up.labels(str(c.rank)).set(float(c.problem() is None))
        return self.metrics.render(
            {c.rank: t for c, t in zip(self.clients, texts) if t is not None}
        )


def merge_snapshots(snaps: list[tuple[int, dict]]) -> dict:
    """Per-replica pool snapshots as one: counts summed; a value the replicas share once; one
    they differ on (kv_integrity when one fails, engine_dead) as "replica i: value" for each
    replica whose value is not "ok" / None."""
    if not snaps:
        return {}
    out = {}
    for key, first in snaps[0][1].items():
        values = [s.get(key) for _, s in snaps]
        if key != "page_size" and all(type(v) is int for v in values):
            out[key] = sum(values)
        elif all(v == first for v in values):
            out[key] = first
        else:
            bad = [(r, s.get(key)) for r, s in snaps if s.get(key) not in ("ok", None)]
            out[key] = "; ".join(f"replica {r}: {v}" for r, v in bad)
    return out


def _kill(clients: list[ReplicaClient]) -> None:
    for c in clients:
        if c.proc.exitcode is None:
            c.closing = True
            c.proc.kill()
