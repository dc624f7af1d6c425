"""A stub of the server's engine (`ddtree.engine.boundary.EngineProtocol`) for tests of the server
loop without a model: it never has work, so its steps never run, and it answers every other call
the server makes the way an empty engine would."""

from __future__ import annotations

from ddtree.engine.boundary import EngineStats, StepFailure, StepResult


class IdleEngine:
    tokenizer = None
    max_context = 64
    num_waiting = 0

    def __init__(self, grammars=None):
        self.grammars = grammars  # GrammarCompiler's (`grammars.compile`, `grammars.probe`)
        self.under_round = None

    def add_request(self, prompt, params, rid=None, arrival=None):
        raise RuntimeError("the idle stub admits no request")

    def abort(self, rid: str) -> None:
        pass

    def has_unfinished(self) -> bool:
        return False

    def step(self) -> StepResult:
        return StepResult()

    def fail_step(self, exc: Exception) -> StepFailure:
        return StepFailure()

    def stats(self) -> EngineStats:
        return EngineStats()

    def integrity_problems(self) -> list[str]:
        return []

    def stream_text(self, under_round) -> None:
        self.under_round = under_round

    def note_server_time(self, seconds: float) -> None:
        pass

    def grammar_cached(self, spec) -> bool:
        return False

    def release(self) -> None:
        pass

    def tp_problem(self) -> str | None:
        return None
