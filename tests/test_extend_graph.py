"""The graphed short extend without a GPU: the padded static-buffer path (`CudaGraphRunner(
capture=False)`) runs what a replay runs, minus the capture. Multi-turn chats over a cached system
prompt give the eager engine's tokens (AR / DFLASH / DDTREE; dense, and hybrid under both state
strategies), through graphed extends that really ran at batch > 1, in several passes, with q not a
multiple of 16 and q = 1; padding tokens and padded rows never write a real or shared KV page or a
real state row, while they do write the scratch page / row (so the check can fail)."""

import dataclasses

import pytest
import torch
from engine_utils import make_llm, mean_accept, toy_pattern, toy_prompts
from triton_utils import cpu_interpreter_only

from ddtree import SamplingParams
from ddtree.engine.config import extend_widths, runner_config
from ddtree.engine.graphs.extend import plan_passes
from ddtree.engine.graphs.runner import CudaGraphRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PAGE, MAX_TOKENS = 4, 16
WIDTHS = (8, 16)  # small widths: the toy turns (1..21 new tokens) take one or more passes
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SYSTEM = list(toy_prompts(6)[5][:10])  # ends mid-page: the first turns copy-on-write
TOPICS = [toy_pattern("prog", 3, 60, 2), toy_pattern("walk", 30, 60), toy_pattern("prog", 17, 60)]
HYBRID = [("NONE", "extra_buffer"), ("DFLASH", "no_buffer")]
HYBRID += [("DDTREE", "extra_buffer"), ("DDTREE", "no_buffer")]


def test_plan_passes():
    assert plan_passes([5, 16, 1], [8, 16], 4) == [(16, [(0, 5), (1, 16), (2, 1)])]
    assert plan_passes([1], [8, 16], 4) == [(8, [(0, 1)])]
    # a 21-token request: 16 then 5; batch 5 > 4: two groups
    assert plan_passes([21, 3], [8, 16], 4) == [(16, [(0, 16), (1, 3)]), (8, [(0, 5)])]
    assert plan_passes([2] * 5, [8], 4) == [(8, [(i, 2) for i in range(4)]), (8, [(4, 2)])]
    assert plan_passes([65], [16], 4) is None  # 5 passes > EXTEND_MAX_PASSES: eager
    assert plan_passes([3], [], 4) is None


def test_extend_widths_are_derived_once(monkeypatch):
    from ddtree.config import prepare_server_args

    assert extend_widths(190) == (64, 128, 256) and extend_widths(100) == (64, 128)
    assert extend_widths(4096) == (64, 128, 256)
    args = prepare_server_args(["--device", "cpu", "--chunked-prefill-size", "96"])
    args = dataclasses.replace(args, disable_cuda_graph=False)  # as resolved for a GPU
    pools = type("P", (), {"num_pages": 64, "max_running_requests": 4, "checkpoint_rows": 0})
    assert runner_config(args, pools, "cuda").extend_widths == (64, 128)
    assert runner_config(args, pools, "cpu").extend_widths == ()
    off = dataclasses.replace(args, disable_cuda_graph=True)
    assert runner_config(off, pools, "cuda").extend_widths == ()


def _engine(pair, algorithm, graphs, **kw):
    if algorithm == "DDTREE":
        kw.setdefault("speculative_ddtree_budget", 6)
    llm = make_llm(pair, algorithm, page_size=PAGE, max_running_requests=4, **kw)
    runner = llm.engine.runner
    runner.check_writes = True  # every KV write: never a shared cached page
    calls = []
    if graphs:
        g = runner.graphs = CudaGraphRunner(runner, capture=False, max_bs=4, extend_widths=WIDTHS)
        spec = llm.engine.spec
        runner.set_tree_spec(spec.algorithm, spec.budget, spec.topk_cap, spec.shadow_linear)
        g.build()
        run = g.extend.run

        def recorded(width, host, lens):
            calls.append((width, host[:, width + 2].tolist()))
            return run(width, host, lens)

        g.extend.run = recorded
    return llm, calls


def _chat(llm):
    """Two turns of three conversations over SYSTEM (batch 3), then a turn of one new token."""
    convs = [SYSTEM + t[:7] for t in TOPICS]
    outs = []
    for turn in range(2):
        got = llm.generate([list(c) for c in convs], PARAMS)
        outs += got
        at = 7 + (turn + 1) * MAX_TOKENS + turn * 5
        convs = [c + o.token_ids + t[at : at + 5] for c, o, t in zip(convs, got, TOPICS)]
    # a prompt whose every token but the last is cached (page-aligned): q = 1
    one = SYSTEM[:8]
    llm.generate([one], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    outs += llm.generate([one + [TOPICS[0][0]]], PARAMS)
    return outs


def _check_calls(calls):
    qs = [q for _, rows in calls for q in rows]
    assert any(len(rows) > 1 for _, rows in calls), "no graphed extend at batch > 1"
    assert 1 in qs and any(q % 16 and q > 1 for q in qs)
    assert any(q == WIDTHS[-1] for q in qs), "no request took more than one pass"


@pytest.fixture(scope="module")
def dense_eager(toy_pair):
    return {a: _chat(_engine(toy_pair, a, False)[0]) for a in ("NONE", "DFLASH", "DDTREE")}


@pytest.mark.parametrize("algorithm", ["NONE", "DFLASH", "DDTREE"])
def test_graphed_extend_gives_eager_tokens_dense(toy_pair, dense_eager, algorithm):
    llm, calls = _engine(toy_pair, algorithm, True)
    outs = _chat(llm)
    assert [o.token_ids for o in outs] == [o.token_ids for o in dense_eager[algorithm]]
    assert sum(o.cached_tokens for o in outs) > 0, "nothing hit the prefix cache"
    _check_calls(calls)
    if algorithm != "NONE":
        assert mean_accept(outs) > 2


@pytest.mark.parametrize("algorithm,strategy", HYBRID)
def test_graphed_extend_gives_eager_tokens_hybrid(toy_hybrid_pair, algorithm, strategy):
    kw = dict(mamba_scheduler_strategy=strategy)
    ref = _chat(_engine(toy_hybrid_pair, algorithm, False, **kw)[0])
    llm, calls = _engine(toy_hybrid_pair, algorithm, True, **kw)
    outs = _chat(llm)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert sum(o.cached_tokens for o in outs) > 0, "nothing hit the prefix cache"
    _check_calls(calls)
    if algorithm != "NONE":
        assert mean_accept(outs) > 2


# ---- padding writes ----------------------------------------------------------------------------
def _pools(runner):
    kv = [t for p in (runner.kv, runner.draft_kv) if p is not None for t in (p.k, p.v)]
    sp = runner.state_pool
    return kv, ([sp.conv, sp.ssm] if sp is not None else [])


def _watch(llm, log):
    """Wrap each extend pass: log (KV slots written outside the live rows' new real slots and the
    scratch pages, state rows changed outside the live rows' and the scratch row, whether the
    scratch pages / row changed)."""
    runner = llm.engine.runner
    ext, p = runner.graphs.extend, runner.cfg.page_size
    scratch = {pg * p + i for pg in runner.scratch_pages for i in range(p)}
    run = ext.run

    def watched(width, host, lens):
        kv, st = _pools(runner)
        before = [t.clone() for t in kv + st]
        out = run(width, host, lens)
        allowed, live = set(scratch), set()
        for row in host.tolist():
            slot, start, q = row[width:]
            pos = torch.arange(start, start + q)[None]
            allowed |= set(runner.slots_of(runner.bm.block_table[slot][None], pos)[0].tolist())
            live.add(slot)
        changed = [
            (x != y).transpose(0, 1).flatten(1).any(1).nonzero().flatten().tolist()
            for x, y in zip(before, kv + st)
        ]
        slots = set().union(*changed[: len(kv)])
        rows = set().union(*changed[len(kv) :])
        shared = {s for s in slots if s // p in runner.bm.cache.page_owner}
        sr = runner.state_pool.scratch_row if runner.state_pool is not None else None
        log.append((slots - allowed, shared, rows - live - {sr}, bool(slots & scratch)))
        return out

    ext.run = watched


@pytest.mark.parametrize("hybrid", [False, True])
def test_padding_writes_only_scratch(toy_pair, toy_hybrid_pair, hybrid):
    llm, _ = _engine(toy_hybrid_pair if hybrid else toy_pair, "DFLASH", True)
    log = []
    _watch(llm, log)
    _chat(llm)
    assert log and all(not a and not b and not c for a, b, c, _ in log)
    assert any(wrote for *_, wrote in log), "padding never wrote (to scratch)"


def test_padding_check_catches_a_pad_slot_in_a_real_page(toy_pair):
    """Control: padding tokens pointed at page 0 (a live request's) are caught."""
    llm, _ = _engine(toy_pair, "DFLASH", True)
    for g in llm.engine.runner.graphs.extend.graphs.values():
        g.pad_slots.copy_(torch.arange(len(g.pad_slots)) % PAGE)
        g.slots.copy_(g.pad_slots)
    log = []
    _watch(llm, log)
    llm.engine.runner.check_writes = False  # the page may be a shared one: let the snapshot see it
    _chat(llm)
    assert any(bad for bad, *_ in log)


def test_warm_up_runs_eager_then_graphed_extends(toy_pair):
    """The eager part with the extend graphs off (short prompts compile the eager kernels too),
    then a turn-sized prompt graphed at batch 1 and the largest extend bucket; nothing left."""
    from ddtree.engine.warmup import warm_up

    llm, calls = _engine(toy_pair, "NONE", True, chunked_prefill_size=64)
    engine, ext = llm.engine, llm.engine.runner.graphs.extend
    bm = engine.runner.bm
    free = (bm.num_free_pages, bm.num_free_slots)
    modes = []
    prefill = engine.runner.prefill
    engine.runner.prefill = lambda reqs, q: (modes.append(ext.enabled), prefill(reqs, q))[1]
    out = warm_up(engine, progress=False)
    assert out["extend_batches"] == [1, 4] and ext.enabled
    assert modes.count(False) >= len(out["prefill"]) + len(out["prefill_extra"])
    assert [len(q) for _, q in calls[:2]] == [1, 4] and calls[0][1] == [WIDTHS[-1]]
    assert not engine.requests and (bm.num_free_pages, bm.num_free_slots) == free


@cpu_interpreter_only
def test_triton_kernel_runs_the_graphed_extend(toy_pair, monkeypatch):
    """The Triton attention kernel (Triton's CPU interpreter) on the extend's causal W-row calls
    (block-table rows with scratch columns past them): the eager kernel path's tokens, and the
    plan each extend graph set is keyed by is the plan its forward's attention calls run."""
    from triton_utils import load_kernel_module

    kernel = load_kernel_module("ddtree.kernels.tree_attention.launch")
    import ddtree.config.args as server_args

    if "triton" not in server_args.IMPLEMENTED_ATTENTION_BACKENDS:
        monkeypatch.setattr(
            server_args,
            "IMPLEMENTED_ATTENTION_BACKENDS",
            server_args.IMPLEMENTED_ATTENTION_BACKENDS + ("triton",),
        )
    kw = dict(attention_backend="triton", context_length=120)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def chat(llm):  # batch 3, two passes (17 tokens), then over the cached prefix
        first = llm.generate([SYSTEM + t[:7] for t in TOPICS], params)
        return first + llm.generate(
            [SYSTEM + t[:7] + o.token_ids + t[9:12] for t, o in zip(TOPICS, first)], params
        )

    ref = chat(_engine(toy_pair, "NONE", False, **kw)[0])
    llm, calls = _engine(toy_pair, "NONE", True, **kw)
    outs = chat(llm)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert len(calls) >= 3 and outs[-1].cached_tokens
    runner = llm.engine.runner
    ext, ran, launched = runner.graphs.extend, [], kernel.paged_attention_plan

    def recording(*a, **kw):
        out, plan = launched(*a, **kw)
        ran.append(plan)
        return out, plan

    monkeypatch.setattr(kernel, "paged_attention_plan", recording)
    for w, bs in ((WIDTHS[0], 1), (WIDTHS[-1], ext.buckets[-1])):
        gs = ext.sets[w]
        ran.clear()
        key = gs.probe(bs, gs.bounds[-1])
        assert ran and {p.capture_key for p in ran} == {key}
        shape = ext.graphs[w].attention_shape(bs, gs.bounds[-1])
        assert runner.backend.launch_plan(shape, runner.device) == ran[-1]


def _as_one_launch(run, counter):
    def replay(b, lens):  # what a captured graph costs the host: one launch
        with counter.opaque("replay"):
            return run(b, lens)

    return replay


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_graphed_pass_launches_little_outside_its_replay(toy_pair, toy_hybrid_pair, hybrid):
    """Host-side launches of a one-pass prefill of two prompts (ddtree.tools.studies.op_count's counter):
    the pass's loads around one replay, against the eager extend's per-layer ops."""
    from engine_utils import accepted_prompts

    from ddtree.tools.studies.op_count import LaunchCounter

    counts = {}
    for graphed in (False, True):
        llm, _ = _engine(toy_hybrid_pair if hybrid else toy_pair, "DFLASH", True)
        runner, counter = llm.engine.runner, LaunchCounter()
        ext = runner.graphs.extend
        ext.enabled = graphed
        for gs in ext.sets.values():
            gs.run = _as_one_launch(gs.run, counter)
        params = SamplingParams(temperature=0, max_tokens=1)
        reqs = [llm.engine.add_request(list(p)[:12], params) for p in accepted_prompts(3)[1:]]
        for r in reqs:
            runner.bm.allocate(r, 1)
        with counter:
            runner.prefill(reqs, [12, 12])
        counts[graphed] = sum(counter.per_label().values())
    assert counts[True] <= 40 < 100 < counts[False], counts
