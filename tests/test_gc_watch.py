"""server/gc_watch.py: the start-up heap frozen after the warm-up (a full collection then walks only
what serving allocated), every collection timed into /metrics with long ones logged, and
DDTREE_GC_FREEZE checked before the weights load."""

import gc
import logging

import pytest

from ddtree.server.gc_watch import GcWatch, freeze_startup_heap, gc_freeze_on


def test_a_collection_is_timed_drained_once_and_a_long_one_logged(caplog):
    watch = GcWatch(warn_s=0.0)
    watch.start()
    watch.start()  # once only
    try:
        with caplog.at_level(logging.WARNING, logger="ddtree"):
            gc.collect()
    finally:
        watch.stop()
    seen = watch.drain()
    assert [g for g, _ in seen] == [2] and seen[0][1] > 0
    assert "GC pause: generation 2" in caplog.text
    assert watch.drain() == []
    gc.collect()  # stopped: no longer timed
    assert watch.drain() == [] and watch._callback not in gc.callbacks


def test_freezing_leaves_a_full_collection_only_what_came_after():
    before = len(gc.get_objects())
    try:
        frozen = freeze_startup_heap()
        # A frozen object still dies when its last reference goes (a thread left by an earlier
        # test may drop some in between): the count can only shrink after the freeze.
        assert 0.9 * before < gc.get_freeze_count() <= frozen
        assert len(gc.get_objects()) < 0.1 * before  # what the next full collection walks
    finally:
        gc.unfreeze()


def test_the_freeze_switch(monkeypatch):
    from ddtree.models.configs import ConfigError

    monkeypatch.delenv("DDTREE_GC_FREEZE", raising=False)
    assert gc_freeze_on()
    monkeypatch.setenv("DDTREE_GC_FREEZE", "0")
    assert not gc_freeze_on()
    monkeypatch.setenv("DDTREE_GC_FREEZE", "yes")
    with pytest.raises(ConfigError, match="DDTREE_GC_FREEZE"):
        gc_freeze_on()


def test_a_bad_freeze_switch_fails_before_weights_load(monkeypatch, capsys, tmp_path):
    from ddtree.server import launch

    monkeypatch.setenv("DDTREE_GC_FREEZE", "2")
    monkeypatch.setattr(launch, "build_app", lambda *a, **k: pytest.fail("weights loaded"))
    assert launch.main(["--device", "cpu"]) == 2
    assert "DDTREE_GC_FREEZE" in capsys.readouterr().err


def test_gc_pauses_reach_the_metrics():
    from ddtree.server.metrics import ServerMetrics

    m = ServerMetrics("DDTREE", 16)
    m.on_gc_pause(2, 0.12)
    m.on_gc_pause(0, 0.0004)
    text = m.render().decode()
    assert 'ddtree_gc_pause_seconds_count{generation="2"} 1.0' in text
    assert 'ddtree_gc_pause_seconds_sum{generation="0"} 0.0004' in text


def test_a_serving_level_reports_the_gc_pauses_it_saw():
    """`bench serving`'s level (the /metrics delta): per generation the collections, their ms and
    those over 50 ms, counting only what happened during the level."""
    from ddtree.bench import serving_metrics
    from ddtree.server.metrics import ServerMetrics

    m = ServerMetrics("DDTREE", 16)
    m.on_gc_pause(2, 0.2)  # before the level
    before = serving_metrics.parse(m.render().decode())
    m.on_gc_pause(2, 0.12)
    m.on_gc_pause(2, 0.01)
    m.on_gc_pause(0, 0.0004)
    level = serving_metrics.delta(before, serving_metrics.parse(m.render().decode()))
    assert level["gc_pauses"]["2"]["count"] == 2 and level["gc_pauses"]["2"]["over_50ms"] == 1
    assert level["gc_pauses"]["2"]["total_ms"] == pytest.approx(130.0)
    assert level["gc_pauses"]["0"] == {"count": 1, "total_ms": pytest.approx(0.4), "over_50ms": 0}
    assert "1" not in level["gc_pauses"]


def test_a_server_without_metrics_drains_its_pauses_too():
    """The engine loop drains the watch every pass, metrics or not: without metrics the pauses
    would pile up for the server's whole life."""
    import time

    from engine_stub import IdleEngine

    from ddtree.server.async_engine import AsyncEngine

    ae = AsyncEngine(IdleEngine())
    ae.start()
    try:
        for _ in range(200):  # the watch starts on the engine thread
            if ae.gc_watch._callback in gc.callbacks:
                break
            time.sleep(0.01)
        gc.collect()
        assert ae.gc_watch._pending  # recorded ...
        for _ in range(200):  # ... and gone by the loop's next pass (idle: one poll)
            if not ae.gc_watch._pending:
                break
            time.sleep(0.01)
        assert not ae.gc_watch._pending
    finally:
        ae.shutdown()
