"""`ddtree.tools.inflate`: the widened pair computes the small pair's function (fp32, tiny shapes)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from inflate_fixtures import SRC_VOCAB, shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def small():
    from ddtree.assets import default_model_paths
    from ddtree.models.loader import load_drafter, load_target

    t, d = default_model_paths()
    return t, d, load_target(t, torch.float32), load_drafter(d, torch.float32)


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def pair(request, small):
    from ddtree.tools.inflate import inflate_pair

    return request.param, inflate_pair(
        small[0], small[1], shape(request.param), dtype=torch.float32
    )


def _ids(n=2, t=48, seed=0):
    return torch.randint(3, SRC_VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


def max_rel(a, b) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


@torch.no_grad()
def test_target_logits_equal_small(small, pair):
    kind, p = pair
    ids = _ids()
    ref, _ = small[2].forward_train(ids)
    big, _ = p.target.forward_train(ids)
    assert type(p.target).__name__ == (
        "Qwen3_5ForCausalLM" if kind == "hybrid" else "Qwen3ForCausalLM"
    )
    assert max_rel(big[..., :SRC_VOCAB], ref) <= 1e-5
    # padded rows: far below every real logit, and exactly zero probability even at T = 5
    assert float(big[..., SRC_VOCAB:].max()) < float(ref.min()) - 1e3
    assert float(torch.softmax(big / 5.0, -1)[..., SRC_VOCAB:].max()) == 0.0


@torch.no_grad()
def test_the_check_can_fail(small, pair):
    """Meta-test: one flipped weight in the widened target is seen."""
    _, p = pair
    ids = _ids(1, 16)
    ref, _ = small[2].forward_train(ids)
    w = p.target.model.layers[p.carriers[2]].mlp.down_proj.weight
    saved = w[0, 0].item()
    w[0, 0] += 0.05
    try:
        big, _ = p.target.forward_train(ids)
        assert max_rel(big[..., :SRC_VOCAB], ref) > 1e-5
    finally:
        w[0, 0] = saved


@torch.no_grad()
def test_drafter_proposals_equal_small(small, pair):
    """Same taps (via the carriers), same block embeddings -> same drafter logits (real vocab)."""
    _, p = pair
    t_small, d_small = small[2], small[3]
    ids = _ids(1, 40, seed=1)
    _, taps_s = t_small.forward_train(ids, d_small.config.target_layer_ids)
    _, taps_b = p.target.forward_train(ids, p.drafter.config.target_layer_ids)
    S = d_small.config.block_size
    anchors = torch.tensor([[5, 17, 30]])
    block = torch.full((1, 3, S), d_small.config.mask_token_id)
    block[..., 0] = ids[0, anchors[0]]
    ref = d_small.logits(
        d_small.forward_train(taps_s, t_small.embed_tokens(block), anchors), t_small.lm_head
    )
    big = p.drafter.logits(
        p.drafter.forward_train(taps_b, p.target.embed_tokens(block), anchors), p.target.lm_head
    )
    assert max_rel(big[..., :SRC_VOCAB], ref) <= 1e-5
    assert torch.equal(big.argmax(-1), ref.argmax(-1))
    assert torch.equal(big.topk(8, -1).indices, ref.topk(8, -1).indices)


def test_taps_sit_on_carriers(small, pair):
    _, p = pair
    ids = set(p.drafter.config.target_layer_ids)
    assert {p.carriers[i] for i in small[3].config.target_layer_ids} <= ids
    assert len(ids) == shape(pair[0])["drafter"]["num_taps"]


def test_shape_too_small_is_refused(small):
    from ddtree.tools.inflate import InflateError, inflate_pair

    bad = shape("dense")
    bad["num_key_value_heads"] = 1
    with pytest.raises(InflateError, match="num_key_value_heads"):
        inflate_pair(small[0], small[1], bad, dtype=torch.float32)
    bad = shape("dense")
    bad["hidden_size"] = 256
    with pytest.raises(InflateError, match="hidden_size"):
        inflate_pair(small[0], small[1], bad, dtype=torch.float32)


def test_named_shapes_resolve():
    from ddtree.models.configs import TargetConfig
    from ddtree.models.shapes import resolve_shape

    t8, d8 = resolve_shape("qwen3-8b")
    assert (
        t8["hidden_size"],
        t8["num_hidden_layers"],
        t8["vocab_size"],
        d8["num_hidden_layers"],
    ) == (4096, 36, 151936, 5)
    t27, d27 = resolve_shape("qwen3.6-27b")
    cfg = TargetConfig.from_dict(t27)
    assert cfg.is_hybrid and len(cfg.linear_layer_ids) == 48 and len(cfg.attention_layer_ids) == 16
    assert d27["layer_types"].count("sliding_attention") == 4


def test_written_pair_loads_and_matches(small, pair, tmp_path):
    """OUT/target and OUT/drafter: sharded safetensors, config, tokenizer + chat template; our
    loader reads them back to the same function."""
    from ddtree.models.loader import load_drafter, load_target
    from ddtree.tools.inflate import write_pair

    kind, p = pair
    tdir, ddir = write_pair(p, str(tmp_path / "out"), shard_bytes=8 << 20)
    assert os.path.exists(os.path.join(tdir, "model.safetensors.index.json"))
    for f in ("tokenizer.json", "chat_template.jinja", "config.json"):
        assert os.path.exists(os.path.join(tdir, f))
    with open(os.path.join(ddir, "config.json")) as f:
        assert json.load(f)["dflash_config"]["target_layer_ids"] == list(
            p.drafter.config.target_layer_ids
        )
    target = load_target(tdir, torch.float32)
    load_drafter(ddir, torch.float32)
    ids = _ids(1, 24, seed=2)
    with torch.no_grad():
        assert (
            max_rel(target.forward_train(ids)[0][..., :SRC_VOCAB], small[2].forward_train(ids)[0])
            <= 1e-5
        )
    if kind == "dense":  # transformers reads the dense target as an ordinary Qwen3ForCausalLM
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = hf(ids).logits
        assert max_rel(logits[..., :SRC_VOCAB], small[2].forward_train(ids)[0]) <= 1e-5
