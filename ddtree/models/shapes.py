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

from ddtree.models.configs import TargetConfig, default_target_layer_ids

# the reserved ids of the project's own byte-level tokenizers (tools/train/data.py): the defaults
# of the config builders below
BOS_ID, EOS_ID, MASK_ID = 0, 1, 2


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


# ---- config.json dicts of small shapes (random pairs, training) ----------------------------
def qwen3_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    bos_token_id: int = BOS_ID,
    eos_token_id: int = EOS_ID,
    mask_token_id: int | None = MASK_ID,
    torch_dtype: str = "float32",
) -> dict:
    """An HF `Qwen3ForCausalLM` config.json dict. `mask_token_id` is an extra key (ignored by transformers)
    naming the reserved embedding row that `drafter_config_for` picks up as the drafter's MASK."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 3 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "tie_word_embeddings": tie_word_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": bos_token_id,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    if mask_token_id is not None:
        cfg["mask_token_id"] = mask_token_id
    return cfg


def qwen3_5_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 4,
    full_attention_interval: int = 4,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 16,
    linear_value_head_dim: int = 16,
    linear_conv_kernel_dim: int = 4,
    partial_rotary_factor: float = 0.25,
    rope_theta: float = 10000.0,
    **kw,
) -> dict:
    """An HF text-only `Qwen3_5ForCausalLM` config.json dict: every `full_attention_interval`-th layer is gated
    full attention, the others Gated DeltaNet; `kw` as in `qwen3_config`."""
    cfg = qwen3_config(vocab_size, hidden_size, num_layers, **kw)
    for key in (
        "rope_theta",
        "rope_scaling",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
    ):
        cfg.pop(key)
    kinds = [
        "linear_attention" if (i + 1) % full_attention_interval else "full_attention"
        for i in range(num_layers)
    ]
    cfg.update(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        layer_types=kinds,
        full_attention_interval=full_attention_interval,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        linear_conv_kernel_dim=linear_conv_kernel_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rope_theta,
            "partial_rotary_factor": partial_rotary_factor,
        },
    )
    return cfg


# ---------------------------------------------------------------- loop utilities


# z-lab's released DFlash2 geometry (tests/fixtures/dflash2-config.json)
DFLASH2_DEFAULTS = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
}


def drafter_config_for(
    target_cfg: TargetConfig,
    num_layers: int = 5,
    block_size: int = 16,
    mask_token_id: int | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
    torch_dtype: str = "bfloat16",
    architecture: str = "DFlashDraftModel",
    **dflash2,
) -> dict:
    """A z-lab-format DFlash (or, `architecture="DFlash2DraftModel"`, DFlash2: its fields from
    `dflash2` over z-lab's released values `DFLASH2_DEFAULTS`, the top-k clipped to the vocab)
    config.json dict with the target's geometry. Default taps are
    `default_target_layer_ids(L, num_layers)` clipped to [0, L-1] and de-duplicated (tiny targets). The mask id
    defaults to the target config's `mask_token_id` (our own targets reserve one) or else its last vocab row;
    either way it must be a physical row of the target embedding."""
    L = target_cfg.num_hidden_layers
    if target_layer_ids is None:
        ids = [min(max(i, 0), L - 1) for i in default_target_layer_ids(L, num_layers)]
        target_layer_ids = tuple(sorted(set(ids)))
    if any(not 0 <= i < L for i in target_layer_ids):
        raise ValueError(f"target_layer_ids {target_layer_ids} outside 0..{L - 1}")
    if mask_token_id is None:
        mask_token_id = int(target_cfg.raw.get("mask_token_id", target_cfg.vocab_size - 1))
    if not 0 <= mask_token_id < target_cfg.vocab_size:
        raise ValueError(
            f"mask_token_id {mask_token_id} is not a row of the {target_cfg.vocab_size}-row embedding"
        )
    extra = {}
    if architecture == "DFlash2DraftModel":
        extra = {**DFLASH2_DEFAULTS, **dflash2}
        extra["selector_top_k"] = min(extra["selector_top_k"], target_cfg.vocab_size)
    elif dflash2:
        raise ValueError(
            f"{sorted(dflash2)} are DFlash2 fields; pass architecture=DFlash2DraftModel"
        )
    return {
        "architectures": [architecture],
        "model_type": "qwen3",
        "hidden_size": target_cfg.hidden_size,
        "intermediate_size": target_cfg.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": target_cfg.num_attention_heads,
        "num_key_value_heads": target_cfg.num_key_value_heads,
        "head_dim": target_cfg.head_dim,
        "vocab_size": target_cfg.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": target_cfg.rope_theta,
        "rope_scaling": target_cfg.rope_scaling,
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "layer_types": ["full_attention"] * num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "block_size": block_size,
        "num_target_layers": L,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
            "block_size": block_size,
            **extra,
        },
    }
