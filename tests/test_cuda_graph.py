"""CUDA-graph runner without a GPU: the padded static-buffer path (`CudaGraphRunner(capture=False)`) runs the
same code as a replay, minus the capture. It must give the plain path's tokens, pad batches into buckets,
keep padding rows out of real KV pages, and build the round metadata once per round."""

import pytest
import torch
from engine_utils import accepted_prompts, make_llm, mean_accept
from triton_utils import cpu_interpreter_only

from ddtree import SamplingParams
from ddtree.engine.graphs.runner import (
    CudaGraphRunner,
    GraphSet,
    attach_uncaptured,
    batch_buckets,
    ctx_bounds,
)
from ddtree.engine.round.data import Round

# ragged prompts (9..33 tokens) the toy drafter accepts (mean accepted length > 2: the graph path's
# commits move real accepted paths) and different lengths, so the live batch shrinks 5 -> 1
# (lengths spread so that, with 4-7 tokens a round, some round still runs 3 live requests: padded)
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 12, 28, 6, 20)]
ALGOS = ["NONE", "DFLASH", "DDTREE"]


def attach_graphs(llm, max_bs):
    """A capture=False graph runner on the engine's runner (`cuda_graph.attach_uncaptured`)."""
    return attach_uncaptured(llm.engine, max_bs=max_bs)


def generate(pair, algorithm, graphs_max_bs=None, n=5, params=None, **kw):
    llm = make_llm(pair, algorithm, speculative_ddtree_budget=8, max_running_requests=8, **kw)
    runner = llm.engine.runner
    calls = []
    if graphs_max_bs is not None:
        g = attach_graphs(llm, graphs_max_bs)
        sets = [("verify", g.verify_set)] + [("draft", gs) for gs in g.draft_sets.values()]
        for kind, gs in sets:
            gs.run = _recording(gs.run, calls, kind)
    outs = llm.generate([list(p) for p in accepted_prompts(n)], (params or PARAMS)[:n])
    return outs, calls, runner


def _recording(run, calls, kind):
    def wrapped(b, host_lens):
        calls.append((kind, b))
        return run(b, host_lens)

    return wrapped


@pytest.fixture(scope="module")
def plain(toy_pair):
    return {a: [o.token_ids for o in generate(toy_pair, a)[0]] for a in ALGOS}


def test_buckets():
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert batch_buckets(3) == [1, 2, 3]
    assert ctx_bounds(40000) == [1024, 4096, 16384, 40000]
    assert ctx_bounds(300) == [300]


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("max_bs", [4, 8])
def test_padded_static_path_gives_plain_tokens(
    toy_pair, plain, one_torch_thread, algorithm, max_bs
):
    """5 requests: with max_bs 4 the first rounds (b = 5) run eagerly, later ones pad 3 -> 4 etc."""
    outs, calls, _ = generate(toy_pair, algorithm, max_bs)
    assert [o.token_ids for o in outs] == plain[algorithm]
    verify_bs = {b for kind, b in calls if kind == "verify"}
    assert verify_bs and max(verify_bs) <= max_bs
    assert any(b not in batch_buckets(max_bs) for b in verify_bs), "no round needed padding"
    if algorithm != "NONE":
        assert {b for kind, b in calls if kind == "draft"} == verify_bs
        assert mean_accept(outs) > 2
    if max_bs == 4:
        assert 5 not in verify_bs  # b = 5 exceeds the largest bucket: eager


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
def test_single_request_bucket(toy_pair, plain, one_torch_thread, algorithm):
    """--cuda-graph-max-bs 1: static [1, S] buffers must own their memory (an expand(1, S).contiguous() view
    aliased the arange it was built from, and the first drafter replay failed on the H200)."""
    outs, calls, _ = generate(toy_pair, algorithm, 1)
    assert [o.token_ids for o in outs] == plain[algorithm] and mean_accept(outs) > 2
    assert {b for kind, b in calls if kind == "draft"} == {1}


def _illegal_writes(runner, meta, n, before, after) -> set[int]:
    """KV slots changed by one verify outside the live requests' [L, L+n) slots and the scratch pages."""
    p = runner.cfg.page_size
    allowed = set(
        runner.slots_of(meta.rows, meta.lens[:, None] + torch.arange(n)).flatten().tolist()
    )
    allowed |= {pg * p + i for pg in runner.scratch_pages for i in range(p)}
    changed = (before != after).flatten(3).any(-1).flatten(0, 1).any(0).nonzero().flatten().tolist()
    return set(changed) - allowed


def _watch_kv(runner, log):
    graphs, verify = runner.graphs, runner.graphs.verify

    def watched(meta, tree):
        before = torch.stack([runner.kv.k, runner.kv.v]).clone()
        out = verify(meta, tree)
        after = torch.stack([runner.kv.k, runner.kv.v])
        scratch = [
            pg * runner.cfg.page_size + i
            for pg in runner.scratch_pages
            for i in range(runner.cfg.page_size)
        ]
        log.append(
            (
                _illegal_writes(runner, meta, tree.tokens.shape[1], before, after),
                bool((before[:, :, scratch] != after[:, :, scratch]).any()),
                tree.tokens.shape[0],
            )
        )
        last[:] = [meta, tree.tokens.shape[1]]
        return out

    last = []
    commit = graphs.commit

    # target KV moves and drafter-context writes stay in rows + scratch
    def watched_commit(width, path, accept_length):
        pools = [p for p in (runner.kv, runner.draft_kv) if p is not None]
        before = [torch.stack([p.k, p.v]).clone() for p in pools]
        commit(width, path, accept_length)
        bad = set().union(
            *(
                _illegal_writes(runner, last[0], last[1], x, torch.stack([p.k, p.v]))
                for x, p in zip(before, pools)
            )
        )
        log.append((bad, False, path.shape[0]))

    graphs.verify, graphs.commit = watched, watched_commit


@pytest.mark.parametrize("algorithm", ["DDTREE", "NONE"])
def test_padding_rows_write_only_scratch_pages(toy_pair, one_torch_thread, algorithm):
    llm = make_llm(toy_pair, algorithm, speculative_ddtree_budget=8, max_running_requests=8)
    runner = llm.engine.runner
    runner.graphs = CudaGraphRunner(runner, capture=False, max_bs=4)
    runner.graphs.build()
    log = []
    _watch_kv(runner, log)
    # 4 -> 3 live rows inside bucket 4: stale rows
    llm.generate([list(p) for p in accepted_prompts(5)], PARAMS)
    assert log and all(not bad for bad, _, _ in log)
    assert any(wrote for _, wrote, b in log if b == 3), "padding rows never wrote (to scratch)"


def test_padding_check_catches_a_pad_slot_in_a_real_page(toy_pair, one_torch_thread):
    """Control: padding rows pointed at page 0 (owned by a live request) are caught."""
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=8, max_running_requests=8)
    runner = llm.engine.runner
    g = runner.graphs = CudaGraphRunner(runner, capture=False, max_bs=4)
    v = g.verify_graph
    v.pad_slots.copy_(
        torch.arange(v.n).repeat(len(v.pad_slots) // v.n)
    )  # page 0 instead of scratch
    v.slots.copy_(v.pad_slots)
    g.build()
    log = []
    _watch_kv(runner, log)
    llm.generate([list(p) for p in accepted_prompts(3)], PARAMS[:3])
    assert any(bad for bad, _, _ in log)


def test_round_metadata_built_once_per_round(toy_pair, one_torch_thread, monkeypatch):
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=8)
    built, rounds = [], []
    init, round_fn = Round.__init__, llm.engine.decoder.round

    def counting_init(self, *a, **kw):
        built.append(1)
        init(self, *a, **kw)

    def counting_round(*a, **kw):
        rounds.append(1)
        return round_fn(*a, **kw)

    monkeypatch.setattr(Round, "__init__", counting_init)
    monkeypatch.setattr(llm.engine.decoder, "round", counting_round)
    llm.generate([list(p) for p in accepted_prompts(3)], PARAMS[:3])
    assert rounds and len(built) == len(rounds)


@pytest.mark.parametrize("algorithm", ["DDTREE", "NONE"])
def test_a_round_replays_every_phase_or_none(toy_pair, plain, one_torch_thread, algorithm):
    """The graph-or-eager choice is made once per round (`Round.graphed`): a batch the graphs cover
    replays draft, verify and commit; a larger one runs all three eagerly; the same types come
    back either way and the tokens are the plain ones."""
    from ddtree.engine.round.data import Draft, Verify

    llm = make_llm(toy_pair, algorithm, speculative_ddtree_budget=8, max_running_requests=8)
    runner = llm.engine.runner
    g = attach_graphs(llm, 2)
    rounds, phases = [], []
    draft, verify, commit = runner.draft, runner.verify, runner.commit
    g_draft, g_verify, g_commit = g.draft_tree, g.verify, g.commit

    def on_draft(rnd, *a):
        out = draft(rnd, *a)
        assert isinstance(out, Draft) and out.tree.tokens.shape[0] == rnd.batch
        return out

    def on_verify(rnd, tree):
        out = verify(rnd, tree)
        assert isinstance(out, Verify) and out.logits.shape[:2] == tree.tokens.shape
        rounds.append((rnd.batch, rnd.graphed, rnd.verified_in_graph))
        return out

    runner.draft, runner.verify = on_draft, on_verify
    runner.commit = lambda rnd, *a: phases.append(("commit", rnd.graphed)) or commit(rnd, *a)
    g.draft_tree = lambda *a: phases.append(("g_draft", True)) or g_draft(*a)
    g.verify = lambda *a: phases.append(("g_verify", True)) or g_verify(*a)
    g.commit = lambda *a: phases.append(("g_commit", True)) or g_commit(*a)
    outs = llm.generate([list(p) for p in accepted_prompts(3)], PARAMS[:3])
    assert [o.token_ids for o in outs] == plain[algorithm][:3]
    assert {b for b, _, _ in rounds} >= {3, 2}, rounds  # some rounds beyond the graphs, some in
    assert all(graphed == (b <= 2) == in_graph for b, graphed, in_graph in rounds), rounds
    graphed = sum(1 for _, gr, _ in rounds if gr)
    assert sum(1 for k, _ in phases if k == "g_verify") == graphed
    if algorithm == "DDTREE":  # a dense AR round has no commit graph (nothing to commit)
        assert sum(1 for k, _ in phases if k == "g_draft") == graphed
        assert sum(1 for k, _ in phases if k == "g_commit") == graphed


def test_server_args_wire_cuda_graph_into_runner(toy_pair, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="ddtree")
    llm = make_llm(toy_pair, "DFLASH", cuda_graph_max_bs=4)
    cfg = llm.engine.runner.cfg
    assert (
        not cfg.enable_cuda_graph
        and cfg.cuda_graph_max_bs == 4
        and llm.engine.runner.graphs is None
    )
    assert llm.args.disable_cuda_graph
    assert any("CUDA graphs are disabled: the device is cpu" in m for m in caplog.messages)


def test_fixed_split_counts_through_the_kernel(toy_pair, monkeypatch):
    """The Triton kernel (CPU interpreter) with the split count fixed per graph, as under capture; 3 splits over
    1-3 KV tiles leave empty splits, which the combine must ignore. Tokens equal the plain torch backend's."""
    from triton_utils import load_kernel_module

    load_kernel_module("ddtree.kernels.tree_attention.launch")
    import ddtree.config.args as server_args

    if "triton" not in server_args.IMPLEMENTED_ATTENTION_BACKENDS:
        monkeypatch.setattr(
            server_args,
            "IMPLEMENTED_ATTENTION_BACKENDS",
            server_args.IMPLEMENTED_ATTENTION_BACKENDS + ("triton",),
        )
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (8, 4, 6)]
    prompts = [list(p) for p in accepted_prompts(3)]
    kw = dict(speculative_ddtree_budget=4, max_running_requests=4, context_length=120)
    ref = make_llm(toy_pair, "DDTREE", **kw).generate(prompts, params)
    monkeypatch.setattr(GraphSet, "probe", lambda self, bs, bound: (3, False))
    llm = make_llm(toy_pair, "DDTREE", attention_backend="triton", **kw)
    runner = llm.engine.runner
    runner.graphs = CudaGraphRunner(runner, capture=False, max_bs=4)
    runner.graphs.build()
    assert {s for _, s in runner.graphs.verify_set.graphs} == {(3, False)}
    assert all(
        backend.num_splits == 3 for _, _, backend in runner.graphs.verify_set.graphs.values()
    )
    ours = llm.generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in ref] and mean_accept(ours) > 2


@cpu_interpreter_only
def test_probed_plans_are_the_plans_that_run(toy_pair, monkeypatch):
    """The graph sets key their graphs by the backend's `launch_plan` for each (bs, bucket); it must be the plan
    the dispatcher gives the forward's attention calls (verify: tree rows; draft: the block with its K/V
    alongside)."""
    from triton_utils import load_kernel_module

    kernel = load_kernel_module("ddtree.kernels.tree_attention.launch")
    import ddtree.config.args as server_args

    if "triton" not in server_args.IMPLEMENTED_ATTENTION_BACKENDS:
        monkeypatch.setattr(
            server_args,
            "IMPLEMENTED_ATTENTION_BACKENDS",
            server_args.IMPLEMENTED_ATTENTION_BACKENDS + ("triton",),
        )
    llm = make_llm(
        toy_pair,
        "DDTREE",
        attention_backend="triton",
        speculative_ddtree_budget=4,
        max_running_requests=2,
        context_length=120,
    )
    runner = llm.engine.runner
    g = CudaGraphRunner(runner, capture=False, max_bs=2)
    ran, launched = [], kernel.paged_attention_plan

    def recording(*a, **kw):
        out, plan = launched(*a, **kw)
        ran.append(plan)
        return out, plan

    monkeypatch.setattr(kernel, "paged_attention_plan", recording)
    d = g.draft_graph
    for gs, family in (
        (g.verify_set, g.verify_graph),
        (GraphSet(g, d.forward, d.attention_shape, 120, 0), d),
    ):
        for bs in g.buckets:
            ran.clear()
            key = gs.probe(bs, gs.bounds[-1])
            assert ran and {p.capture_key for p in ran} == {key}
            asked = runner.backend.launch_plan(
                family.attention_shape(bs, gs.bounds[-1]), runner.device
            )
            assert asked == ran[-1]
    # control: the equality is not vacuous; a longer context than the bucket's asks for more splits
    import dataclasses

    far = dataclasses.replace(family.attention_shape(bs, gs.bounds[-1]), max_kv_len=1 << 20)
    assert runner.backend.launch_plan(far, runner.device).num_splits > ran[-1].num_splits


def _resolve(tmp_path, *extra):
    from config_fixtures import dense_pair

    from ddtree.config import prepare_server_args

    target, drafter = dense_pair(tmp_path)
    return prepare_server_args(
        [
            "--model-path",
            target,
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            drafter,
            *extra,
        ]
    )


def test_cuda_graph_flags_resolve(tmp_path, caplog):
    import logging

    from ddtree.models.configs import ConfigError

    caplog.set_level(logging.INFO, logger="ddtree")
    on = _resolve(tmp_path, "--device", "cuda", "--attention-backend", "triton")
    assert not on.disable_cuda_graph and on.cuda_graph_max_bs == 16
    assert "CUDA graphs are enabled for verify and draft (batch sizes up to 16)." in caplog.messages
    few = _resolve(
        tmp_path,
        "--device",
        "cuda",
        "--attention-backend",
        "triton",
        "--max-running-requests",
        "4",
        "--cuda-graph-max-bs",
        "32",
    )
    assert few.cuda_graph_max_bs == 4
    torch_backend = _resolve(tmp_path, "--device", "cuda", "--attention-backend", "torch")
    assert torch_backend.disable_cuda_graph
    assert any(
        "--attention-backend torch is not capturable; pass --attention-backend triton" in m
        for m in caplog.messages
    )
    off = _resolve(
        tmp_path,
        "--device",
        "cuda",
        "--attention-backend",
        "triton",
        "--disable-cuda-graph",
        "--cuda-graph-max-bs",
        "8",
    )
    assert off.disable_cuda_graph
    assert "--cuda-graph-max-bs ignored: --disable-cuda-graph is set" in caplog.messages
    with pytest.raises(ConfigError) as info:
        _resolve(tmp_path, "--cuda-graph-max-bs", "0")
    assert any(
        p.startswith("--cuda-graph-max-bs 0: must be at least 1") for p in info.value.problems
    )


# ---- the fused draft -> tree replay and the in-graph greedy accept walk ---------------------------------------
# small max_tokens: late rounds limit the tree depth per request; mixed budgets: the draft graph cuts each
# request's tree to its budget (checked against the eager cut)
FUSED_PARAMS = [
    SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, ddtree_budget=bud)
    for m, bud in ((40, None), (16, 3), (28, None), (6, 5), (20, None))
]


def _check_rounds(llm, log, drop_limits=False):
    """Every fused draft replay's tree must equal the eager build from the same logits and depth limits; every
    in-graph accept walk must equal the eager walk under the argmax of the verify logits."""
    from ddtree.speculative.accept import accept_tree
    from ddtree.speculative.tree import build_chain, build_tree

    runner, server = llm.engine.runner, llm.engine.spec
    g = runner.graphs
    draft, verify, graph_draft = runner.draft, runner.verify, g.draft_tree

    if drop_limits:  # sabotage: the graph never sees the per-request depth limits
        g.draft_tree = lambda rnd, limits, budgets=None, spec=None: graph_draft(
            rnd, None, budgets, spec
        )

    def checked_draft(rnd, limits=None, budgets=None, spec=None):
        assert spec is None  # a fixed server drafts at its own spec (the reference below)
        out = draft(rnd, limits, budgets)
        if rnd.graphed:
            roots, logits, tree = rnd.roots, out.logits, out.tree
            depth = None if limits is None else torch.tensor(limits)
            if server.algorithm == "DFLASH":
                ref = build_chain(roots, logits, max_depth=depth)
            else:
                ref = build_tree(
                    roots,
                    logits,
                    server.budget,
                    server.topk_cap,
                    server.shadow_linear,
                    max_depth=depth,
                    budgets=None if budgets is None else torch.tensor(budgets),
                )
            for f in ("tokens", "parents", "depths", "valid", "tree_mask"):
                assert torch.equal(getattr(tree, f), getattr(ref, f)), f
            assert tree.num_depths == ref.num_depths
            log.append(
                (
                    "draft",
                    rnd.batch,
                    limits is not None,
                    budgets is not None and server.algorithm == "DDTREE",
                )
            )
        return out

    def checked_verify(rnd, tree):
        vo = verify(rnd, tree)
        if vo.greedy_accept is not None:
            tokens = vo.logits.float().argmax(-1)
            assert torch.equal(vo.greedy_tokens, tokens)
            ref = accept_tree(tree, tokens)
            for f in ("accept_length", "path", "out_tokens", "num_out", "last_node"):
                assert torch.equal(getattr(vo.greedy_accept, f), getattr(ref, f)), f
            log.append(("accept", rnd.batch, False, False))
        return vo

    runner.draft, runner.verify = checked_draft, checked_verify


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
def test_fused_draft_tree_and_graph_accept_match_eager(toy_pair, one_torch_thread, algorithm):
    prompts = [list(p) for p in accepted_prompts(5)]
    plain_llm = make_llm(toy_pair, algorithm, speculative_ddtree_budget=8, max_running_requests=8)
    ref = plain_llm.generate(prompts, FUSED_PARAMS)
    llm = make_llm(toy_pair, algorithm, speculative_ddtree_budget=8, max_running_requests=8)
    attach_graphs(llm, 4)
    log = []
    _check_rounds(llm, log)
    commits = []
    graph_commit = llm.engine.runner.graphs.commit
    llm.engine.runner.graphs.commit = lambda w, path, k: (
        commits.append(path.shape[0]),
        graph_commit(w, path, k),
    )
    outs = llm.generate(prompts, FUSED_PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    # accept lengths depend on the drafter's context KV, which the commit (graph path) writes
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in ref]
    assert mean_accept(outs) > 2
    assert commits and any(b not in batch_buckets(4) for b in commits), (
        "no padded commit through the graph path"
    )
    drafts = [e for e in log if e[0] == "draft"]
    assert drafts and any(b not in batch_buckets(4) for _, b, _, _ in drafts), (
        "no padded fused replay"
    )
    assert any(limited for _, _, limited, _ in drafts), "no round with per-request depth limits"
    if algorithm == "DDTREE":
        assert any(mixed for _, _, _, mixed in drafts), "no round with per-request budgets"
    assert any(e[0] == "accept" for e in log), "the in-graph accept walk never ran"


def test_fused_check_catches_dropped_depth_limits(toy_pair, one_torch_thread):
    """Control: a graph that ignores the per-request depth limits is caught by the tree comparison."""
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=8, max_running_requests=8)
    attach_graphs(llm, 4)
    _check_rounds(llm, [], drop_limits=True)
    llm.engine.faults.raise_errors = True  # the check's failure, not a request isolated from it
    with pytest.raises(AssertionError, match="tokens|parents|depths|valid|tree_mask"):
        llm.generate([list(p) for p in accepted_prompts(3)], [FUSED_PARAMS[i] for i in (0, 3, 4)])


@pytest.mark.parametrize("case", ["sampling", "override"])
def test_graph_path_with_sampling_or_override_gives_plain_tokens(toy_pair, one_torch_thread, case):
    """Sampled requests (eager sampling from the graph's logits) and the bench decoder's override
    (forced accept lengths, eager walk) give the plain path's tokens."""
    from ddtree.bench.bench_decoder import BenchDecoder
    from ddtree.bench.forced_accept import AcceptTrace

    if case == "sampling":
        params = [
            SamplingParams(temperature=t, max_tokens=14, ignore_eos=True, seed=s, top_p=0.9)
            for t, s in ((0, None), (0.8, 1), (0, None), (1.0, 2))
        ]
    else:
        params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)] * 4
    prompts = [list(p) for p in accepted_prompts(4)]
    outs = []
    for graphs in (False, True):
        llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=8, max_running_requests=8)
        if graphs:
            attach_graphs(llm, 4)
            log = []
            _check_rounds(llm, log)
        if case == "override":
            eng = llm.engine
            trace = AcceptTrace([2, 1, 4], eng.runner.device)
            eng.decoder = BenchDecoder(eng.runner, eng.decoder.cfg, override=trace)
        got = llm.generate(prompts, params)
        outs.append([(o.token_ids, o.accept_lengths) for o in got])
    assert outs[0] == outs[1]
    if case == "sampling":  # (the override forces its own accept lengths)
        assert mean_accept(got) > 2
    assert any(e[0] == "draft" for e in log)


def _slide(llm, window: int):
    """The toy drafter's layers made sliding-window layers (causal in-block, z-lab semantics)."""
    import dataclasses

    d = llm.engine.runner.drafter
    n = d.config.num_hidden_layers
    d.config = dataclasses.replace(
        d.config, layer_types=("sliding_attention",) * n, sliding_window=window
    )


def test_sliding_window_drafter_runs_the_draft_graph(toy_pair, one_torch_thread):
    """A drafter with sliding-window layers is graph-capturable (the window is masked in the kernel):
    the padded draft-graph path gives the eager path's tokens and accept lengths, and the window acts
    (accept lengths differ from the full-attention drafter's)."""
    from ddtree.engine.graphs.runner import _draft_capturable

    prompts, params = [list(p) for p in accepted_prompts(3)], PARAMS[:3]
    outs = {}
    for name, window, graphs in (("full", None, False), ("eager", 3, False), ("graph", 3, True)):
        llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=8, max_running_requests=8)
        if window:
            _slide(llm, window)
            assert _draft_capturable(llm.engine.runner) is None
        if graphs:
            g = attach_graphs(llm, 4)
            calls = []
            for gs in g.draft_sets.values():
                gs.run = _recording(gs.run, calls, "draft")
        got = llm.generate(prompts, params)
        outs[name] = [(o.token_ids, o.accept_lengths) for o in got]
        if name == "full":  # a 3-token window accepts less, by design
            assert mean_accept(got) > 2
    assert calls, "the draft graph never ran"
    assert outs["graph"] == outs["eager"]
    assert [t for t, _ in outs["eager"]] == [t for t, _ in outs["full"]]  # lossless either way
    assert [a for _, a in outs["eager"]] != [a for _, a in outs["full"]], "the window did not act"
