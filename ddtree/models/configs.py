"""Model configurations parsed from `config.json` alone (never weights).

`TargetConfig` covers dense Qwen3 and hybrid Qwen3.5/3.6 text models (VLM-style configs keep the text model
under `text_config`); `DrafterConfig` covers z-lab DFlash and DFlash2 drafters. Both are frozen and carry only what the
engine needs, with the HF key spelling resolved in one place. `target_param_count` / `drafter_param_count` count
their parameters from the config alone (the memory plan's weights, the CPU thread default).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

DENSE_ARCHITECTURES = ("Qwen3ForCausalLM",)
HYBRID_ARCHITECTURES = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5TextForCausalLM",
    "Qwen3NextForCausalLM",
)
DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
# DFlash2's `dflash_config` keys: the grouped dynamic convolutions and the candidate selector
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

FP8_DEFAULT_BLOCK = (
    128,
    128,
)  # Qwen's and DeepSeek's weight_block_size; --quantization fp8 uses it
FP8_BLOCK_K = (32, 64, 128, 256)  # activation group / K block sizes the FP8 GEMMs take
FP8_KEYS = (
    "quant_method",
    "fmt",
    "activation_scheme",
    "weight_block_size",
    "modules_to_not_convert",
    "ignored_layers",
)


class ConfigError(ValueError):
    """A configuration problem found before any weight is loaded; each line names the flag and the fix."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(f"  - {p}" for p in self.problems))


@dataclass(frozen=True)
class Fp8Config:
    """Block-FP8 weights (Qwen's and DeepSeek's `quant_method: fp8` layout): every converted linear
    stores a float8_e4m3fn `weight` [out, in] and a `weight_scale_inv` [ceil(out / bn), ceil(in / bk)]
    (dequantized weight = weight x scale of its block); activations are quantized at run time per
    token in groups of bk. `not_convert`: the checkpoint's `modules_to_not_convert` (kept in the
    model dtype; what quantizing at load skips besides the defaults)."""

    block: tuple[int, int] = FP8_DEFAULT_BLOCK
    not_convert: tuple[str, ...] = ()

    def skips(self, module: str) -> bool:
        """Whether a `modules_to_not_convert` entry names `module` (a checkpoint module name such as
        model.layers.0.mlp.down_proj): equal, a dotted prefix (a whole subtree) or a dotted suffix
        (`lm_head`, `linear_attn.in_proj_a`: every layer's)."""
        dotted = "." + module
        return any(
            e == module or module.startswith(e + ".") or dotted.endswith("." + e)
            for e in self.not_convert
        )


def parse_quantization(cfg: dict) -> tuple[Fp8Config | None, list[str]]:
    """config.json's `quantization_config` (top level, or the VLM text_config's) -> (Fp8Config or None,
    problems). Only what ddtree serves exactly is accepted: block FP8, e4m3, dynamic activations;
    anything else is a problem naming the field, so such a checkpoint is refused before any weight
    loads rather than decoded with its scales ignored."""
    q = cfg.get("quantization_config")
    if q is None:
        q = (cfg.get("text_config") or {}).get("quantization_config")
    if q is None:
        return None, []
    F = "config.json quantization_config"
    fix = (
        "serve the model's bf16 checkpoint (add --quantization fp8 to quantize it at load), or a "
        "block-FP8 checkpoint (quant_method fp8, weight_block_size [128, 128])"
    )
    if not isinstance(q, dict):
        return None, [f"{F} is {type(q).__name__}, not an object; {fix}"]
    method = str(q.get("quant_method", "")).lower()
    if method != "fp8":
        return None, [f"{F}.quant_method {q.get('quant_method')!r} is not supported; {fix}"]
    p: list[str] = []
    unknown = sorted(set(q) - set(FP8_KEYS))
    if unknown:
        p.append(
            f"{F} has fields ddtree does not know ({', '.join(unknown)}): the checkpoint may need "
            f"them to be read correctly; {fix}"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        p.append(f"{F}.fmt {fmt!r} is not supported (float8_e4m3fn weights only); {fix}")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        p.append(
            f"{F}.activation_scheme {scheme!r} is not supported (activations are quantized per "
            f"token at run time: dynamic); {fix}"
        )
    block = q.get("weight_block_size")
    ok = (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(type(b) is int for b in block)
        and block[0] >= 1
        and block[0] & (block[0] - 1) == 0
        and block[1] in FP8_BLOCK_K
    )
    if block is None:
        p.append(
            f"{F} has no weight_block_size: per-tensor / per-channel FP8 scales are not supported; "
            f"{fix}"
        )
    elif not ok:
        p.append(
            f"{F}.weight_block_size {block!r} is not supported: [bn, bk] with bn a power of two "
            f"and bk one of {', '.join(map(str, FP8_BLOCK_K))} (Qwen's: [128, 128]); {fix}"
        )
    skip = q.get("modules_to_not_convert", q.get("ignored_layers")) or []
    if not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) for m in skip):
        p.append(f"{F}.modules_to_not_convert must be a list of module names; {fix}")
        skip = []
    if p:
        return None, p
    return Fp8Config(block=(block[0], block[1]), not_convert=tuple(skip)), []


def read_config_json(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        return json.load(f)


def _rope(cfg: dict) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor) from either `rope_scaling` or transformers-5
    `rope_parameters` spelling."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in (None, "default"):
            scaling = dict(params)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind in (None, "default"):
            scaling = None
    partial = float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
    return theta, scaling, partial


def _positive_int(value) -> int:
    """An integer config field, 0 where absent or not a positive integer (`problems` names it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        return 0
    return max(0, int(value))


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


@dataclass(frozen=True)
class TargetConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    # hybrid (Gated DeltaNet) fields; layer_types[i] in {"full_attention", "linear_attention"}
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    attn_output_gate: bool = False
    weight_prefix: str = "model."
    quantization: Fp8Config | None = None  # the checkpoint's (config.json quantization_config)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_hybrid(self) -> bool:
        return any(t == "linear_attention" for t in self.layer_types)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        if not self.layer_types:
            return tuple(range(self.num_hidden_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t != "linear_attention")

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @classmethod
    def from_dict(cls, cfg: dict) -> "TargetConfig":
        """Raises ConfigError for a `quantization_config` ddtree cannot serve exactly."""
        quant, problems = parse_quantization(cfg)
        if problems:
            raise ConfigError(problems)
        arch = (cfg.get("architectures") or ["?"])[0]
        text = cfg.get("text_config") or cfg
        prefix = "model.language_model." if "text_config" in cfg else "model."
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        theta, scaling, partial = _rope(text)
        n_layers = int(text["num_hidden_layers"])
        layer_types = tuple(text.get("layer_types") or ())
        interval = text.get("full_attention_interval")
        if not layer_types and interval and text.get("linear_num_value_heads"):
            layer_types = tuple(
                "full_attention" if (i + 1) % int(interval) == 0 else "linear_attention"
                for i in range(n_layers)
            )
        return cls(
            architecture=arch,
            model_type=str(cfg.get("model_type", text.get("model_type", ""))),
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim") or hidden // heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            max_position_embeddings=int(text.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(
                cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            attention_bias=bool(text.get("attention_bias", False)),
            dtype=str(
                text.get("torch_dtype")
                or text.get("dtype")
                or cfg.get("torch_dtype")
                or cfg.get("dtype")
                or "bfloat16"
            ),
            eos_token_ids=_eos_ids(text.get("eos_token_id", cfg.get("eos_token_id"))),
            layer_types=layer_types,
            linear_num_key_heads=int(text.get("linear_num_key_heads", 0) or 0),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 0) or 0),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 0) or 0),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 0) or 0),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 0) or 0),
            attn_output_gate=bool(
                text.get("attn_output_gate", "qwen3_5" in str(text.get("model_type", "")))
            ),
            weight_prefix=prefix,
            quantization=quant,
            raw=cfg,
        )

    @classmethod
    def from_path(cls, path: str) -> "TargetConfig":
        return cls.from_dict(read_config_json(path))


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """Evenly spaced from layer 1 to L-3 (z-lab's `build_target_layer_ids`); one tap takes the middle layer."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(int(round(start + i * span / (num_taps - 1))) for i in range(num_taps))


@dataclass(frozen=True)
class DrafterConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int | None
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    dtype: str = "bfloat16"
    quantization: Fp8Config | None = None  # the checkpoint's (config.json quantization_config)
    # DFlash2 (0 on DFlash drafters): grouped dynamic causal convolutions around attention and MLP,
    # and the candidate selector (top-k candidates rescored by a rank-r bilinear term)
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    def problems(self) -> list[str]:
        """What makes this config unloadable, one line per field (empty: loadable). Checked before
        any weight is read: an architecture we do not run, or DFlash2 fields that are missing, out
        of range, or set on a DFlash checkpoint (whose weights would then be read wrongly)."""
        if self.architecture not in DRAFTER_ARCHITECTURES:
            return [
                f"architectures {self.architecture!r} is not a drafter we run; supported: "
                f"{', '.join(DRAFTER_ARCHITECTURES)}"
            ]
        dcfg = self.raw.get("dflash_config") or {}
        given = [k for k in DFLASH2_FIELDS if dcfg.get(k, self.raw.get(k)) is not None]
        if not self.is_dflash2:
            return [
                f"dflash_config.{k} is a DFlash2 field but architectures is DFlashDraftModel; a "
                "DFlash2 checkpoint says DFlash2DraftModel"
                for k in given
            ]
        out = [
            f"dflash_config.{k} is missing or not a positive integer (DFlash2DraftModel needs it)"
            for k in DFLASH2_FIELDS
            if getattr(self, k) <= 0
        ]
        if self.conv_group_size > 0 and self.hidden_size % self.conv_group_size:
            out.append(
                f"dflash_config.conv_group_size {self.conv_group_size} does not divide hidden_size "
                f"{self.hidden_size}"
            )
        if self.conv_kernel_size > self.block_size:
            out.append(
                f"dflash_config.conv_kernel_size {self.conv_kernel_size} exceeds block_size "
                f"{self.block_size} (the convolution runs within a block)"
            )
        if self.selector_top_k > self.vocab_size:
            out.append(
                f"dflash_config.selector_top_k {self.selector_top_k} exceeds vocab_size {self.vocab_size}"
            )
        return out

    def layer_is_causal(self, i: int) -> bool:
        """z-lab semantics: an explicit `is_causal` wins; otherwise sliding layers are causal in-block."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_type(i) == "sliding_attention"

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_type(i) == "sliding_attention" else None

    @classmethod
    def from_dict(cls, cfg: dict) -> "DrafterConfig":
        """Raises ConfigError for a `quantization_config` ddtree cannot serve exactly."""
        quant, problems = parse_quantization(cfg)
        if problems:
            raise ConfigError(problems)
        dcfg = cfg.get("dflash_config") or {}

        def pick(name, default=None):
            return dcfg.get(name, cfg.get(name, default))

        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        n_layers = int(cfg["num_hidden_layers"])
        n_target = int(cfg.get("num_target_layers", 0) or 0)
        ids = pick("target_layer_ids")
        if ids is None:
            ids = default_target_layer_ids(n_target, n_layers) if n_target else ()
        theta, scaling, _ = _rope(cfg)
        causal = pick("is_causal", pick("causal"))
        softcap = pick("final_logit_softcapping")
        mask = pick("mask_token_id")
        return cls(
            architecture=(cfg.get("architectures") or ["?"])[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            block_size=int(pick("block_size", 16)),
            mask_token_id=None if mask is None else int(mask),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=n_target,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
            layer_types=tuple(cfg.get("layer_types") or ()),
            sliding_window=(
                int(cfg["sliding_window"])
                if cfg.get("sliding_window")
                and (cfg.get("use_sliding_window", True) or cfg.get("layer_types"))
                else None
            ),
            is_causal=None if causal is None else bool(causal),
            attention_bias=bool(cfg.get("attention_bias", False)),
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap in (None, 0) else float(softcap),
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            quantization=quant,
            **{k: _positive_int(pick(k)) for k in DFLASH2_FIELDS},
            raw=cfg,
        )

    @classmethod
    def from_path(cls, path: str) -> "DrafterConfig":
        return cls.from_dict(read_config_json(path))


# Parameter counts, from the config alone: they follow transformers' Qwen3 / Qwen3.5 modeling code
# exactly (text model only: the vision tower and MTP weights are never loaded by the engine).


def _attention_params(
    hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, gated_q: bool
) -> int:
    q_out = heads * head_dim * (2 if gated_q else 1)
    kv_out = kv_heads * head_dim
    n = hidden * q_out + 2 * hidden * kv_out + heads * head_dim * hidden
    if bias:
        n += q_out + 2 * kv_out + hidden
    return n + 2 * head_dim  # q_norm, k_norm


def _gdn_params(t: TargetConfig) -> int:
    key_dim = t.linear_num_key_heads * t.linear_key_head_dim
    value_dim = t.linear_num_value_heads * t.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    h, hv = t.hidden_size, t.linear_num_value_heads
    # in_proj_qkv + in_proj_z + in_proj_b + in_proj_a (Qwen3-Next fuses them as qkvz/ba: same count)
    proj = h * conv_dim + h * value_dim + 2 * h * hv
    return (
        proj
        + conv_dim * t.linear_conv_kernel_dim
        + 2 * hv
        + t.linear_value_head_dim
        + value_dim * h
    )


def _mlp_params(t: TargetConfig, layer: int) -> int:
    text = t.raw.get("text_config") or t.raw
    experts = int(text.get("num_experts", 0) or 0)
    sparse_step = int(text.get("decoder_sparse_step", 1) or 1)
    dense = layer in (text.get("mlp_only_layers") or ()) or (layer + 1) % sparse_step != 0
    if experts == 0 or dense:
        return 3 * t.hidden_size * t.intermediate_size
    moe_inter = int(text.get("moe_intermediate_size", t.intermediate_size))
    shared = int(text.get("shared_expert_intermediate_size", 0) or 0)
    n = experts * 3 * t.hidden_size * moe_inter + t.hidden_size * experts
    return n + (3 * t.hidden_size * shared + t.hidden_size if shared else 0)


def target_param_count(t: TargetConfig) -> int:
    h = t.hidden_size
    n = t.vocab_size * h * (1 if t.tie_word_embeddings else 2) + h
    attn = _attention_params(
        h,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.head_dim,
        t.attention_bias,
        t.attn_output_gate,
    )
    linear = set(t.linear_layer_ids)
    for i in range(t.num_hidden_layers):
        n += (_gdn_params(t) if i in linear else attn) + _mlp_params(t, i) + 2 * h
    return n


def drafter_param_count(d: DrafterConfig) -> int:
    """fc + hidden_norm + layers + norm (+ DFlash2's convolutions and selector); the drafter borrows
    the target's embedding and lm_head."""
    h = d.hidden_size
    taps = len(d.target_layer_ids)
    layer = _attention_params(
        h, d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.attention_bias, False
    )
    layer += 3 * h * d.intermediate_size + 2 * h
    selector = 0
    if d.is_dflash2:  # two convolutions per layer; the selector's codebooks and projection
        k, groups = d.conv_kernel_size, h // d.conv_group_size
        layer += 2 * (2 * k * h + 2 * k * groups * h)
        selector = d.selector_rank * (2 * d.vocab_size + h)
    return taps * h * h + h + d.num_hidden_layers * layer + h + selector
