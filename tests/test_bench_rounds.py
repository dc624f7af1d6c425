"""`ddtree bench rounds`: the CPU smoke run end to end, the memory-floor byte count, and the forced-acceptance
seam (bench_decoder.BenchDecoder's override) yielding exactly the requested accept lengths and the override's tokens."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ddtree.bench.forced_accept import AcceptTrace, forced_targets
from ddtree.bench.random_pair import SMOKE, build_pair, pair_configs, read_bytes
from ddtree.speculative.accept import accept_tree
from ddtree.speculative.tree import DraftTree

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT = 32


def test_smoke_run_writes_every_config(tmp_path):
    from ddtree.bench.rounds import main

    out = tmp_path / "rounds.json"
    assert (
        main(
            [
                "--smoke",
                "--rounds",
                "2",
                "--budgets",
                "16,64",
                "--accept-lengths",
                "1,16",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    floor = data["floor"]
    assert floor["floor_ms"] > 0 and floor["bandwidth_Bps"] > 0
    assert floor["floor_ms"] == pytest.approx(
        floor["target_read_bytes"] / floor["bandwidth_Bps"] * 1e3
    )
    rows = data["rows"]
    got = {(r["config"], r["batch"], r["forced_accept"]) for r in rows}
    want = {(c, b, None) for c in ("AR", "DFLASH", "DDTREE B=16", "DDTREE B=64") for b in (1, 8)}
    want |= {(c, b, k) for c in ("DFLASH", "DDTREE B=64") for b in (1, 8) for k in (1, 16)}
    assert got == want and len(rows) == len(want)
    for r in rows:
        assert r["context"] == 64 and r["rounds"] == 2
        assert r["ms"] > 0 and r["x_floor"] == pytest.approx(r["ms"] / floor["floor_ms"])
        assert set(r["phases_ms"]) == {"draft", "tree", "verify", "accept", "commit"}
        assert all(v >= 0 for v in r["phases_ms"].values()) and r["phases_ms"]["verify"] > 0
        assert r["verify_tokens"] == r["batch"] * {"AR": 1, "DFLASH": 16}.get(
            r["config"], (r["budget"] or 0) + 1
        )
        if r["config"] == "AR":
            assert r["emitted_max"] == 1 and r["phases_ms"]["draft"] == 0
        if r["forced_accept"] is not None:
            assert r["emitted_min"] == r["emitted_max"] == r["forced_accept"]
        if r["batch"] == 8:
            assert r["vs_batch1"] > 0
    assert (tmp_path / "rounds.png").stat().st_size > 0


def test_read_bytes_counts_layers_and_head_not_embedding():
    tcfg, dcfg = pair_configs(SMOKE, 2, 16, "float32")
    target, _ = build_pair(tcfg, dcfg, "cpu", torch.float32)
    h, i, v, L = tcfg.hidden_size, tcfg.intermediate_size, tcfg.vocab_size, tcfg.num_hidden_layers
    q, kv, d = (
        tcfg.num_attention_heads * tcfg.head_dim,
        tcfg.num_key_value_heads * tcfg.head_dim,
        tcfg.head_dim,
    )
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * d
    assert read_bytes(target) == 4 * (L * per_layer + h + v * h)
    assert all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in target.parameters())


@pytest.fixture(scope="module")
def random_runner():
    from ddtree.bench.rounds import make_parser, prefilled_requests, runner_config
    from ddtree.engine.model_runner import ModelRunner

    tcfg, dcfg = pair_configs(SMOKE, 2, 16, "float32")
    target, drafter = build_pair(tcfg, dcfg, "cpu", torch.float32, seed=1)
    ns = make_parser().parse_args(["--attention-backend", "torch"])
    rcfg = runner_config("DDTREE", 64, 4, CONTEXT, ns, torch.device("cpu"))
    runner = ModelRunner(target, drafter, rcfg, "cpu", torch.float32)
    return runner, prefilled_requests(runner, 4, CONTEXT, tcfg.vocab_size, 4096, seed=2)


def first_child_chain(tree: DraftTree, i: int) -> list[int]:
    """Oracle: root, then repeatedly the lowest-index valid child."""
    parents, valid = tree.parents[i].tolist(), tree.valid[i].tolist()
    chain = [0]
    while True:
        kids = [j for j, p in enumerate(parents) if p == chain[-1] and valid[j]]
        if not kids:
            return chain
        chain.append(kids[0])


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
def test_forced_accept_lengths_and_tokens(random_runner, algorithm):
    from ddtree.bench.bench_decoder import BenchDecoder
    from ddtree.engine.round.decoder import SpecConfig

    runner, reqs = random_runner
    lengths = torch.tensor([1, 3, 9, 16])
    seen = {}

    def override(tree, target_tokens):
        seen["tree"], seen["sampled"] = tree, target_tokens.clone()
        seen["out"] = forced_targets(tree, target_tokens, lengths)
        return seen["out"]

    spec = SpecConfig(algorithm=algorithm, budget=64, topk_cap=64, shadow_linear=True)
    decoder = BenchDecoder(runner, spec, override=override)
    for _ in range(2):
        emitted = decoder.round(reqs, runner.cfg.max_context)
        tree, out = seen["tree"], seen["out"]
        assert [len(e) for e in emitted] == lengths.tolist()
        for i, (r, e) in enumerate(zip(reqs, emitted)):
            chain = first_child_chain(tree, i)[: int(lengths[i])]
            assert e[:-1] == [int(tree.tokens[i, j]) for j in chain[1:]]  # the override's path
            assert e[-1] == int(out[i, chain[-1]])  # its bonus token
            kids = [
                int(tree.tokens[i, j])
                for j in range(tree.num_nodes)
                if int(tree.parents[i, j]) == chain[-1] and bool(tree.valid[i, j])
            ]
            assert e[-1] not in kids
            r.kv_len = CONTEXT
            runner.release(r, CONTEXT)
        # nodes off the path keep the sampled tokens
        off = torch.ones_like(out, dtype=torch.bool)
        for i in range(len(reqs)):
            off[i, first_child_chain(tree, i)[: int(lengths[i])]] = False
        assert torch.equal(out[off], seen["sampled"][off])


def test_forced_bonus_never_extends_the_walk():
    # chain root(5) -> 7 -> 9; the target already draws 7 at the root and 9 at node 1
    tree = DraftTree.from_parents(torch.tensor([[5, 7, 9]]), torch.tensor([[-1, 0, 1]]))
    drawn = torch.tensor([[7, 9, 4]])
    res = accept_tree(tree, forced_targets(tree, drawn, torch.tensor([2])))
    assert res.accept_length.tolist() == [1]
    assert res.out_tokens[0, :2].tolist() == [7, 0]  # bonus replaced by the smallest free id
    res = accept_tree(tree, forced_targets(tree, drawn, torch.tensor([3])))
    assert res.out_tokens[0].tolist() == [7, 9, 4]
    # longer than the chain: stops at the leaf
    assert accept_tree(
        tree, forced_targets(tree, drawn, torch.tensor([16]))
    ).accept_length.tolist() == [2]


def test_accept_trace_cycles():
    tree = DraftTree.from_parents(
        torch.tensor([[5, 7, 9, 11]] * 2), torch.tensor([[-1, 0, 1, 2]] * 2)
    )
    trace = AcceptTrace([2, 4, 1], "cpu")
    got = [
        accept_tree(tree, trace(tree, torch.zeros(2, 4, dtype=torch.int64))).num_out.tolist()
        for _ in range(4)
    ]
    assert got == [[2, 2], [4, 4], [1, 1], [2, 2]]
    with pytest.raises(ValueError):
        AcceptTrace([0], "cpu")


def test_time_budget_skips_configs(tmp_path):
    from ddtree.bench.rounds import main, target_checks

    out = tmp_path / "rounds.json"
    assert (
        main(
            [
                "--smoke",
                "--budgets",
                "64",
                "--accept-lengths",
                "4",
                "--time-budget-s",
                "1e-9",
                "--output",
                str(out),
                "--no-plot",
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 * 2 + 2 * 2 and all(
        r["skipped"] == "time budget" and "ms" not in r for r in rows
    )
    # the targets read the unforced rows
    fake = [
        {
            "context": 1024,
            "config": "AR",
            "batch": 1,
            "forced_accept": None,
            "ms": 4.0,
            "x_floor": 1.2,
        }
    ]
    assert target_checks(fake) == [
        {"context": 1024, "name": "AR b1 x floor", "value": 1.2, "limit": 1.15, "ok": False}
    ]


def test_prefilled_requests_share_the_first_ones_kv(random_runner):
    runner, reqs = random_runner
    pos = torch.arange(CONTEXT)[None]
    slots = [runner.slots_of(runner.bm.block_table[r.slot][None], pos).flatten() for r in reqs]
    assert len({int(s[0]) for s in slots}) == len(reqs)  # distinct pages
    for pool in (runner.kv, runner.draft_kv):
        assert pool.k[:, slots[0]].abs().sum() > 0
        for s in slots[1:]:
            assert torch.equal(pool.k[:, s], pool.k[:, slots[0]]) and torch.equal(
                pool.v[:, s], pool.v[:, slots[0]]
            )


PEER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".peer")


@pytest.mark.skipif(
    not os.path.isdir(PEER), reason="no outside checkout of liranringel/ddtree under .peer/"
)
def test_peer_checkout_is_timed_against_ours(tmp_path):
    from ddtree.bench.rounds import main

    out = tmp_path / "r.json"
    assert (
        main(
            [
                "--smoke",
                "--rounds",
                "2",
                "--budgets",
                "16",
                "--batch-sizes",
                "1",
                "--accept-lengths",
                "",
                "--forced-budget",
                "16",
                "--peer-checkout",
                PEER,
                "--output",
                str(out),
                "--no-plot",
            ]
        )
        == 0
    )
    peer = json.loads(out.read_text())["meta"]["peer"]
    assert (
        peer["ms"] > 0
        and peer["ours_ms"] > 0
        and peer["speedup"] == pytest.approx(peer["ms"] / peer["ours_ms"])
    )


def test_bad_peer_checkout_names_the_flag(tmp_path):
    from ddtree.bench.peer import PeerCheckoutError
    from ddtree.bench.rounds import main

    with pytest.raises(PeerCheckoutError, match="--peer-checkout"):
        main(
            [
                "--smoke",
                "--rounds",
                "1",
                "--budgets",
                "16",
                "--batch-sizes",
                "1",
                "--accept-lengths",
                "",
                "--forced-budget",
                "16",
                "--peer-checkout",
                str(tmp_path / "missing"),
                "--no-plot",
            ]
        )
