"""The synchronous engine (`EngineProtocol`: `LLMEngine`) driven from one background thread, fed by
asyncio handlers.

Invariant: only the engine thread calls the engine (requests, steps, stats; the engine's pools and
its detokenizers stay behind it). Handlers hand it closures through a command queue (`call`,
`submit`, `abort`); between two steps the thread runs every queued command, so requests join and
leave the running batch at every step. After each step it publishes, per request, the text that
can no longer be taken back by a stop string into that request's asyncio queue. The tokenizer
is not the engine thread's alone: it detokenises outputs and renders log-probs there, while the
HTTP side's tokenizer threads (openai_serving.py `prepare`) encode prompts and render chat
templates concurrently (encoding only reads the tokenizer, fixed after start-up); a prompt that
reaches `add_request` as text is encoded on the engine thread.

Host time hidden (`overlap`, on by default): after a decode step with rounds to come, the loop
does not publish at once; the next round publishes while its device work runs (the engine's
`stream_text` hook, run by the decoder between its launches and its one read-back, which
detokenises first), so streaming costs the round nothing; a final output waits for the next
round's launches (with auto, also its draft), not its verify (or, when the next step is a
prefill, for that step). A prefill step, a step that leaves the engine idle and a failed step
publish at once. The engine thread alone touches the requests either way, and stops / max_tokens
/ aborts are decided in the step exactly as before.

Liveness: the loop stamps `_tick` every iteration; `health_problem()` reports a dead thread, or a
loop that has not come round for STALL_TIMEOUT_S (a step that hangs), so /health turns 503 instead
of staying green. A start-up warm-up (engine/warmup.py) runs on the engine thread before the loop;
until it ends /health answers 503 "warming up" (requests sent meanwhile wait in the queue).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ddtree.engine.boundary import EngineProtocol
from ddtree.engine.faults import EngineDead
from ddtree.engine.outputs.detokenizer import stop_holdback
from ddtree.engine.scheduling.request import Req, SamplingParams
from ddtree.server.gc_watch import GcWatch, freeze_startup_heap
from ddtree.server.logprob_format import LogprobEntry, TokenBytes, decode_entries
from ddtree.server.metrics import server_info

logger = logging.getLogger("ddtree")

IDLE_POLL_S = 0.05
# SGLang's health-check timeout; a real step takes milliseconds to a few seconds
STALL_TIMEOUT_S = 20.0
SHUTTING_DOWN = "server is shutting down"
WARMING_UP = "warming up"  # /health's 503 while the start-up warm-up runs (engine/warmup.py)


class EngineUnavailable(Exception):
    """The engine takes no new request (HTTP 503): its thread is gone, it cannot go on
    (`EngineDead`), the server is shutting down, or the queue is full (back-pressure: then
    `retry_after` seconds go out as the Retry-After header)."""

    def __init__(self, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Delta:
    """What one request gained since its previous Delta; the last one has finish_reason or error set."""

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    # with error: 500 for an engine fault, 503 when the server is shutting down
    error_status: int = 500
    error_code: str = "engine_error"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    completion_tokens: int = 0
    # the request's decoding rounds so far and its mean tokens per round (every Delta: running)
    rounds: int = 0
    mean_accept_length: float = 0.0
    token_ids: list[int] = field(default_factory=list)  # tokens emitted since the previous Delta
    logprobs: list[LogprobEntry] = field(default_factory=list)  # theirs, when the request asked
    matched: str | int | None = None  # what stopped it: the stop string, or the EOS / stop token id
    # the final Delta: the request's time to first token by phase (`ReqTimes.breakdown`, seconds)
    timing: dict | None = None
    # SamplingParams.prompt_logprobs: the request's first Delta once its prompt is prefilled
    # (`engine.prompt_logprobs.PromptLogprobs`, host-side; rendered on a tokenizer thread)
    prompt_logprobs: object | None = None


@dataclass
class Stream:
    rid: str
    prompt_tokens: int
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    req: Req | None = field(default=None, repr=False)  # engine thread only
    added: float = 0.0
    sent_chars: int = 0
    held_for: int = -1  # len(req.text) when the stop holdback was last computed
    seen_tokens: int = 0
    seen_rounds: int = 0
    seen_accepted: int = 0  # tokens of the first seen_rounds rounds (a running sum)
    sent_prompt_logprobs: bool = False

    def put(self, delta: Delta) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)
        except RuntimeError:  # the handler's loop is closed: nobody is listening any more
            pass


class Outbox:
    """One publish's deltas, handed to each handler event loop in one `call_soon_threadsafe`.
    Each such call writes the loop's self-pipe, a syscall that releases the GIL to the event-loop
    thread, and the engine thread then waits for it back until that thread blocks again or the
    switch interval (5 ms) runs out: one call per stream per round put the engine thread behind
    the HTTP side once per stream (issue 20), so there is one call per publish, at its end; after a
    decode step with rounds to come the whole publish waits under the next round's device work
    (this hand-off was most of a publish: docs/design-numbers.md)."""

    def __init__(self):
        self.pending: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Delta]]] = {}
        self.calls = 0  # call_soon_threadsafe calls made (tests)

    def put(self, st: Stream, delta: Delta) -> None:
        self.pending.setdefault(st.loop, []).append((st.queue, delta))

    def send(self) -> None:
        pending, self.pending = self.pending, {}
        for loop, items in pending.items():
            self.calls += 1
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the handlers' loop is closed: nobody is listening any more
                pass


def _deliver(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)


class AsyncEngine:
    def __init__(
        self,
        engine: EngineProtocol,
        metrics=None,
        warmup: Callable[[], object] | None = None,
        overlap: bool = True,
        gc_freeze: bool = False,
        max_queued: int | None = None,
    ):
        self.engine, self.metrics = engine, metrics
        self.max_queued = max_queued  # waiting requests past which a new one gets a 503
        # after the warm-up: full collections walk only what serving allocates (gc_watch.py)
        self.gc_freeze = gc_freeze
        self.gc_watch = GcWatch()
        # run on the engine thread before the loop; /health says "warming up" (503) until it ends
        self._warmup = warmup
        self._warming = warmup is not None
        self.overlap = overlap
        self._unpublished = False  # outputs of the latest decode step wait for the next round
        self._hidden_s = 0.0  # publishing time spent inside the latest round
        engine.stream_text(self._publish_under_round if overlap else None)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._outbox = Outbox()  # engine thread: a publish's deltas, sent once per loop
        self._bytes_of: TokenBytes | None = None  # engine thread: log-probs' token bytes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False  # set by fail_all: no new request is admitted
        self._dead: str | None = None  # the engine cannot go on (EngineDead): why
        self._tick = time.monotonic()
        self.stall_timeout_s = STALL_TIMEOUT_S

    # ---- handler side (event loop) ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ddtree-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self.gc_watch.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def release(self) -> None:
        """After `shutdown`: the engine's memory back (LLMEngine.release)."""
        if self._thread is None:
            self.engine.release()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health_problem(self) -> str | None:
        """Why the engine cannot serve (for /health), or None."""
        tp_problem = self.engine.tp_problem()  # a dead tensor-parallel rank
        if tp_problem is not None:
            return tp_problem
        if self._dead is not None:
            return f"the engine cannot go on: {self._dead}"
        if not self.alive:
            return "the engine is not running"
        if self._warming:
            return WARMING_UP
        stalled = time.monotonic() - self._tick
        if stalled > self.stall_timeout_s:
            return f"the engine loop has not completed a step for {stalled:.0f} s"
        if self._closing:
            return SHUTTING_DOWN
        return None

    def fail_all(self, message: str = SHUTTING_DOWN) -> None:
        """End every in-flight request with an error (503) and admit no new one; safe from a signal
        handler (SimpleQueue.put is reentrant). The engine thread frees their pages before its next
        step."""
        self._closing = True
        self._cmds.put((lambda: self._fail_all(message), None))

    async def call(self, fn: Callable[[], object]):
        """Run fn() on the engine thread between two steps; its result or exception comes back here."""
        if not self.alive:
            raise EngineUnavailable("the engine is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        return await asyncio.wrap_future(fut)

    async def submit(
        self,
        prepare: Callable[[object], tuple[list[int], SamplingParams]],
        arrival: float | None = None,
        rid: str | None = None,
        sink=None,
    ) -> Stream:
        """prepare(engine) -> (prompt ids, params) runs on the engine thread (it may tokenize and raise);
        the request is then added and its Stream returned. arrival: the handler's `time.monotonic()`
        when the request came in (default: now), where its time to first token starts. rid: the
        request's id (default: the engine's); sink: where its Deltas go, anything with
        `put_nowait` (called on this event loop; default: a new asyncio.Queue; a --dp-size
        replica's forwards them to the HTTP process)."""
        loop = asyncio.get_running_loop()
        arrival = arrival or time.monotonic()
        q = asyncio.Queue() if sink is None else sink

        def add() -> Stream:
            if self._closing:
                raise EngineUnavailable(SHUTTING_DOWN)
            if self._dead is not None:
                raise EngineUnavailable(f"the engine cannot go on: {self._dead}")
            waiting = self.engine.num_waiting
            if self.max_queued is not None and waiting >= self.max_queued:
                raise EngineUnavailable(
                    f"the server is at capacity: {waiting} requests wait for a slot "
                    f"(--max-queued-requests {self.max_queued}); retry later",
                    retry_after=1,
                )
            ids, params = prepare(self.engine)
            req = self.engine.add_request(ids, params, rid=rid, arrival=arrival)
            st = Stream(req.rid, req.num_prompt_tokens, q, loop, req, time.monotonic())
            self._streams[req.rid] = st
            if self.metrics is not None:
                self.metrics.on_admit(req.num_prompt_tokens)
            return st

        return await self.call(add)

    def abort(self, rid: str) -> None:
        """Cancel a request (client gone); its KV pages and slot are freed before the next step."""
        self._cmds.put((lambda: self._abort(rid), None))

    async def pool_snapshot(self) -> dict:
        """/get_server_info's pool numbers, read between two engine steps."""
        return await self.call(lambda: server_info(self.engine))

    async def render_metrics(self) -> bytes:
        """/metrics' body (the server was built with metrics)."""
        return self.metrics.render()

    def degraded(self) -> str | None:
        """What serves at reduced capacity while /health stays 200: nothing, for one engine (a
        --dp-size server names its dead replicas here)."""
        return None

    # ---- engine thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        if self._warmup is not None:
            try:
                self._warmup()
            except Exception:  # noqa: BLE001 - a failed warm-up costs the first requests, no more
                logger.exception("warm-up failed; serving without it")
        if self.gc_freeze:
            freeze_startup_heap()
        self.gc_watch.start()  # after the freeze's own full collection (start-up, not serving)
        # /health serves from here: after the warm-up and the freeze
        self._tick, self._warming = time.monotonic(), False
        while not self._stop.is_set():
            t0 = self._tick = time.monotonic()
            idle = self._dead is not None or not self.engine.has_unfinished()
            if idle and self._unpublished:  # no round to come (the rest aborted): publish now
                self._publish_guarded()
            self._run_commands(block=idle)
            step_s, self._hidden_s, rec = 0.0, 0.0, None
            if self.engine.has_unfinished() and self._dead is None:
                t1 = time.monotonic()
                try:
                    rec = self.engine.step().round  # isolates what it can (engine/faults.py)
                except EngineDead as e:
                    self._on_dead(str(e))
                except Exception as e:  # noqa: BLE001 - the loop must survive; the batch is failed instead
                    self._fail_running(e)
                step_s = time.monotonic() - t1
            # after a decode step with rounds to come, finished requests included, publishing
            # and the hand-off wait under the next round's device work (`Outbox`: the hand-off
            # may cost the engine thread a switch interval; publishing every stream at once sat
            # on the critical path where most steps finish a request: BENCHMARKS.md, host time)
            if self.overlap and rec is not None and self.engine.has_unfinished():
                self._unpublished = True
            else:
                self._publish_guarded()
            pauses = self.gc_watch.drain()  # every step: without metrics it would only grow
            if self.metrics is not None:
                self.metrics.on_stats(self.engine.stats())
                for generation, seconds in pauses:
                    self.metrics.on_gc_pause(generation, seconds)
            if rec is not None:
                server_s = time.monotonic() - t0 - step_s
                self.engine.note_server_time(server_s)
                if self.metrics is not None:
                    self.metrics.on_round(rec, server_s, self._hidden_s)
            if step_s and self.metrics is not None:
                self.metrics.on_busy(time.monotonic() - t0)
        self._run_commands(block=False)
        self._fail_all(SHUTTING_DOWN)

    def _publish_under_round(self) -> None:
        """The decoder's hook: the previous decode step's outputs, published while this round's
        device work runs."""
        if self._unpublished:
            t0 = time.monotonic()
            self._publish_guarded()
            self._hidden_s += time.monotonic() - t0

    def _publish_guarded(self) -> None:
        """Publish every stream's new output and hand it to the event loop."""
        self._unpublished = False
        try:
            self._publish()
            self._outbox.send()
        except Exception as e:  # noqa: BLE001 - a publishing bug fails the requests, not the server
            self._outbox.send()  # what was published goes out before the failures below
            logger.exception("publishing outputs failed; failing every request")
            for rid in list(self._streams):
                self._fail(rid, f"internal server error: {type(e).__name__}: {e}")

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._cmds.get(timeout=IDLE_POLL_S) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            if fut is None:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - a failed abort must not stop the loop
                    logger.exception("engine command failed")
            elif fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed back to the awaiting handler
                    fut.set_exception(e)
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _publish(self) -> None:
        for rid, st in list(self._streams.items()):
            try:
                self._publish_one(rid, st)
            except Exception as e:  # noqa: BLE001 - a publishing bug fails its request alone
                logger.exception("publishing request %s failed", rid)
                self._fail(rid, f"internal server error: {type(e).__name__}: {e}")

    def _publish_one(self, rid: str, st: Stream) -> None:
        req = st.req
        if req.error is not None:  # the engine failed it alone (engine/faults.py)
            self._streams.pop(rid, None)
            final = self._final(
                req, "", error=req.error, error_status=req.error_status, error_code=req.error_code
            )
            self._outbox.put(st, final)
            if self.metrics is not None:
                self.metrics.on_finish("error", time.monotonic() - st.added)
            return
        # req.text is up to date: the engine flushed its deferred detokenisation (`stream_text`)
        done = req.finish_reason is not None
        if done:
            safe = len(req.text)
        elif len(req.text) != st.held_for:  # new text: what may still become a stop is held
            st.held_for = len(req.text)
            safe = len(req.text) - stop_holdback(req.text, req.params.stop)
        else:
            safe = st.sent_chars
        text = req.text[st.sent_chars : safe] if safe > st.sent_chars else ""
        st.sent_chars = max(st.sent_chars, safe)
        n_tok, rounds = req.num_output_tokens, req.stats.accept_lengths
        new_ids = req.output_ids[st.seen_tokens : n_tok]
        lps = req.logprobs[st.seen_tokens : n_tok]
        lps = decode_entries(self.engine.tokenizer, lps, self._token_bytes()) if lps else []
        if st.seen_tokens == 0 and n_tok:  # the first token reaches its stream now
            req.times.published = time.monotonic()
            if self.metrics is not None:
                self.metrics.on_first_token(req.times)
        if self.metrics is not None and (n_tok > st.seen_tokens or len(rounds) > st.seen_rounds):
            self.metrics.on_progress(n_tok - st.seen_tokens, rounds[st.seen_rounds :])
        st.seen_accepted += sum(rounds[st.seen_rounds :])
        st.seen_tokens, st.seen_rounds = n_tok, len(rounds)
        plp = req.prompt_logprobs
        if st.sent_prompt_logprobs or plp is None or not plp.done or not (done or text or new_ids):
            plp = None
        st.sent_prompt_logprobs = st.sent_prompt_logprobs or plp is not None
        if done:
            self._streams.pop(rid)
            self._outbox.put(
                st, self._final(req, text, token_ids=new_ids, logprobs=lps, prompt_logprobs=plp)
            )
            if self.metrics is not None:
                self.metrics.on_finish(req.finish_reason, time.monotonic() - st.added)
        elif text or new_ids:
            mean = st.seen_accepted / st.seen_rounds if st.seen_rounds else 0.0
            self._outbox.put(
                st,
                Delta(
                    text,
                    token_ids=new_ids,
                    logprobs=lps,
                    rounds=st.seen_rounds,
                    mean_accept_length=mean,
                    prompt_logprobs=plp,
                ),
            )

    def _token_bytes(self) -> TokenBytes:
        """The tokenizer's id -> bytes table, built on the first log-prob request (engine
        thread)."""
        if self._bytes_of is None:
            self._bytes_of = TokenBytes(self.engine.tokenizer)
        return self._bytes_of

    @staticmethod
    def _final(req: Req, text: str, error: str | None = None, **extra) -> Delta:
        matched = req.stop_hit
        if matched is None and req.finish_reason == "stop" and req.output_ids:
            matched = req.output_ids[-1]
        return Delta(
            text=text,
            finish_reason=req.finish_reason,
            error=error,
            prompt_tokens=req.num_prompt_tokens,
            cached_tokens=req.cached_tokens,
            completion_tokens=req.num_output_tokens,
            rounds=req.stats.rounds,
            mean_accept_length=req.stats.mean_accept_length,
            matched=matched,
            timing=req.times.breakdown(),
            **extra,
        )

    def _release(self, rid: str) -> Stream | None:
        st = self._streams.pop(rid, None)
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001 - its stream still ends (the engine checks its pools)
            logger.exception("releasing request %s failed", rid)
        return st

    def _abort(self, rid: str) -> None:
        st = self._release(rid)
        if st is not None and self.metrics is not None:
            self.metrics.on_finish("abort", time.monotonic() - st.added)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._streams):
            self._fail(rid, message, status=503, code="server_shutting_down")

    def _fail(
        self,
        rid: str,
        message: str,
        status: int = 500,
        code: str = "engine_error",
        release: bool = True,
    ) -> None:
        st = self._release(rid) if release else self._streams.pop(rid, None)
        if st is not None:
            self._outbox.send()  # its published output first
            st.req.finish_reason = st.req.finish_reason or "abort"
            st.put(self._final(st.req, "", error=message, error_status=status, error_code=code))
            if self.metrics is not None:
                self.metrics.on_finish("error", time.monotonic() - st.added)

    def _on_dead(self, reason: str) -> None:
        """The engine cannot go on (logged once by the engine, with the request that caused it):
        /health turns 503, every in-flight request ends with a 503 and no new one is admitted."""
        self._dead = reason
        if self.metrics is not None:
            self.metrics.engine_errors.inc()
        for rid in list(self._streams):
            self._fail(rid, f"the engine cannot go on: {reason}", 503, "engine_dead")

    def _fail_running(self, exc: Exception) -> None:
        """A step raised outside the engine's own isolation (a bug in the step itself): the engine
        fails and releases the requests it blames (`fail_step`), their streams end with the
        error, and broken pools make the engine dead."""
        if self.metrics is not None:
            self.metrics.engine_errors.inc()
        failure = self.engine.fail_step(exc)
        for rid in failure.failed:  # released by the engine already
            self._fail(rid, f"internal engine error: {type(exc).__name__}: {exc}", release=False)
        if failure.dead is not None:
            self._on_dead(failure.dead)
