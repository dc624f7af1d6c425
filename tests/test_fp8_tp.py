"""Tensor parallelism shards a block-FP8 checkpoint's scales with its weights: the toy pairs written in
Qwen's FP8 layout with [16, 32] blocks (their widths split over 2 ranks in whole blocks; Qwen's
[128, 128] would cut the toys' 64-wide layers, which is refused) load on each rank as exactly its
slices of the FP8 weights and the matching blocks of their scales, and TP=2 over gloo emits TP=1's
tokens at T=0 (DDTREE, dense and hybrid; drafts accepted). ~45 s."""

from __future__ import annotations

import os

import pytest
import torch
from engine_utils import GREEDY, accepted_prompts, make_llm, mean_accept
from fp8_fixtures import write_fp8_checkpoint
from safetensors.torch import load_file

from ddtree.config import ServerArgs, resolve_server_args
from ddtree.models import checkpoint as ckpt
from ddtree.models.configs import ConfigError, DrafterConfig, TargetConfig
from ddtree.models.loader import load_drafter, load_target
from ddtree.models.parallel import TPGroup
from ddtree.models.tp_layout import ShardMap

BLOCK = (16, 32)
PROMPTS = [list(p) for p in accepted_prompts(3)]


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def fp8_pair(request, toy_pair, toy_hybrid_pair, tmp_path_factory):
    t, d = toy_pair if request.param == "dense" else toy_hybrid_pair
    root = tmp_path_factory.mktemp(f"fp8_tp_{request.param}")
    return (
        write_fp8_checkpoint(t, str(root / "target"), BLOCK),
        write_fp8_checkpoint(d, str(root / "drafter"), BLOCK),
    )


def test_each_rank_loads_its_weight_slices_and_their_scale_blocks(fp8_pair):
    for path, cfg, load, rename in (
        (
            fp8_pair[0],
            TargetConfig.from_path(fp8_pair[0]),
            load_target,
            ckpt.target_rename("model."),
        ),
        (
            fp8_pair[1],
            DrafterConfig.from_path(fp8_pair[1]),
            lambda p, tp: load_drafter(p, torch.float32, tp=tp),
            ckpt.drafter_rename,
        ),
    ):
        stored = load_file(os.path.join(path, "model.safetensors"))
        ranks = [load(path, tp=TPGroup(r, 2)).state_dict() for r in range(2)]
        checked = 0
        for key, w in stored.items():
            if w.dtype != torch.float8_e4m3fn:
                continue
            name = rename(key)
            scale = stored[key[: -len(".weight")] + ".weight_scale_inv"]
            for r, state in enumerate(ranks):
                pieces = ShardMap(cfg, 2, r).pieces(name) or [(0, 0, w.shape[0])]
                dim = pieces[0][0]
                want_w = torch.cat([w.narrow(dim, a, b - a) for _, a, b in pieces], dim)
                b = BLOCK[dim]
                want_s = torch.cat(
                    [scale.narrow(dim, a // b, -(-(z - a) // b)) for _, a, z in pieces], dim
                )
                got_s = state[name + "_scale_inv"]
                if got_s.shape[0] != want_s.shape[0]:  # a fused projection's per-row scales
                    got_s = got_s[:: BLOCK[0]]
                assert torch.equal(state[name].view(torch.uint8), want_w.view(torch.uint8)), (
                    key,
                    r,
                )
                assert torch.equal(got_s, want_s.float()), (key, r)
                checked += 1
        assert checked > 10


def test_tp2_fp8_matches_tp1(fp8_pair, one_torch_thread):
    """DDTREE (its prefill, verify and draft forwards all sharded) at TP=2 emits TP=1's tokens."""
    outs = {}
    for tp in (1, 2):
        llm = make_llm(fp8_pair, "DDTREE", tp_size=tp, random_seed=7, speculative_ddtree_budget=6)
        try:
            outs[tp] = llm.generate(PROMPTS, GREEDY)
        finally:
            llm.engine.shutdown()
    assert [o.token_ids for o in outs[2]] == [o.token_ids for o in outs[1]]
    assert mean_accept(outs[2]) > 2


def test_quantizing_at_load_refuses_a_tp_that_cuts_its_blocks(toy_pair):
    """--quantization fp8 quantizes in Qwen's 128 x 128 blocks: the toy's 64-wide layers do not split."""
    with pytest.raises(ConfigError, match=r"--tp-size 2 cuts the FP8 weight blocks \[128, 128\]"):
        resolve_server_args(
            ServerArgs(model_path=toy_pair[0], device="cpu", tp_size=2, quantization="fp8")
        )
