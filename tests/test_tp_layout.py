"""Tensor-parallel layout without processes: the head split (KV replication), the refusals, shard
loading (each rank's slices reassemble the checkpoint) and the per-rank memory plan = what loads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddtree.config.memory_plan import rank_weight_bytes
from ddtree.engine.config import plan_pools
from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.loader import build_target, load_drafter, load_target
from ddtree.models.parallel import TPGroup
from ddtree.models.tp_layout import ShardMap, head_shard, shard_drafter, shard_target, tp_problems


def test_head_shard_divides_or_replicates():
    assert [head_shard(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    # Qwen3.6-27B's 4 KV heads at tp 8: ranks 2k and 2k+1 share KV head k
    assert [head_shard(4, 8, r)[0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError):
        head_shard(4, 3, 0)


def test_tp_problems_replicate_kv_heads_and_refuse_the_rest(target_27b):
    assert tp_problems(8, target_27b, None) == []  # the deployment issue 23 names
    (msg,) = tp_problems(3, target_27b, None)
    assert "--tp-size 3" in msg and "target intermediate size (17408)" in msg
    assert "KV heads (4" in msg and "valid --tp-size values: [1, 2, 4, 8]" in msg


@pytest.fixture
def target_27b():
    from ddtree.models.shapes import QWEN36_27B

    return TargetConfig.from_dict(QWEN36_27B)


def drafter_27b(t: TargetConfig) -> DrafterConfig:
    from ddtree.models.shapes import QWEN36_27B_DRAFTER

    keys = {k: v for k, v in QWEN36_27B_DRAFTER.items() if k != "num_taps"}
    ids = [1, 16, 31, 46, 61]
    return DrafterConfig.from_dict(
        {**keys, "architectures": ["DFlashDraftModel"], "hidden_size": t.hidden_size}
        | {"vocab_size": t.vocab_size, "dflash_config": {"target_layer_ids": ids}}
    )


def _reassemble(full: dict, shards: list[dict], maps: list[ShardMap]) -> None:
    """Every rank's tensor is its slices of the checkpoint; together they cover it."""
    for name, t in full.items():
        pieces = maps[0].pieces(name)
        if pieces is None:
            for s in shards:
                assert torch.equal(s[name], t), name
            continue
        dim = pieces[0][0]
        seen = torch.zeros(t.shape[dim], dtype=torch.bool)
        for s, m in zip(shards, maps):
            got = s[name]
            at = 0
            for _, start, stop in m.pieces(name):
                n = stop - start
                assert torch.equal(got.narrow(dim, at, n), t.narrow(dim, start, n)), name
                seen[start:stop] = True
                at += n
            assert got.shape[dim] == at + m.vocab_pad(name), name
        assert seen.all(), name


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_load_reassembles_the_checkpoint(toy_pair, toy_hybrid_pair, tp):
    for (tpath, dpath), hybrid in ((toy_pair, False), (toy_hybrid_pair, True)):
        tcfg, dcfg = TargetConfig.from_path(tpath), DrafterConfig.from_path(dpath)
        if tp_problems(tp, tcfg, dcfg):
            continue
        for path, load, cfg in (
            (tpath, lambda r: load_target(tpath, torch.float32, tp=TPGroup(r, tp)), tcfg),
            (dpath, lambda r: load_drafter(dpath, torch.float32, tp=TPGroup(r, tp)), dcfg),
        ):
            full = (
                load_target(path, torch.float32)
                if cfg is tcfg
                else load_drafter(path, torch.float32)
            ).state_dict()
            shards = [load(r).state_dict() for r in range(tp)]
            _reassemble(full, shards, [ShardMap(cfg, tp, r) for r in range(tp)])


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_rank_weight_bytes_are_what_a_rank_builds(target_27b, tp):
    """check-config's per-rank weights = the parameters of the model a rank really builds."""
    drafter = drafter_27b(target_27b)
    with torch.device("meta"):
        model = build_target(shard_target(target_27b, tp), TPGroup(0, tp))
        draft = DFlashDrafter(shard_drafter(drafter, tp), TPGroup(0, tp))
    built = {id(p): p for m in (model, draft) for p in m.parameters()}
    n = sum(p.numel() for p in built.values()) * 2
    assert rank_weight_bytes(target_27b, drafter, tp, "bfloat16") == n


def test_pools_plan_local_kv_heads(toy_pair):
    """Per-rank KV: local heads; tp 4 over 2 KV heads keeps one (replicated) head per rank."""
    from ddtree.config import ServerArgs, resolve_server_args

    target, drafter = toy_pair
    args = resolve_server_args(
        ServerArgs(
            model_path=target,
            speculative_algorithm="DDTREE",
            speculative_draft_model_path=drafter,
            device="cpu",
            dtype="float32",
        )
    )
    per_token = {
        tp: plan_pools(dataclasses.replace(args, tp_size=tp), 2**34, 0, "cpu").kv_bytes_per_token
        for tp in (1, 2, 4)
    }
    assert per_token[2] * 2 == per_token[1] and per_token[4] == per_token[2]
