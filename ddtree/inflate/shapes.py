"""Target shapes for `ddtree inflate --shape`: the named production shapes, or an HF config.json
file.

A shape is (target keys, drafter keys). The target keys are HF `config.json` keys (a VLM file's
`text_config` is read); a file may carry a `"drafter"` object with DFlash keys (`num_hidden_layers`,
`num_attention_heads`, `num_key_value_heads`, `head_dim`, `intermediate_size`, `num_taps`,
`layer_types`, `sliding_window`), else the drafter takes the target's attention and MLP geometry
with 5 layers and 5 taps.
"""

from __future__ import annotations

import json


class InflateError(ValueError):
    """A shape the source pair cannot be widened into; the message names the key and the fix."""


QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
}
QWEN3_8B_DRAFTER = {
    "num_hidden_layers": 5,
    "num_taps": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
}
# Qwen3.6-27B's text model (its config.json): 48 Gated DeltaNet + 16 gated attention layers.
QWEN36_27B = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "intermediate_size": 17408,
    "vocab_size": 248320,
    "full_attention_interval": 4,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "attn_output_gate": True,
}
# Qwen3.6-27B-DFlash: 4 sliding-window (2048) layers + 1 full layer.
QWEN36_27B_DRAFTER = {
    "num_hidden_layers": 5,
    "num_taps": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 17408,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "sliding_window": 2048,
}

NAMED = {"qwen3-8b": (QWEN3_8B, QWEN3_8B_DRAFTER), "qwen3.6-27b": (QWEN36_27B, QWEN36_27B_DRAFTER)}
TARGET_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)
HYBRID_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def is_hybrid(target: dict) -> bool:
    types = target.get("layer_types") or ()
    return "linear_attention" in types or bool(
        target.get("full_attention_interval") and target.get("linear_num_value_heads")
    )


def resolve_shape(shape: str | dict) -> tuple[dict, dict]:
    """(target keys, drafter keys) of a named shape, a JSON file path or an already-parsed dict."""
    if isinstance(shape, str) and shape in NAMED:
        target, drafter = NAMED[shape]
        return dict(target), dict(drafter)
    if isinstance(shape, str):
        try:
            with open(shape, encoding="utf-8") as f:
                shape = json.load(f)
        except (OSError, ValueError) as e:
            raise InflateError(
                f"--shape {shape!r}: not one of {sorted(NAMED)} and not a readable JSON file ({e})"
            ) from e
    shape = dict(shape)
    drafter = dict(shape.pop("drafter", None) or {})
    target = dict(shape.get("text_config") or shape)
    missing = [k for k in TARGET_KEYS if k not in target]
    if is_hybrid(target):
        missing += [k for k in HYBRID_KEYS if k not in target]
    if missing:
        raise InflateError(
            f"--shape: missing {missing} (HF config.json keys; hybrids also need layer_types or "
            f"full_attention_interval)"
        )
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        drafter.setdefault(key, target[key])
    drafter.setdefault("num_hidden_layers", 5)
    drafter.setdefault("num_taps", 5)
    return target, drafter
