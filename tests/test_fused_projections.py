"""Fused q|k|v and gate|up projections keep HF names at the checkpoint boundary: state_dict() shows the parts as
row views of the fused weights, load_state_dict() and the safetensors loader take the parts."""

import torch
from pair_fixtures import drafter_config_dict

from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.loader import load_drafter, load_target, save_model
from ddtree.models.qwen3 import Qwen3ForCausalLM
from ddtree.tools.train.lm import qwen3_config


def tiny_target():
    torch.manual_seed(0)
    cfg = qwen3_config(97, num_layers=3)
    return Qwen3ForCausalLM(TargetConfig.from_dict(cfg)), cfg


def test_state_dict_has_hf_names_as_views_of_the_fused_weights():
    model, _ = tiny_target()
    sd = model.state_dict()
    names = set(sd)
    for part in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{part}.weight" in names
    for part in ("gate_proj", "up_proj"):
        assert f"model.layers.1.mlp.{part}.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv = attn.qkv_proj.weight
    q, k, v = (sd[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj"))
    assert q.shape == (attn.q_size, qkv.shape[1]) and k.shape == v.shape == (
        attn.kv_size,
        qkv.shape[1],
    )
    assert q.data_ptr() == qkv.data_ptr()  # views, no copy
    torch.testing.assert_close(torch.cat([q, k, v]), qkv.detach(), rtol=0, atol=0)
    gate, up = sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]
    torch.testing.assert_close(
        torch.cat([gate, up]), mlp.gate_up_proj.weight.detach(), rtol=0, atol=0
    )
    # bytes counted once: the parts add up to the fused parameters
    assert sum(t.numel() for t in sd.values()) == sum(p.numel() for p in model.parameters())


def test_load_state_dict_round_trip_and_strictness():
    model, cfg = tiny_target()
    other = Qwen3ForCausalLM(TargetConfig.from_dict(cfg))
    # strict: HF part names concatenate into the fused weights
    other.load_state_dict(model.state_dict())
    for (n, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    sd = model.state_dict()
    del sd["model.layers.0.self_attn.k_proj.weight"]
    result = other.load_state_dict(sd, strict=False)
    assert "model.layers.0.self_attn.qkv_proj.weight" in result.missing_keys


def test_save_and_load_checkpoints_with_hf_keys(tmp_path):
    model, cfg = tiny_target()
    save_model(model, str(tmp_path / "t"), cfg, max_shard_bytes=20_000)
    import glob

    from safetensors import safe_open

    keys = set()
    for f in glob.glob(str(tmp_path / "t" / "*.safetensors")):
        with safe_open(f, framework="pt") as fh:
            keys |= set(fh.keys())
    assert (
        "model.layers.2.self_attn.v_proj.weight" in keys
        and "model.layers.2.mlp.up_proj.weight" in keys
    )
    loaded = load_target(str(tmp_path / "t"), torch.float32)
    for (n, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)

    dcfg = drafter_config_dict(str(tmp_path / "t"))
    drafter = DFlashDrafter(DrafterConfig.from_dict(dcfg))
    save_model(drafter, str(tmp_path / "d"), dcfg)
    back = load_drafter(str(tmp_path / "d"), torch.float32)
    for (n, a), (_, b) in zip(drafter.named_parameters(), back.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_loader_reports_a_missing_part(tmp_path):
    model, cfg = tiny_target()
    save_model(model, str(tmp_path), cfg, skip=("model.layers.1.mlp.up_proj",))
    try:
        load_target(str(tmp_path), torch.float32)
    except ValueError as e:
        assert "model.layers.1.mlp.up_proj.weight" in str(e)
    else:
        raise AssertionError("a checkpoint without up_proj loaded")
