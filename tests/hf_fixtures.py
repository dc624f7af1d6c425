"""Tiny random HF-format checkpoints written by transformers itself (the test oracle)."""

from __future__ import annotations

import torch


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        eos_token_id=1,
        bos_token_id=0,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def save_hf_qwen3(path, seed=0, max_shard_size=None, dtype=torch.float32, **overrides):
    """Random-weight `Qwen3ForCausalLM` saved with HF's own `save_pretrained`; returns the HF model."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_qwen3_config(**overrides)
    model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # non-trivial norm weights so a missing norm shows up in parity
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return model
