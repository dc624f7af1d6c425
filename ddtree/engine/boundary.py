"""What the server needs of an engine, and nothing more: `EngineProtocol`, with the two values it
hands out, `EngineStats` (every number /metrics and /get_server_info show, read between two steps)
and `StepResult` (what one step did). The server holds an engine only through this protocol (it
never reaches the scheduler, the runner, the pools or the detokenizer), so the tests' stub
engines implement the same methods and the server never asks whether one is there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

if TYPE_CHECKING:
    from ddtree.engine.budget.planner import RoundRecord
    from ddtree.engine.scheduling.request import Req, SamplingParams


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache's counters since start (`prefix_cache.CacheStats`, copied)."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0
    state_miss_tokens: int = 0
    checkpoint_drops: int = 0
    hit_rate: float = 0.0


@dataclass(frozen=True)
class FaultCounts:
    """Fault isolation's counters (`faults.FaultStats`, copied) and why the engine is dead."""

    isolated: int = 0
    batch_failures: int = 0
    integrity_checks: int = 0
    last_integrity_ok: bool = True
    dead: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """The engine between two steps. KV pages free counts unreferenced cached pages (they are
    evicted on demand); state-pool rows are indexed by the request's slot, so their use is the
    slots' use (0 rows: a dense target)."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_pages_total: int = 0
    kv_pages_free: int = 0
    kv_pages_cached: int = 0
    page_size: int = 0
    request_slots_total: int = 0
    request_slots_free: int = 0
    state_pool_slots_total: int = 0
    state_pool_slots_free: int = 0
    checkpoint_rows: int = 0  # hybrid: the prefix cache's recurrent-state checkpoints
    prefix_cache: PrefixCacheStats | None = None  # None: no prefix cache
    faults: FaultCounts = FaultCounts()
    steps: Mapping[str, float] | None = None  # `step_stats.StepStats.as_dict()`, since start

    @property
    def kv_pages_used(self) -> int:
        return self.kv_pages_total - self.kv_pages_free

    @property
    def state_pool_slots_used(self) -> int:
        return self.state_pool_slots_total - self.state_pool_slots_free


@dataclass(frozen=True)
class StepResult:
    """One step: the requests it advanced (finished ones included) and, for a decoding round, its
    `RoundRecord` (None after a prefill, an idle or a failed step). A streaming engine
    (`EngineProtocol.stream_text`) has brought each live request's `text` up to date by the time
    its caller publishes: at the step's end, or under the next round's device work."""

    reqs: tuple[Req, ...] = ()
    round: RoundRecord | None = None


@dataclass(frozen=True)
class StepFailure:
    """A step that raised outside the engine's own isolation, cleaned up by `fail_step`: the
    requests failed for it (released already) and, when the pools broke, why the engine is dead."""

    failed: tuple[str, ...] = ()
    dead: str | None = None


class FrontendProtocol(Protocol):
    """What the request path reads of an engine before admission, on the HTTP side's threads:
    what is fixed after start-up (the tokenizer, the context length) and the grammar compiler
    (`LLMEngine`; a --dp-size server's `Frontend`, whose replicas hold the engines)."""

    tokenizer: object | None
    max_context: int

    @property
    def grammars(self): ...

    def grammar_cached(self, spec) -> bool: ...


class EngineProtocol(FrontendProtocol, Protocol):
    """The server's engine (`LLMEngine`; a test's stub): every method runs on the engine thread,
    except `tp_problem` and the `FrontendProtocol`'s (any thread)."""

    @property
    def num_waiting(self) -> int: ...

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        rid: str | None = None,
        arrival: float | None = None,
    ) -> Req: ...

    def abort(self, rid: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> StepResult: ...

    def fail_step(self, exc: Exception) -> StepFailure: ...

    def stats(self) -> EngineStats: ...

    def integrity_problems(self) -> list[str]: ...

    def stream_text(self, under_round: Callable[[], None] | None) -> None: ...

    def note_server_time(self, seconds: float) -> None: ...

    def tp_problem(self) -> str | None: ...

    def release(self) -> None: ...  # after the last step: give the pools back
