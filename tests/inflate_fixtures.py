"""Tiny inflation shapes of the embedded pair (12.6M, hidden 384, 6 layers, 6/2 heads of 64, vocab
8192): every axis grows, the vocabulary too, so the constant dim, copied heads, extra layers and
extra taps all take part."""

from __future__ import annotations

import copy

from ddtree.bench.acceptance import DEFAULT_PROMPTS

SRC_VOCAB = 8192

DENSE = {
    "hidden_size": 448,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 1100,
    "vocab_size": 8320,
    "drafter": {
        "num_hidden_layers": 5,
        "num_taps": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 1030,
    },
}
# dense source -> hybrid: 6 real layers on the 6 full-attention slots of 9, partial rotary 64 of 128
HYBRID = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "hidden_size": 448,
    "num_hidden_layers": 9,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 1100,
    "vocab_size": 8320,
    "layer_types": ["linear_attention", "full_attention", "full_attention"] * 3,
    "partial_rotary_factor": 0.5,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "drafter": {
        "num_hidden_layers": 5,
        "num_taps": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 1030,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "sliding_window": 512,
    },
}

# held-out code (`bench acceptance`'s prompts): the embedded pair is trained on stdlib code, so its
# drafts are accepted here (DFLASH 4.2, DDTREE 16 5.1 tokens a round; the prose prompts these
# replace gave 2.1 / 2.8), and the inflated == small comparisons exercise accepted drafts
PROMPTS = DEFAULT_PROMPTS[4:8]


def shape(name: str) -> dict:
    return copy.deepcopy({"dense": DENSE, "hybrid": HYBRID}[name])
