"""scripts/dflash2_carry.py: a DFlash2 drafter trained from the embedded DFlash drafter travels as its
difference from the function-preserving carry and comes back tensor for tensor; a drafter of another
config is refused, naming the fields. ~5 s."""

import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ddtree.assets import default_model_paths
from ddtree.tools.train.selector import dflash2_from_dflash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _carry():
    spec = importlib.util.spec_from_file_location(
        "dflash2_carry", os.path.join(ROOT, "scripts", "dflash2_carry.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pack_unpack_round_trip(tmp_path):
    carry = _carry()
    target, dflash = default_model_paths()
    trained = str(tmp_path / "trained")
    # stands in for a trained drafter: the convolutions and the selector moved off the carry
    dflash2_from_dflash(dflash, target, trained, selector_rank=64, noise=0.05, seed=3)
    carry.pack(trained, str(tmp_path / "carry"))
    delta = load_file(str(tmp_path / "carry" / "delta.safetensors"))
    assert delta and all("conv" in k or "candidate_selector" in k for k in delta)
    carry.unpack(str(tmp_path / "carry"), str(tmp_path / "out"))
    a = load_file(str(tmp_path / "out" / "model.safetensors"))
    b = load_file(os.path.join(trained, "model.safetensors"))
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b)


def test_a_drafter_of_another_config_is_refused(tmp_path):
    carry = _carry()
    target, dflash = default_model_paths()
    other = str(tmp_path / "other")
    dflash2_from_dflash(dflash, target, other, selector_rank=64)
    path = os.path.join(other, "config.json")
    cfg = json.load(open(path))
    cfg["rms_norm_eps"] = 1e-5
    json.dump(cfg, open(path, "w"))
    with pytest.raises(SystemExit, match="rms_norm_eps"):
        carry.pack(other, str(tmp_path / "carry"))
