"""Requests and their sampling parameters; lengths are named properties, never recomputed ad hoc."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from ddtree.engine.round.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from ddtree.engine.round.prompt_logprobs import PromptLogprobs
from ddtree.grammar.backend import GrammarSpec, Matcher

# Temperatures below this sample as greedy (argmax): dividing fp32 logits by a smaller one overflows to inf,
# the softmax becomes NaN and every draw collapses onto token id 0. vLLM and SGLang use the same cut-off.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0 disables
    max_tokens: int = 128
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    ddtree_budget: int | None = (
        None  # per-request DDTree budget, at most the server's (its verify width)
    )
    logprobs: bool = False  # report each emitted token's target log-prob (RequestOutput.logprobs)
    top_logprobs: int = 0  # and the k most likely tokens at its position (implies logprobs)
    # the text keeps what stopped the request: the stop string (cut after it, not before) or the
    # stop / EOS token's text; by default both are left out, as in vLLM and SGLang (`no_stop_trim`)
    include_stop_str_in_output: bool = False
    # detokenisation (vLLM's and SGLang's names): special tokens are left out of the text unless
    # skip_special_tokens is False; spaces_between_special_tokens acts on tokenizers that use it
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # constrain the output to a grammar (JSON schema, regex, EBNF, choice): every emitted token,
    # drafted or not, is one the grammar allows (engine/round/grammar.py)
    grammar: GrammarSpec | None = None
    # prompt log-probs (vLLM's `prompt_logprobs`, SGLang's input log-probs): None = off, else the
    # top-k per prompt position (0: the prompt token's own only), from prompt position
    # `prompt_logprobs_start` on (SGLang's `logprob_start_len`; that first position has none)
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 0:  # 0: prefill only (prompt log-probs, SGLang's scoring)
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        stop = self.stop
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.ddtree_budget is not None and self.ddtree_budget < 1:
            raise ValueError(f"ddtree_budget must be >= 1, got {self.ddtree_budget}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}"
            )
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.prompt_logprobs}"
            )
        if self.prompt_logprobs_start < 0:
            raise ValueError(
                f"prompt_logprobs_start must be >= 0, got {self.prompt_logprobs_start}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
class SpecStats:
    rounds: int = 0
    # tokens emitted per round (accepted + bonus)
    accept_lengths: list[int] = field(default_factory=list)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


@dataclass
class ReqTimes:
    """Where a request's time to first token goes (vLLM's request stats, SGLang's time stats):
    `time.monotonic()` stamps, 0.0 = not reached. Written by whoever reaches the event: the HTTP
    handler (arrival), `LLMEngine.add_request` (queued), the scheduler (scheduled, at the first
    admission), the prefill step (each chunk, the first token) and the server's publish."""

    arrival: float = 0.0  # the request reached the server (HTTP handler) or add_request
    queued: float = 0.0  # it joined the scheduler's waiting queue (engine thread)
    scheduled: float = 0.0  # its first admission into a prefill batch
    # each prompt chunk's end on the host (on a GPU: its launches queued; the next sync waits)
    prefill_chunks: list[float] = field(default_factory=list)
    first_token: float = 0.0  # the first token sampled and read back
    published: float = 0.0  # the first token handed to the client's stream (server only)

    def breakdown(self) -> dict[str, float | int | None]:
        """Seconds per phase (None where a stamp is missing): queue = arrival -> scheduled
        (engine_wait = arrival -> queued, the part spent waiting for the running step),
        prefill = scheduled -> first token sampled, publish = sampled -> published, ttft =
        arrival -> published (or -> sampled offline)."""

        def span(a: float, b: float) -> float | None:
            return b - a if a and b else None

        end = self.published or self.first_token
        return {
            "engine_wait": span(self.arrival, self.queued),
            "queue": span(self.arrival, self.scheduled),
            "prefill": span(self.scheduled, self.first_token),
            "publish": span(self.first_token, self.published),
            "ttft": span(self.arrival, end),
            "prefill_chunks": len(self.prefill_chunks),
        }


@dataclass(eq=False)
class Req:
    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: str | None = None
    kv_len: int = 0  # tokens whose target KV (and drafter context) is cached
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    slot: int = -1  # row in the block table while running
    # the sampling key (engine/round/sampler.py): params.seed, or one drawn at admission; None if greedy
    seed: int | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    text: str = ""
    stop_hit: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, if asked
    prompt_logprobs: PromptLogprobs | None = None  # params.prompt_logprobs (add_request)
    times: ReqTimes = field(default_factory=ReqTimes)
    # why serving it failed (it finished with reason "abort"), or None (engine/faults.py)
    error: str | None = None
    error_status: int = 500  # the HTTP status of that error: 500 an engine fault, 4xx the request's
    error_code: str = "engine_error"
    # a batched step it was in failed: it runs alone until a decoding round of its own succeeds
    suspect: bool = False
    grammar: Matcher | None = None  # the grammar state after output_ids (params.grammar)
    # set when the grammar ends the request: "stop" / "grammar" (a dead end) / "abort" (its grammar
    # work ran past its budget: engine/round/grammar_jobs.py; `error` says so)
    grammar_end: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens that must be cached before decoding: the prompt, or after a preemption everything but the
        pending token."""
        return self.seq_len - 1 if self.output_ids else len(self.prompt_ids)

    @property
    def needs_prefill(self) -> bool:
        return self.kv_len < self.prefill_len

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def pending_token(self) -> int:
        """The last sampled token: not yet in the KV cache, the root of the next round."""
        return self.output_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED
