"""DFlash2 drafters in z-lab's public layout at small shapes (random weights, for loading and parity).

`tests/fixtures/dflash2-config.json` and `dflash2-safetensors-header.json` are z-lab/dflash's own
fixtures (a released DFlash2DraftModel's config.json and safetensors header; README there). A small
directory keeps every config field of the public config and writes tensors under the header's key
names (the codebooks bare, without `.weight`), with the shapes scaled down."""

from __future__ import annotations

import json
import os
import pathlib
import re

import torch
from safetensors.torch import save_file

from ddtree.models.configs import DrafterConfig
from ddtree.models.dflash2 import DFlash2Drafter

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


def public_config() -> dict:
    return json.loads((FIXTURES / "dflash2-config.json").read_text())


def public_header() -> dict:
    return json.loads((FIXTURES / "dflash2-safetensors-header.json").read_text())


def header_names(num_layers: int) -> set[str]:
    """The public header's tensor names for a drafter of `num_layers` layers."""
    names = set()
    for key in public_header():
        m = re.match(r"layers\.(\d+)\.(.*)", key)
        if m is None:
            names.add(key)
        elif int(m.group(1)) == 0:
            names.update(f"layers.{i}.{m.group(2)}" for i in range(num_layers))
    return names


def small_config(target_dir, num_layers=2, rank=8, block_size=8, taps=None, **dflash) -> dict:
    """The public config with a small target's geometry; every other field (softcap, output
    multiplier, sliding layers, is_causal, conv and selector fields) kept."""
    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    cfg = public_config()
    cfg.update(
        hidden_size=t["hidden_size"],
        intermediate_size=t["intermediate_size"],
        num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"],
        vocab_size=t["vocab_size"],
        num_hidden_layers=num_layers,
        max_window_layers=num_layers,
        num_target_layers=t["num_hidden_layers"],
        layer_types=["sliding_attention"] * num_layers,
        rope_parameters={"rope_theta": t.get("rope_theta", 10000.0), "rope_type": "default"},
        max_position_embeddings=t.get("max_position_embeddings", 512),
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        dtype="float32",
    )
    n = t["num_hidden_layers"]
    cfg["dflash_config"].update(
        block_size=block_size,
        mask_token_id=t["vocab_size"] - 1,
        selector_rank=rank,
        target_layer_ids=list(taps if taps is not None else range(min(n, 3))),
        **dflash,
    )
    return cfg


def random_weights(model: DFlash2Drafter, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights large enough that the convolutions and the selector change what is drafted."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        if "norm" in name:
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif name.endswith("base_kernel"):
            t = 0.5 * torch.randn(p.shape, generator=g)
            t[:, 0] += 1.0  # near identity, as trained convolutions start
        elif "codebook" in name:
            t = 0.6 * torch.randn(p.shape, generator=g)
        elif "kernel_projection" in name:
            t = 0.1 * torch.randn(p.shape, generator=g)
        else:
            t = 0.08 * torch.randn(p.shape, generator=g)
        out[name] = t.contiguous()
    return out


def save_public_dflash2(target_dir, out_dir, seed=0, weight_suffix=False, **kw) -> dict:
    """A random-weight DFlash2 directory in the public layout; returns the config dict.
    `weight_suffix`: the codebooks as `...codebook.weight` (the other spelling the loader takes)."""
    cfg = small_config(target_dir, **kw)
    with torch.device("meta"):
        model = DFlash2Drafter(DrafterConfig.from_dict(cfg))
    weights = random_weights(model, seed)
    if weight_suffix:
        weights = {k + (".weight" if k.endswith("codebook") else ""): v for k, v in weights.items()}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return cfg
