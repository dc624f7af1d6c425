"""The engine: load models, then `step()` = schedule -> prefill or one speculative round -> emit tokens."""

from __future__ import annotations

import logging
import random
import threading
import time
import weakref

from ddtree.engine import integrity
from ddtree.engine.boundary import (
    EngineStats,
    FaultCounts,
    PrefixCacheStats,
    StepFailure,
    StepResult,
)
from ddtree.engine.config import prefill_chunk_tokens
from ddtree.engine.faults import EngineDead, FaultIsolation, describe
from ddtree.engine.outputs.emitter import TokenEmitter
from ddtree.engine.round import logprobs
from ddtree.engine.round.decoder import SpecDecoder
from ddtree.engine.round.grammar_jobs import MaskBudget
from ddtree.engine.round.prompt_logprobs import PromptLogprobs
from ddtree.engine.scheduling.batch_log import BatchLog
from ddtree.engine.scheduling.request import Req, SamplingParams
from ddtree.engine.scheduling.scheduler import Scheduler
from ddtree.engine.setup import build_runner, load_tokenizer, resolve_device
from ddtree.engine.tp.launch import rank_device, start_ranks
from ddtree.models.configs import ConfigError

logger = logging.getLogger("ddtree")


class LLMEngine:
    def __init__(self, args, tp_rank=None):
        """`--tp-size` N > 1: this process becomes rank 0 and starts ranks 1..N-1, each an
        LLMEngine built with its `tp_rank` (`ddtree.engine.tp`)."""
        if args.dp_size > 1 or args.dp_replica_process:  # every other flag acts here
            raise ConfigError(
                [
                    f"--dp-size {args.dp_size} / --dp-replica-process: an LLMEngine is one "
                    "replica; `ddtree serve --dp-size N` runs N of them behind one server "
                    "(offline: one LLM per process)"
                ]
            )
        self.args = args
        self.device = resolve_device(args.device)
        self.tp = tp_rank
        if self.tp is None and args.tp_size > 1:
            self.tp = start_ranks(args, self.device, type(self))
            weakref.finalize(self, self.tp.close)
        if self.tp is not None:
            self.device = rank_device(self.device, self.tp.rank)
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        try:
            self.runner, self.max_context = build_runner(args, self.device, self.tp)
        except BaseException:
            if self.tp is not None and tp_rank is None:
                self.tp.close()  # not ready yet: ends the ranks it started, no collective
            raise
        self.spec = args.spec  # derived once by resolve_server_args; it sized the pools and widths
        self.decoder = SpecDecoder(self.runner, self.spec)
        if self.tp is not None:  # the ranks must agree on every tree: no clock decides one
            self.decoder.mask_workers.budget = MaskBudget.lockstep()
        cfg = self.runner.cfg
        self.scheduler = Scheduler(
            self.runner,
            cfg.max_running_requests,
            prefill_chunk_tokens(args),
            cfg.max_verify_width,
            args.max_prefill_tokens,
        )
        self.runner.step_stats.set_budget(self.scheduler.prefill_budget)
        self.batch_log = BatchLog(self.scheduler, args.decode_log_interval)
        eos = set(self.runner.target.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.emitter = TokenEmitter(self.tokenizer, tuple(sorted(eos)), self.max_context)
        self._seeds = random.Random(args.random_seed)
        self._grammars = None  # the grammar compiler and its cache, built on first use
        self._grammars_lock = threading.Lock()
        self.requests: dict[str, Req] = {}
        self.last_round = None  # RoundRecord of the latest decode step (None after a prefill)
        self.faults = FaultIsolation(tensor_parallel=self.tp is not None)
        self._streaming = False  # stream_text: every live request's text is kept up to date
        self._under_round = None  # stream_text's host work, run inside the next round
        if self.tp is not None:
            self.tp.started()  # every rank built its engine

    # ---- requests ---------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this model directory has no tokenizer; pass prompts as token-id lists"
                )
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return [int(t) for t in prompt]

    @property
    def grammars(self):
        """The tokenizer's grammar compiler and cache (`ddtree.grammar.Grammars`); raises
        GrammarUnavailable when the grammar engine cannot be imported, ValueError without a
        tokenizer."""
        with self._grammars_lock:  # the server's compile threads may build it first
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("grammars need a tokenizer; this model directory has none")
                from ddtree.grammar import Grammars

                vocab = self.runner.target.config.vocab_size
                self._grammars = Grammars(self.tokenizer, vocab, self.emitter.eos_ids)
            return self._grammars

    def grammar_cached(self, spec) -> bool:
        """spec's grammar is compiled already (False before any grammar was)."""
        with self._grammars_lock:
            grammars = self._grammars
        return grammars is not None and grammars.cached(spec)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        rid: str | None = None,
        arrival: float | None = None,
    ) -> Req:
        """arrival: when the request reached the server (`time.monotonic()`; default now), the
        start of its `ReqTimes`."""
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_context:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context length is {self.max_context}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        bm, width = self.runner.bm, self.scheduler.verify_width
        if bm.pages_for(len(ids) + width) > min(bm.num_pages, bm.max_pages_per_req):
            raise ValueError(
                f"prompt has {len(ids)} tokens; with a round's {width} tree rows it needs more "
                f"KV cache than the server has ({min(bm.num_pages, bm.max_pages_per_req)} pages "
                f"of {bm.page_size} tokens a request)"
            )
        req = Req(prompt_ids=ids, params=params, **({"rid": rid} if rid else {}))
        req.prompt_logprobs = PromptLogprobs.of(params, ids)
        if params.grammar is not None:  # compiled once per spec (the server compiles ahead)
            req.grammar = self.grammars.matcher(params.grammar)
        if not params.greedy:  # unseeded requests still sample at random: a seed of their own
            req.seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        self.emitter.start(req)
        req.times.queued = time.monotonic()
        req.times.arrival = arrival or req.times.queued
        if self.tp is not None:
            self.tp.publish(("add", ids, params, req.rid))
        self.requests[req.rid] = req
        self.scheduler.add(req)
        return req

    def abort(self, rid: str) -> None:
        if self.tp is not None:
            self.tp.publish(("abort", rid))
        req = self.requests.pop(rid, None)
        self.emitter.drop(rid)
        if req is not None and not req.is_finished:
            req.finish_reason = "abort"
            self.scheduler.finish(req)

    def set_budget_policy(self, policy, cost=None) -> None:
        """Serve `--speculative-ddtree-budget auto` rounds with `policy` (an
        `engine.budget.Policy`: a bench's forced rungs, a test's script), or keep the policy and
        pin its round costs to `cost` (not corrected by served rounds)."""
        if policy is not None:
            self.decoder.budgets.set_policy(policy)
        if cost is not None:
            self.decoder.budgets.set_cost(cost, served=False)

    def stream_text(self, under_round=None) -> None:
        """The caller publishes the requests' text after every step (the server): deferred
        detokenisation (engine/outputs/emitter.py) is flushed for every live request at the step's end,
        or, with `under_round`, inside the next decoding round once its device work is launched
        and before its one read-back, followed by `under_round()` (the server publishing the
        previous round's outputs), so both hide under the device's work. Offline callers never
        call this: their text is detokenised once, at the finish."""
        self._streaming, self._under_round = True, under_round
        self.decoder.while_device_runs = self._host_work if under_round is not None else None

    def _host_work(self) -> None:
        self._flush_text()
        self._under_round()

    def _flush_text(self) -> None:
        """Every live request's deferred tokens into its text."""
        for rid in list(self.emitter.lag):
            req = self.requests.get(rid)
            if req is not None:
                self.emitter.flush(req)

    def _text_after(self, res: StepResult) -> None:
        """A streaming step's end: its text now, unless a round follows that flushes it under
        its device work (the same test the server makes before it waits to publish).
        Detokenising is the step's host work too."""
        t0 = time.perf_counter()
        deferred = self._under_round is not None and res.round is not None
        if self._streaming and not (deferred and self.has_unfinished()):
            self._flush_text()
        if res.round is not None:
            res.round.timing.host_s += time.perf_counter() - t0

    def round_costs(self) -> dict[int, dict[str, float]]:
        """The budget policy's start-up round seconds per batch bucket and rung ({} unless auto)."""
        return self.decoder.budgets.round_costs()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop ---------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One scheduling step: schedule -> run (a prefill or one decoding round) -> postprocess
        (emit, stop checks, finishes). Returns the requests that advanced (finished ones included)
        and, for a decode step, its `RoundRecord` (also kept in `last_round`). A failure fails
        only the requests it can be pinned on (`engine/faults.py`); one that cannot be isolated
        raises EngineDead, and every later step raises it again."""
        t0 = time.perf_counter()
        batch = self._schedule()
        emitted = None if batch is None else self._run(batch)
        if emitted is None:  # nothing ran, or it failed and was isolated
            res = StepResult(() if batch is None else tuple(batch.reqs))
        else:
            res = self._postprocess(batch, emitted, t0)
        self._text_after(res)
        return res

    def _schedule(self):
        """The step's batch (None: nothing to run, or scheduling failed and was isolated)."""
        if self.faults.dead is not None:
            raise EngineDead(self.faults.dead)
        if self.tp is not None:  # every rank runs this step on rank 0's inputs
            self.tp.sync(self)
        t0 = time.perf_counter()
        self.last_round = None
        try:
            batch = self.scheduler.schedule()
        except Exception as e:  # noqa: BLE001 - isolated below
            self._schedule_failed(e)
            return None
        self.runner.step_stats.schedule_s += time.perf_counter() - t0
        if batch is None:
            self._starved()
        return batch

    def _run(self, batch) -> dict[Req, list[int]] | None:
        """The batch's forward: each request's emitted tokens (None: it failed, and the failure
        was isolated)."""
        try:
            if batch.is_prefill:
                return self._prefill(batch)
            self.runner.step_stats.on_decode(len(batch.reqs))
            t1 = time.perf_counter()
            emitted = self.decoder.round(batch.reqs, self.max_context)
            self.decoder.budgets.last.timing.round_s = time.perf_counter() - t1
            return dict(zip(batch.reqs, emitted))
        except Exception as e:  # noqa: BLE001 - isolated here
            self._batch_failed(batch, e)
            return None

    def _postprocess(self, batch, emitted: dict[Req, list[int]], t0: float) -> StepResult:
        """Emit each request's tokens (detokenise, stop checks), finish the finished ones, and log
        the step."""
        self.faults.succeeded()
        for r, toks in emitted.items():
            try:
                if not batch.is_prefill:
                    r.stats.rounds += 1
                    r.stats.accept_lengths.append(len(toks))
                    r.suspect = False  # a round of its own succeeded (a suspect decodes alone)
                self.emitter.emit(r, toks)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                self._fail_request(r, e)
        for r in batch.reqs:
            if r.grammar_end is not None and r.finish_reason is None:
                self.emitter.finish(r, r.grammar_end)  # the grammar ended it
            if r.finish_reason is not None and not r.is_finished:
                try:
                    logprobs.trim(r)
                    self._finish(r)
                except Exception as e:  # noqa: BLE001 - this request's own failure
                    self._fail_request(r, e)
        if batch.is_prefill:
            self.batch_log.prefill(batch.q_lens, time.perf_counter() - t0)
            self.decoder.clock.forget()  # the next round's idle time would hold this step
            return StepResult(tuple(batch.reqs))
        rec = self.last_round = self.decoder.budgets.last
        # the step's host time (scheduling, emission, stop checks); detokenising adds to it
        rec.timing.host_s = time.perf_counter() - t0 - rec.timing.round_s
        self.batch_log.decode(list(emitted.values()), rec)
        return StepResult(tuple(batch.reqs), rec)

    def _prefill(self, batch) -> dict[Req, list[int]]:
        """The prefill forward; the first token of each request whose prompt is now complete."""
        logits = self.runner.prefill(batch.reqs, batch.q_lens)
        _stamp_chunks(batch.reqs)
        ready = [i for i, r in enumerate(batch.reqs) if not r.needs_prefill and not r.output_ids]
        for i in ready:  # max_tokens 0: the prompt was all it asked for (its prompt log-probs)
            if batch.reqs[i].params.max_tokens == 0:
                self.emitter.finish(batch.reqs[i], "length")
        ready = [i for i in ready if batch.reqs[i].finish_reason is None]
        if not ready:
            return {}
        reqs = [batch.reqs[i] for i in ready]
        host = self.decoder.first_tokens(reqs, logits[ready])
        now = time.monotonic()
        for r in reqs:
            r.times.first_token = r.times.first_token or now
        return dict(zip(reqs, host))

    def _finish(self, req: Req) -> None:
        self.scheduler.finish(req)
        self.requests.pop(req.rid, None)

    # ---- failures (engine/faults.py) --------------------------------------------------------------
    def _fail_request(self, req: Req, exc: BaseException) -> None:
        """`req`'s own host work raised: it alone fails (finish reason abort, `req.error` set) and
        everything it held is released; the pools are checked."""
        if self.faults.raise_errors:
            raise exc
        logger.exception("request %s failed; the others go on", req.rid)
        self.faults.stats.isolated += 1
        req.error = req.error or f"internal engine error: {describe(exc)}"
        req.finish_reason = "abort"
        self.emitter.drop(req.rid)
        logprobs.trim(req)  # the round's entries past the tokens it kept (one per token)
        if not req.is_finished:
            try:
                self._finish(req)
            except Exception:  # noqa: BLE001 - its slot and pages are freed all the same
                logger.exception("releasing failed request %s raised", req.rid)
        self.requests.pop(req.rid, None)
        self.check_pools()

    def _batch_failed(self, batch, exc: BaseException) -> None:
        """A batched step raised: a batch of one names its culprit; a larger one is rolled back
        and its requests run alone until the culprit fails alone."""
        self.last_round = None
        reqs = list(batch.reqs)
        self.faults.stats.batch_failures += 1
        self.faults.failed(exc, [r.rid for r in reqs])  # EngineDead if it cannot be isolated
        if len(reqs) == 1:
            self._fail_request(reqs[0], exc)
            return
        logger.warning(
            "a %s step of %d requests failed (%s); rolling them back to run alone",
            "prefill" if batch.is_prefill else "decode",
            len(reqs),
            describe(exc),
        )
        self.faults.stats.rolled_back += len(reqs)
        for r in reqs:  # the tokens a request keeps are those it emitted before this step
            logprobs.trim(r)
        self.scheduler.roll_back(reqs)
        self.check_pools()

    def _schedule_failed(self, exc: BaseException) -> None:
        """Scheduling raised: the queue's head is the likely culprit (admission looks at it)."""
        head = self.scheduler.waiting[0] if self.scheduler.waiting else None
        self.faults.failed(exc, [head.rid] if head is not None else [])
        if head is None:
            raise EngineDead(f"scheduling failed with no request to blame: {describe(exc)}")
        self._fail_request(head, exc)

    def check_pools(self) -> None:
        """Pool integrity after a failure (O(pages)): the KV pages, the prefix cache's ref
        counts, the request slots. A failure makes the engine dead (EngineDead)."""
        try:
            self.runner.bm.check_integrity()
            self.runner.bm.check_slots(self.scheduler.running)
        except AssertionError as e:
            self.faults.checked(False, str(e))
        else:
            self.faults.checked(True)

    def _starved(self) -> None:
        """Nothing could be scheduled although requests wait and none runs: the head request can
        never fit (admission refuses a prompt larger than the pool; a preempted request's
        output can outgrow it). It ends with what it has: 'length' after some output, an error
        before any (never an empty 'length')."""
        if self.scheduler.waiting and not self.scheduler.running:
            req = self.scheduler.waiting[0]
            logger.warning("request %s does not fit in the KV cache; finishing it", req.rid)
            self.emitter.flush(req)
            self.emitter.drop(req.rid)  # its detokenizer, as a finish in `emit` forgets it
            if req.output_ids:
                req.finish_reason = "length"
            else:
                req.finish_reason = "abort"
                req.error = (
                    f"the request needs more KV cache than the server has "
                    f"({self.runner.bm.num_pages} pages of {self.runner.bm.page_size} tokens)"
                )
            self._finish(req)

    def fail_step(self, exc: Exception) -> StepFailure:
        """`step()` raised outside its own isolation (a bug in the step itself): every running
        request is failed and released (if none ran, the head of the queue, which admission
        looked at, is the likely culprit), then the pools are checked; broken pools make the
        engine dead."""
        logger.error("engine step failed; failing the running requests", exc_info=exc)
        self.last_round = None
        running = [r.rid for r in self.scheduler.running]
        victims = running or [r.rid for r in list(self.scheduler.waiting)[:1]]
        for rid in victims:
            try:
                self.abort(rid)
            except Exception:  # noqa: BLE001 - it fails all the same (the pools are checked)
                logger.exception("releasing request %s failed", rid)
        dead = None
        try:
            self.check_pools()
            self._text_after(StepResult())  # the others publish now
        except EngineDead as e:
            dead = str(e)
        return StepFailure(tuple(victims), dead)

    def stats(self) -> EngineStats:
        """Every number the server shows, between two steps (host-only, O(1))."""
        sched, runner = self.scheduler, self.runner
        bm, slots = runner.bm, runner.cfg.max_running_requests
        cache = None
        if bm.cache is not None:
            st = bm.cache.stats
            cache = PrefixCacheStats(
                st.queried_tokens,
                st.hit_tokens,
                st.evicted_pages,
                st.state_miss_tokens,
                st.checkpoint_drops,
                st.hit_rate,
            )
        fs = self.faults.stats
        has_state = runner.state_pool is not None
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_preemptions=sched.num_preemptions,
            kv_pages_total=bm.num_pages,
            kv_pages_free=bm.num_available_pages,
            kv_pages_cached=bm.num_cached_pages,
            page_size=bm.page_size,
            request_slots_total=slots,
            request_slots_free=bm.num_free_slots,
            state_pool_slots_total=slots if has_state else 0,
            state_pool_slots_free=bm.num_free_slots if has_state else 0,
            checkpoint_rows=runner.checkpoints.num_rows if runner.checkpoints is not None else 0,
            prefix_cache=cache,
            faults=FaultCounts(
                fs.isolated,
                fs.batch_failures,
                fs.integrity_checks,
                fs.last_integrity_ok,
                self.faults.dead,
            ),
            steps=runner.step_stats.as_dict(),
        )

    def integrity_problems(self) -> list[str]:
        """The whole engine's invariants between two steps (engine/integrity.py; O(pages))."""
        return integrity.problems(self)

    def note_server_time(self, seconds: float) -> None:
        """The server loop's time around the latest decode step (publishing, commands,
        metrics): into its round's timing and the decode log."""
        if self.last_round is not None:
            self.last_round.timing.server_s = seconds
        self.batch_log.server_time(seconds)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.emitter.eos_ids

    @property
    def vocab_size(self) -> int:
        return self.runner.target.config.vocab_size

    def tp_problem(self) -> str | None:
        """Why tensor parallelism cannot go on (a rank died), or None."""
        return None if self.tp is None else self.tp.problem()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (also run when the engine is collected)."""
        if self.tp is not None:
            self.tp.close()

    def release(self) -> None:
        """After the last step: the runner's pools and graphs go (ModelRunner.free_pools)."""
        self.runner.free_pools()

    def generate(self, prompts, params, use_tqdm: bool = False) -> list[Req]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        t0 = time.perf_counter()
        while any(not r.is_finished for r in reqs):
            advanced = self.step().reqs
            if bar is not None:
                bar.update(sum(1 for r in advanced if r.is_finished))
                done = sum(r.num_output_tokens for r in reqs)
                bar.set_postfix(tok_s=f"{done / max(time.perf_counter() - t0, 1e-9):.1f}")
        if bar is not None:
            bar.close()
        return reqs


def _stamp_chunks(reqs: list[Req]) -> None:
    """A prefill chunk of each request ended (its prompt's chunks; a preempted request's recompute
    is not its time to first token)."""
    now = time.monotonic()
    for r in reqs:
        if not r.output_ids:
            r.times.prefill_chunks.append(now)
