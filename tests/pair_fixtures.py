"""Random-weight DFlash drafters for a given target directory (no training: for parity and plumbing)."""

from __future__ import annotations

import json
import os

import torch

from ddtree.models.configs import DrafterConfig, default_target_layer_ids
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.loader import save_model


def drafter_config_dict(
    target_dir, num_layers=2, block_size=8, mask_token_id=None, layer_ids=None, **extra
):
    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    n_target = t["num_hidden_layers"]
    ids = (
        list(layer_ids)
        if layer_ids is not None
        else [
            min(i, n_target - 1)
            for i in default_target_layer_ids(n_target, min(num_layers, n_target))
        ]
    )
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_hidden_layers": num_layers,
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t.get("head_dim"),
        "vocab_size": t["vocab_size"],
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "rope_theta": t.get("rope_theta", 10000.0),
        "max_position_embeddings": t.get("max_position_embeddings", 512),
        "num_target_layers": n_target,
        "block_size": block_size,
        "tie_word_embeddings": False,
        "dflash_config": {
            "mask_token_id": t["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
            "target_layer_ids": ids,
        },
        "torch_dtype": "float32",
    }
    cfg.update(extra)
    return cfg


def save_random_drafter(target_dir, out_dir, seed=0, **kw):
    cfg = drafter_config_dict(target_dir, **kw)
    torch.manual_seed(seed)
    model = DFlashDrafter(DrafterConfig.from_dict(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)
    save_model(model, str(out_dir), cfg)
    return model, cfg
