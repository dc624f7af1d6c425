"""The configuration half of an inflation, torch-free: the residual algebra, the layer / tap plan and
the two config.json dicts, from the source pair's configs and the shape alone. `plan_pair` is what
`inflate_pair` builds from and what `--model-path inflate:...` resolves to before any weight
exists (check-config plans it without importing torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.models.shapes import InflateError, is_hybrid, resolve_shape


def spread(n: int, slots: list[int]) -> list[int]:
    """n of `slots`, evenly spaced, first and last included (strictly increasing)."""
    if n > len(slots):
        raise InflateError(f"{n} source layers do not fit {len(slots)} slots")
    if n == 1:
        return [slots[0]]
    return [slots[round(j * (len(slots) - 1) / (n - 1))] for j in range(n)]


@dataclass(frozen=True)
class Residual:
    """The residual stream h -> H: real dims first; with a padded vocabulary, dim `const` holds
    `gamma` in every embedding row and nothing writes it. RMS over H of (x, gamma, 0...) with
    eps_big = (eps h - gamma^2) / H is sqrt(h/H) times the small model's RMS with eps, exactly; real
    norm scales times sqrt(h/H) undo it."""

    small: int
    big: int
    const: int | None
    gamma: float

    @property
    def map(self):
        """Big residual dim -> small dim (-1: zero), a LongTensor."""
        from ddtree.tools.inflate.layout import pad_map  # torch: only where weights are built

        return pad_map(self.small, self.big)

    @property
    def scale(self) -> float:
        return math.sqrt(self.small / self.big)

    def eps(self, eps: float) -> float:
        return (eps * self.small - self.gamma**2) / self.big


def residual_for(h: int, H: int, pad_vocab: bool, eps: float) -> Residual:
    if not pad_vocab:
        return Residual(h, H, None, 0.0)
    if H <= h:
        raise InflateError(
            f"hidden_size {H} must exceed the source's {h} to pad the vocabulary (one constant dim)"
        )
    gamma = 2.0 ** math.floor(math.log2(math.sqrt(eps * h / 2)))  # a power of two: exact in bf16
    return Residual(h, H, h, gamma)


_COPIED_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id")


def target_config(src: TargetConfig, shape: dict, res: Residual, dtype: str) -> dict:
    """config.json of the widened target: the shape's geometry, the source's RoPE, ids and context
    length, and the norm eps of `Residual.eps`; always untied (the padded LM-head rows differ from
    the embedding)."""
    text = src.raw.get("text_config") or src.raw
    cfg = {
        "architectures": ["Qwen3_5ForCausalLM" if is_hybrid(shape) else "Qwen3ForCausalLM"],
        "model_type": "qwen3_5_text" if is_hybrid(shape) else "qwen3",
        **{
            k: int(shape[k])
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
            )
        },
        "hidden_act": "silu",
        "max_position_embeddings": src.max_position_embeddings,
        "rms_norm_eps": res.eps(src.rms_norm_eps),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        **{k: text[k] for k in _COPIED_IDS if k in text},
    }
    if not is_hybrid(shape):
        cfg.update(
            rope_theta=src.rope_theta,
            rope_scaling=None,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=cfg["num_hidden_layers"],
        )
        return cfg
    parsed = TargetConfig.from_dict({**shape, "architectures": ["Qwen3_5ForCausalLM"]})
    cfg.update(
        {
            k: int(shape[k])
            for k in (
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
            )
        }
    )
    cfg.update(
        layer_types=list(parsed.layer_types),
        attn_output_gate=True,
        partial_rotary_factor=parsed.partial_rotary_factor,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": src.rope_theta,
            "partial_rotary_factor": parsed.partial_rotary_factor,
        },
    )
    if "full_attention_interval" in shape:
        cfg["full_attention_interval"] = int(shape["full_attention_interval"])
    return cfg


def check_source(src: TargetConfig) -> None:
    if src.is_hybrid:
        raise InflateError(
            "SRC_TARGET is hybrid: inflate widens a dense Qwen3 source (into a dense or a hybrid "
            "shape); train or pick a dense small target"
        )
    if src.rope_scaling is not None:
        raise InflateError(
            f"SRC_TARGET has rope_scaling {src.rope_scaling}: only plain RoPE keeps its "
            f"frequencies when head dims are spread out"
        )


def layer_plan(src: TargetConfig, cfg: TargetConfig) -> list[int]:
    """Big layer index carrying each source layer: evenly over every layer (dense) or over the
    full-attention layers (hybrid)."""
    slots = list(cfg.attention_layer_ids)
    if src.num_hidden_layers > len(slots):
        kind = "full-attention layers" if cfg.is_hybrid else "num_hidden_layers"
        raise InflateError(
            f"--shape has {len(slots)} {kind}, fewer than the source's {src.num_hidden_layers}"
        )
    return spread(src.num_hidden_layers, slots)


def drafter_taps(
    src: DrafterConfig, carriers: list[int], num_taps: int, num_layers: int
) -> list[int]:
    """Sorted big tap ids: the carriers of the source taps plus evenly spread other layers."""
    real = [carriers[i] for i in src.target_layer_ids]
    if num_taps < len(real) or num_taps > num_layers:
        raise InflateError(
            f"drafter num_taps {num_taps} must be in [{len(real)} (the source's), {num_layers}]"
        )
    others = [j for j in range(num_layers) if j not in real]
    extra = spread(num_taps - len(real), others) if num_taps > len(real) else []
    return sorted(real + extra)


def _causal(src: DrafterConfig) -> bool:
    kinds = {src.layer_is_causal(i) for i in range(src.num_hidden_layers)}
    if len(kinds) != 1:
        raise InflateError(
            "SRC_DRAFTER mixes causal and bidirectional layers; inflate needs one kind"
        )
    return kinds.pop()


def drafter_config(
    src: DrafterConfig, shape: dict, target: dict, taps: list[int], res: Residual, dtype: str
) -> dict:
    """Sliding-window layers of the shape keep their window but take the source layers' in-block
    causality (explicit `is_causal`): within the window they compute what the source's full layers
    did."""
    n = int(shape["num_hidden_layers"])
    types = list(shape.get("layer_types") or ["full_attention"] * n)
    if len(types) != n:
        raise InflateError(f"drafter layer_types has {len(types)} entries for {n} layers")
    window = shape.get("sliding_window") if "sliding_attention" in types else None
    dflash = {
        "mask_token_id": src.mask_token_id,
        "target_layer_ids": taps,
        "block_size": src.block_size,
    }
    if window is not None or src.is_causal is not None:
        dflash["is_causal"] = _causal(src)
    if src.is_dflash2:
        dflash.update(dflash2_fields(src, shape, int(target["hidden_size"])))
    return {
        "architectures": [src.architecture],
        "model_type": "qwen3",
        "hidden_size": target["hidden_size"],
        "vocab_size": target["vocab_size"],
        **{
            k: int(shape[k])
            for k in (
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
            )
        },
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": res.eps(src.rms_norm_eps),
        "rope_theta": src.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": src.max_position_embeddings,
        "layer_types": types,
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "block_size": src.block_size,
        "num_target_layers": target["num_hidden_layers"],
        "dflash_config": dflash,
    }


def dflash2_fields(src: DrafterConfig, shape: dict, hidden: int) -> dict:
    """A DFlash2 source keeps its convolutions' kernel and group size (a big group then holds one
    small group's channels: real dims come first) and its top-k; the selector rank is the shape's
    `selector_rank` (z-lab's 256 by default), at least the source's (extra rank columns add zero)."""
    rank = int(shape.get("selector_rank", max(256, src.selector_rank)))
    if rank < src.selector_rank:
        raise InflateError(
            f"drafter selector_rank {rank} is below the source's {src.selector_rank}"
        )
    if hidden % src.conv_group_size:
        raise InflateError(
            f"hidden_size {hidden} is not a multiple of the source's conv_group_size "
            f"{src.conv_group_size}"
        )
    return {
        "conv_kernel_size": src.conv_kernel_size,
        "conv_group_size": src.conv_group_size,
        "selector_rank": rank,
        "selector_top_k": src.selector_top_k,
    }


@dataclass(frozen=True)
class PairPlan:
    target_config: dict  # config.json dicts of the widened pair
    drafter_config: dict
    carriers: list[int]  # big target layer of each source layer
    residual: Residual


def plan_pair(
    src: TargetConfig, src_drafter: DrafterConfig, shape: str | dict, dtype: str = "bfloat16"
) -> PairPlan:
    """The widened pair's configs; raises InflateError for a shape the source does not fit."""
    tshape, dshape = resolve_shape(shape)
    for key, small in (("hidden_size", src.hidden_size), ("vocab_size", src.vocab_size)):
        if int(tshape[key]) < small:
            raise InflateError(f"--shape {key} {tshape[key]} is smaller than the source's {small}")
    check_source(src)
    res = residual_for(
        src.hidden_size,
        int(tshape["hidden_size"]),
        int(tshape["vocab_size"]) > src.vocab_size,
        min(src.rms_norm_eps, src_drafter.rms_norm_eps),
    )
    tdict = target_config(src, tshape, res, dtype)
    tcfg = TargetConfig.from_dict(tdict)
    carriers = layer_plan(src, tcfg)
    n_taps = int(dshape.get("num_taps", len(src_drafter.target_layer_ids)))
    taps = drafter_taps(src_drafter, carriers, n_taps, tcfg.num_hidden_layers)
    ddict = drafter_config(src_drafter, dshape, tdict, taps, res, dtype)
    return PairPlan(tdict, ddict, carriers, res)
