"""Config-only model directories (config.json + an empty weights placeholder) shaped like real
checkpoints.

Each `*_config(**overrides)` returns a fresh dict; `write_model_dir(root, name, cfg)` writes it and returns the
directory. Overrides with value `DELETE` remove the key.
"""

from __future__ import annotations

import json
import os

DELETE = object()


def _apply(cfg: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        if value is DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def qwen3_8b_config(**overrides) -> dict:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    return _apply(cfg, overrides)


def qwen3_8b_dflash_config(dflash_overrides: dict | None = None, **overrides) -> dict:
    """Qwen3-8B-DFlash-b16: block_size at the top level (the older layout)."""
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16,
        "bos_token_id": 151643,
        "dflash_config": _apply(
            {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
            dflash_overrides or {},
        ),
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "layer_types": ["full_attention"] * 5,
        "max_position_embeddings": 40960,
        "max_window_layers": 5,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 36,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    return _apply(cfg, overrides)


def qwen36_27b_config(text_overrides: dict | None = None, **overrides) -> dict:
    """Qwen3.6-27B in the VLM layout: the text model under `text_config`, 3 GDN : 1 full-attention layers."""
    n_layers = 64
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 17408,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)
        ],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 24,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 248320,
    }
    cfg = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "image_token_id": 248056,
        "model_type": "qwen3_5",
        "text_config": _apply(text, text_overrides or {}),
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": 248057,
        "vision_config": {
            "deepstack_visual_indexes": [],
            "depth": 27,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "in_channels": 3,
            "intermediate_size": 4304,
            "model_type": "qwen3_5",
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "out_hidden_size": 5120,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }
    return _apply(cfg, overrides)


def qwen36_27b_dflash_config(dflash_overrides: dict | None = None, **overrides) -> dict:
    """Qwen3.6-27B-DFlash: 4 sliding (window 2048) + 1 full layer; block_size inside `dflash_config`."""
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "dflash_config": _apply(
            {"block_size": 16, "mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
            dflash_overrides or {},
        ),
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 17408,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "max_position_embeddings": 262144,
        "max_window_layers": 5,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "sliding_window": 2048,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": True,
        "vocab_size": 248320,
    }
    return _apply(cfg, overrides)


def write_model_dir(root, name: str, cfg: dict, weights: bool = True) -> str:
    """With `weights`, an empty `model.safetensors` placeholder too: serving refuses a directory
    without weight files (`models.sources.weight_problems`), and nothing that reads these
    directories loads weights."""
    path = os.path.join(str(root), name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    if weights:
        open(os.path.join(path, "model.safetensors"), "wb").close()
    return path


def dense_pair(root, target: dict | None = None, drafter: dict | None = None) -> tuple[str, str]:
    """(target_dir, drafter_dir) for Qwen3-8B + Qwen3-8B-DFlash-b16."""
    return (
        write_model_dir(root, "Qwen3-8B", target or qwen3_8b_config()),
        write_model_dir(root, "Qwen3-8B-DFlash-b16", drafter or qwen3_8b_dflash_config()),
    )


def hybrid_pair(root, target: dict | None = None, drafter: dict | None = None) -> tuple[str, str]:
    """(target_dir, drafter_dir) for Qwen3.6-27B + Qwen3.6-27B-DFlash."""
    return (
        write_model_dir(root, "Qwen3.6-27B", target or qwen36_27b_config()),
        write_model_dir(root, "Qwen3.6-27B-DFlash", drafter or qwen36_27b_dflash_config()),
    )
