"""The engine's side of the server boundary (engine/boundary.py): a streaming engine keeps every
live request's text up to date at the step's end, or, with a hook, flushes it inside the next
round before the hook runs; `stats()` is a frozen copy of the pools' numbers; `fail_step`
chooses and releases the requests a step's own bug is blamed on."""

import dataclasses
import inspect

import pytest
from engine_stub import IdleEngine

from ddtree import LLM, SamplingParams
from ddtree.engine import integrity
from ddtree.engine.boundary import EngineProtocol, EngineStats, FrontendProtocol, StepResult

PLAIN = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture()
def eng(one_torch_thread):
    return LLM(None, max_running_requests=2).engine


def _text_is_current(eng, req) -> bool:
    return req.rid not in eng.emitter.lag and req.text == eng.tokenizer.decode(req.output_ids)


def test_a_streaming_engine_flushes_text_at_every_step_end(eng):
    eng.stream_text(None)
    reqs = [eng.add_request("def f(x):", PLAIN), eng.add_request("import os\n", PLAIN)]
    while eng.has_unfinished():
        res = eng.step()
        assert isinstance(res, StepResult)
        assert all(_text_is_current(eng, r) for r in reqs), [r.text for r in reqs]


def test_with_a_hook_the_next_round_flushes_before_it_runs(eng):
    """The text of a decode step with rounds to come waits for the next round (hidden under its
    device work), and is current when the hook (the server's publishing) runs."""
    seen = []
    reqs = []
    eng.stream_text(lambda: seen.append(all(_text_is_current(eng, r) for r in reqs)))
    reqs += [eng.add_request("def f(x):", PLAIN), eng.add_request("import os\n", PLAIN)]
    deferred = 0
    while eng.has_unfinished():
        res = eng.step()
        if res.round is not None and eng.has_unfinished():
            deferred += any(r.rid in eng.emitter.lag for r in reqs)
        else:
            assert all(_text_is_current(eng, r) for r in reqs)
    assert deferred and seen and all(seen), (deferred, seen)


def test_stats_are_a_frozen_copy_of_the_pools(eng):
    req = eng.add_request("def f(x):", PLAIN)
    eng.step()
    st = eng.stats()
    bm = eng.runner.bm
    assert isinstance(st, EngineStats)
    assert (st.num_running, st.num_waiting) == (1, 0)
    assert st.kv_pages_total == bm.num_pages and st.kv_pages_free == bm.num_available_pages
    assert st.request_slots_free == st.request_slots_total - 1
    assert st.steps == eng.runner.step_stats.as_dict() and st.faults.dead is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.num_running = 0
    eng.abort(req.rid)
    assert st.num_running == 1 and eng.stats().num_running == 0


def test_fail_step_releases_the_running_requests_or_the_queue_head(eng):
    a, b = eng.add_request("def f(x):", PLAIN), eng.add_request("import os\n", PLAIN)
    while len(eng.scheduler.running) < 2:
        eng.step()
    failure = eng.fail_step(RuntimeError("a bug in the step"))
    assert set(failure.failed) == {a.rid, b.rid} and failure.dead is None
    assert a.is_finished and b.is_finished and not eng.has_unfinished()
    assert integrity.problems(eng) == []
    c, d = eng.add_request("x = 1", PLAIN), eng.add_request("y = 2", PLAIN)
    failure = eng.fail_step(RuntimeError("scheduling bug"))  # none runs: the head is blamed
    assert failure.failed == (c.rid,) and d.rid in eng.requests
    assert integrity.problems(eng) == []


def _members(proto) -> set[str]:
    return {
        name
        for cls in proto.__mro__
        if cls.__name__.endswith("Protocol") and cls.__module__ == proto.__module__
        for name in [*vars(cls), *getattr(cls, "__annotations__", {})]
        if not name.startswith("_")
    }


def _lacks(obj, proto) -> list[str]:
    """proto's members obj lacks, looked up statically (a property is not run)."""
    missing = []
    for name in sorted(_members(proto)):
        try:
            inspect.getattr_static(obj, name)
        except AttributeError:
            missing.append(name)
    return missing


def test_the_engine_the_stub_and_the_dp_frontend_implement_the_protocols(eng):
    """Every method the server calls is there (the server asks no engine whether it has one)."""
    from ddtree.server.dp.engine import Frontend

    assert {"step", "stats", "stream_text", "fail_step", "grammars"} <= _members(EngineProtocol)
    assert _lacks(eng, EngineProtocol) == [] and _lacks(IdleEngine(), EngineProtocol) == []
    frontend = Frontend(None, 64, 32, (0,))
    assert _lacks(frontend, FrontendProtocol) == [] and "step" in _lacks(frontend, EngineProtocol)
