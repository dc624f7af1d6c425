"""Tiny random hybrid Qwen3.5 checkpoints written by transformers itself (the test oracle): the text-only
`Qwen3_5ForCausalLM` layout and the VLM `Qwen3_5ForConditionalGeneration` layout."""

from __future__ import annotations

import torch

VOCAB = 97
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def tiny_qwen3_5_text_config(**overrides):
    from transformers import Qwen3_5TextConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        layer_types=list(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        eos_token_id=1,
        bos_token_id=0,
        initializer_range=0.08,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def _randomize(model, seed: int) -> None:
    """Non-trivial norms and slow decays, so a missing norm or a dropped state shows up in parity."""
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # plain weight (gated norm)
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:  # (1 + weight) norms
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 0.5, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) - 1.0)


def save_hf_qwen3_5(path, seed=0, dtype=torch.float32, **overrides):
    """Random-weight text-only `Qwen3_5ForCausalLM` saved with `save_pretrained`; returns the HF model."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(tiny_qwen3_5_text_config(**overrides)).to(dtype).eval()
    _randomize(model, seed)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def save_hf_qwen3_5_vlm(path, seed=0, dtype=torch.float32, **overrides):
    """Random-weight `Qwen3_5ForConditionalGeneration` (tiny vision tower) saved with `save_pretrained`."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_qwen3_5_text_config(**overrides)
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text.hidden_size,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=16,
    )
    cfg = Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=vision,
        image_token_id=90,
        video_token_id=91,
        vision_start_token_id=92,
        vision_end_token_id=93,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).to(dtype).eval()
    _randomize(model, seed)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [T, V] of a HF model (text or VLM) for one sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()
