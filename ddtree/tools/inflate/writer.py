"""Writing an inflated pair as two ordinary HF model directories: sharded safetensors + config.json,
and the source target's tokenizer, chat template and generation config beside the target."""

from __future__ import annotations

import os
import shutil

from torch import nn

from ddtree.models.loader import save_model

SHARD_BYTES = 5 << 30  # HF's default shard size
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def write_model(module: nn.Module, path: str, config: dict, shard_bytes: int = SHARD_BYTES) -> None:
    """An FP8 model (`models/quant.py`) is written in Qwen's block-FP8 checkpoint layout, its
    config with the matching `quantization_config` (written by `fp8_pair`)."""
    from ddtree.models.quant import checkpoint_state

    save_model(
        module, path, config, max_shard_bytes=shard_bytes, state_dict=checkpoint_state(module)
    )


def copy_tokenizer(src_dir: str, dst_dir: str) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(dst_dir, name))
            copied.append(name)
    return copied
