"""Start-up warm-up (engine/warmup.py): it runs a prefill per shape bucket and decode rounds through
the engine's own paths, leaves the engine clean (no request, every page and slot free) and the
tokens of later requests unchanged; the server's /health answers 503 "warming up" until it ends,
and `--skip-server-warmup` / the CPU turn it off."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from engine_stub import IdleEngine
from engine_utils import accepted_prompts, make_llm, mean_accept

from ddtree import SamplingParams
from ddtree.engine.warmup import prefill_buckets, warm_up
from ddtree.server.async_engine import WARMING_UP, AsyncEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_prefill_buckets():
    assert prefill_buckets(2048, 10_000) == [16, 128, 512, 2048]
    assert prefill_buckets(8192, 10_000) == [16, 128, 512, 2048, 8192]
    assert prefill_buckets(2048, 300) == [16, 128, 300]


def test_warm_up_runs_every_shape_and_leaves_the_engine_clean(toy_hybrid_pair):
    prompts = [list(p) for p in accepted_prompts(2)]  # the drafts are accepted: state carries
    ref = [o.token_ids for o in make_llm(toy_hybrid_pair, "DDTREE").generate(prompts, PARAMS)]
    llm = make_llm(toy_hybrid_pair, "DDTREE", max_running_requests=2, chunked_prefill_size=64)
    engine = llm.engine
    bm = engine.runner.bm
    free = (bm.num_free_pages, bm.num_free_slots)
    prefills = []
    prefill = engine.runner.prefill
    engine.runner.prefill = lambda reqs, q: (prefills.append(list(q)), prefill(reqs, q))[1]
    rounds = []
    decode = engine.decoder.round
    engine.decoder.round = lambda reqs, m: (rounds.append(len(reqs)), decode(reqs, m))[1]
    out = warm_up(engine, progress=False)
    assert out["prefill"] == [16, 64] and [q for q in prefills if len(q) == 1][:2] == [[16], [64]]
    assert rounds and set(rounds) == {1}  # no graphs on the CPU: the largest "bucket" is 1
    assert not engine.requests and not engine.has_unfinished()
    assert (bm.num_free_pages, bm.num_free_slots) == free
    outs = llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == ref and mean_accept(outs) > 2


def wait_healthy(ae, tries: int = 200) -> None:
    """Until /health is green (the warm-up over), at most tries x 10 ms."""
    for _ in range(tries):
        if ae.health_problem() is None:
            return
        time.sleep(0.01)


def test_health_says_warming_up_until_the_warm_up_ends():
    release = threading.Event()
    ae = AsyncEngine(IdleEngine(), warmup=release.wait)
    ae.start()
    try:
        time.sleep(0.05)
        assert ae.health_problem() == WARMING_UP
        release.set()
        wait_healthy(ae)
        assert ae.health_problem() is None
    finally:
        release.set()
        ae.shutdown()


def test_a_failing_warm_up_still_serves():
    def boom():
        raise RuntimeError("compile failed")

    ae = AsyncEngine(IdleEngine(), warmup=boom)
    ae.start()
    try:
        wait_healthy(ae)
        assert ae.health_problem() is None and ae.alive
    finally:
        ae.shutdown()


@pytest.mark.parametrize(
    "device,skip,on", [("cuda", False, True), ("cuda", True, False), ("cpu", False, False)]
)
def test_warm_up_runs_on_cuda_unless_skipped(device, skip, on):
    from ddtree.server.build import warmup_of

    engine = SimpleNamespace(device=torch.device(device))
    args = SimpleNamespace(skip_server_warmup=skip)
    assert (warmup_of(engine, args) is not None) == on


@pytest.mark.parametrize("gc_freeze", [True, False])
def test_the_start_up_heap_is_frozen_after_the_warm_up(gc_freeze):
    """server/gc_watch.py: with gc_freeze the engine thread freezes the heap after the warm-up and
    before /health turns green (the CLI's default, DDTREE_GC_FREEZE); without it, not at all."""
    import gc

    frozen_at_warm_up = []
    ae = AsyncEngine(
        IdleEngine(),
        warmup=lambda: frozen_at_warm_up.append(gc.get_freeze_count()),
        gc_freeze=gc_freeze,
    )
    ae.start()
    try:
        wait_healthy(ae)
        assert ae.health_problem() is None
        assert frozen_at_warm_up == [0]
        assert (gc.get_freeze_count() > 0) == gc_freeze
    finally:
        ae.shutdown()
        gc.unfreeze()


def test_warm_up_runs_packed_rounds_where_auto_may_pack(toy_pair):
    """A dense `auto` engine's warm-up runs packed rounds (the eager packed verify's kernels
    compile there) and gives the policy back."""
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget="auto", max_running_requests=2)
    engine = llm.engine
    policy = engine.decoder.budgets.policy
    packed = []
    verify = engine.runner.verify_packed
    engine.runner.verify_packed = lambda *a: packed.append(a[3]) or verify(*a)
    out = warm_up(engine, progress=False)
    assert packed and out["packed_batches"] == [1]
    assert engine.decoder.budgets.policy is policy and not engine.requests
