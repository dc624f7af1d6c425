"""DFlash2 checkpoints in z-lab's public layout: our module has the public header's tensor names and
shapes, a small random-weight directory in that layout loads (both codebook spellings), and every
wrong DFlash2 field is refused before a weight is read, naming the field."""

import json

import pytest
import torch
from dflash2_fixtures import (
    header_names,
    public_config,
    public_header,
    save_public_dflash2,
)
from hf_fixtures import save_hf_qwen3
from safetensors.torch import load_file

from ddtree.models.configs import ConfigError, DrafterConfig
from ddtree.models.dflash2 import DFlash2Drafter
from ddtree.models.loader import load_drafter


def test_module_has_the_public_layout():
    """Built at the public config's full shape (meta tensors: no memory), the state dict is the
    public header: same names, same shapes."""
    cfg = DrafterConfig.from_dict(public_config())
    assert cfg.is_dflash2 and cfg.problems() == []
    assert (cfg.conv_kernel_size, cfg.conv_group_size) == (2, 16)
    assert (cfg.selector_rank, cfg.selector_top_k, cfg.block_size) == (256, 16, 16)
    assert cfg.final_logit_softcapping == 20.0 and cfg.output_multiplier == pytest.approx(0.196116)
    with torch.device("meta"):
        model = DFlash2Drafter(cfg)
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: v["shape"] for k, v in public_header().items()}
    assert ours == theirs


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dflash2_target")
    save_hf_qwen3(path, num_hidden_layers=3)
    return path


@pytest.mark.parametrize("weight_suffix", [False, True])
def test_small_public_directory_loads(target_dir, tmp_path, weight_suffix):
    cfg = save_public_dflash2(target_dir, tmp_path / "d", weight_suffix=weight_suffix)
    assert set(public_config()) == set(cfg)  # every public config field, none invented
    assert set(public_config()["dflash_config"]) == set(cfg["dflash_config"])
    written = load_file(str(tmp_path / "d" / "model.safetensors"))
    names = {k.removesuffix(".weight") if "codebook" in k else k for k in written}
    assert names == header_names(cfg["num_hidden_layers"])
    drafter = load_drafter(str(tmp_path / "d"), torch.float32)
    assert isinstance(drafter, DFlash2Drafter)
    state = drafter.state_dict()
    for key, t in written.items():
        name = key.removesuffix(".weight") if "codebook" in key else key
        torch.testing.assert_close(state[name], t, rtol=0, atol=0)


BAD = [
    ("selector_rank", None, "selector_rank is missing"),
    ("selector_top_k", 0, "selector_top_k is missing or not a positive integer"),
    ("selector_top_k", 1000, "selector_top_k 1000 exceeds vocab_size"),
    ("conv_kernel_size", 1.5, "conv_kernel_size is missing"),
    ("conv_kernel_size", 9, "conv_kernel_size 9 exceeds block_size"),
    ("conv_group_size", 24, "conv_group_size 24 does not divide hidden_size"),
]


@pytest.mark.parametrize("field,value,message", BAD)
def test_bad_field_is_refused_before_weights(target_dir, tmp_path, field, value, message):
    cfg = save_public_dflash2(target_dir, tmp_path / "d")
    if value is None:
        del cfg["dflash_config"][field]
    else:
        cfg["dflash_config"][field] = value
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "d" / "model.safetensors").unlink()  # refused before any weight file is opened
    with pytest.raises(ConfigError, match=message):
        load_drafter(str(tmp_path / "d"), torch.float32)


def test_dflash2_fields_on_a_dflash_checkpoint_are_refused(target_dir, tmp_path):
    cfg = save_public_dflash2(target_dir, tmp_path / "d")
    cfg["architectures"] = ["DFlashDraftModel"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="selector_rank is a DFlash2 field"):
        load_drafter(str(tmp_path / "d"), torch.float32)


def test_server_args_name_the_flag_and_field(target_dir, tmp_path):
    """The serving path refuses the same configs in its one ConfigError, naming the flag."""
    from ddtree.config import ServerArgs, resolve_server_args

    cfg = save_public_dflash2(target_dir, tmp_path / "d")
    cfg["dflash_config"]["conv_group_size"] = 24
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    args = ServerArgs(
        model_path=str(target_dir),
        speculative_draft_model_path=str(tmp_path / "d"),
        speculative_algorithm="DFLASH",
        device="cpu",
    )
    with pytest.raises(ConfigError) as err:
        resolve_server_args(args)
    text = str(err.value)
    assert "--speculative-draft-model-path" in text and "conv_group_size 24" in text


def test_memory_plan_counts_the_public_checkpoint():
    """The memory plan's drafter parameter count is the public checkpoint's tensor sizes."""
    from ddtree.models.configs import drafter_param_count

    n = 0
    for v in public_header().values():
        n += torch.Size(v["shape"]).numel()
    assert drafter_param_count(DrafterConfig.from_dict(public_config())) == n
