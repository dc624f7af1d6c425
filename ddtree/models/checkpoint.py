"""What a checkpoint directory stores, read from its safetensors headers alone (torch-free: the config
checks run it before any weight loads, and the loader builds the model from the same answer).

- `safetensors_files`, `read_headers` (key -> dtype and shape, from each file's JSON header);
- `target_rename` / `drafter_rename`: checkpoint key -> the model's state-dict name (None: not loaded,
  e.g. a vision tower or an MTP head);
- `fp8_layout`: which linears are block FP8 (stored so, or to be quantized at load), with every
  problem that would make the scales be read wrongly refused: FP8 weights without a
  `quantization_config`, a missing or misshapen `weight_scale_inv`, per-tensor or static scales, an
  FP8 tensor the engine keeps only in the model dtype (embeddings, LM head), a fused projection whose
  parts disagree, a module `modules_to_not_convert` names stored in FP8.

Fused projections run as one GEMM (q|k|v, gate|up, the GDN's q|k|v|z and b|a), so their parts must
agree; quantizing at load converts every decoder linear but the GDN's b / a rows (a few dozen rows
of a tiny GEMM, which Qwen's FP8 checkpoints keep in bf16 too) and what `modules_to_not_convert`
lists.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass

from ddtree.models.configs import FP8_DEFAULT_BLOCK, Fp8Config

FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = ".weight_scale_inv"
SCALE_DTYPES = ("F32", "BF16", "F16")
# tensors of other FP8 schemes (per-tensor / static activation scales): refused by name
FOREIGN_SCALES = (".weight_scale", ".input_scale", ".activation_scale", ".output_scale")

TARGET_LINEARS = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
    r"|linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj))$"
)
DRAFTER_LINEARS = re.compile(
    r"^(fc|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj))$"
)
AT_LOAD_SKIP = ("linear_attn.in_proj_b", "linear_attn.in_proj_a")
FUSED_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
    ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
)


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return [os.path.join(path, f) for f in files]


def read_headers(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (safetensors dtype, shape) over every file of the checkpoint (headers only)."""
    out = {}
    for file in safetensors_files(path):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, info in header.items():
            if key != "__metadata__":
                out[key] = (info["dtype"], tuple(info["shape"]))
    return out


def target_rename(weight_prefix: str):
    def rename(key: str) -> str | None:
        if key.startswith(weight_prefix):
            return "model." + key[len(weight_prefix) :]
        if key == "lm_head.weight":
            return key
        return None

    return rename


def drafter_rename(key: str) -> str:
    """Checkpoint key -> state-dict name: an optional `model.` prefix dropped; DFlash2's codebooks
    are bare parameters (z-lab writes `candidate_selector.predecessor_codebook`; a `.weight`
    spelling, as an nn.Embedding would save it, is read too)."""
    key = key[len("model.") :] if key.startswith("model.") else key
    if key.startswith("candidate_selector.") and key.endswith("_codebook.weight"):
        key = key[: -len(".weight")]
    return key


@dataclass(frozen=True)
class Fp8Layout:
    """The block-FP8 linears of one model: `shapes` maps each one's state-dict module name (the
    model's naming, e.g. model.layers.0.mlp.gate_proj) to its full [out, in]; `at_load`: stored in the
    model dtype and quantized by the loader (the same block math as a stored checkpoint's)."""

    block: tuple[int, int]
    shapes: dict
    at_load: bool = False

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(self.shapes)

    def __hash__(self):
        return hash((self.block, self.at_load, tuple(sorted(self.shapes))))


def _group_problems(names: set[str], present: set[str]) -> list[str]:
    """Parts of one fused projection stored differently (some FP8, some not)."""
    bad = []
    for group in FUSED_GROUPS:
        for name in sorted(n for n in present if n.endswith("." + group[0])):
            stem = name[: -len(group[0])]
            parts = [stem + g for g in group if stem + g in present]
            kinds = {p in names for p in parts}
            if len(kinds) > 1:
                fp8 = [p for p in parts if p in names]
                bad.append(
                    f"fused projection parts {parts} are stored partly in FP8 ({fp8}): they run as "
                    "one GEMM; quantize all of them or none"
                )
                break  # one line per group kind
    return bad


def at_load_layout(
    shapes: dict, linears: re.Pattern, quant: Fp8Config | None, block=FP8_DEFAULT_BLOCK
) -> Fp8Layout:
    """`--quantization fp8`: the linears to quantize, from the model's weight shapes (state-dict
    module name -> [out, in])."""
    keep = {
        n: s
        for n, s in shapes.items()
        if linears.match(n)
        and not n.endswith(AT_LOAD_SKIP)
        and not (quant is not None and quant.skips(n))
    }
    return Fp8Layout(tuple(block), keep, at_load=True)


def fp8_layout(
    path: str,
    quant: Fp8Config | None,
    rename,
    linears: re.Pattern,
    request: str | None,
    p: list[str],
) -> Fp8Layout | None:
    """The FP8 layout a model directory is served with (None: none), every problem appended to p.
    `request`: None (as stored), "fp8" (stored FP8, or quantize the stored weights at load) or
    "unquant" (dequantize stored FP8 to the model dtype at load: the returned layout is what loads;
    the loader converts it back)."""
    try:
        headers = read_headers(path)
    except (OSError, ValueError, KeyError, struct.error) as e:
        if quant is not None or request is not None:  # else: the load reports it, as before
            p.append(f"safetensors headers unreadable ({e}); re-download the checkpoint")
        return None
    stored: dict[str, tuple[int, ...]] = {}  # checkpoint module name -> shape
    for key, (dtype, shape) in headers.items():
        if dtype.startswith("F8") and (dtype != FP8_DTYPE or not key.endswith(".weight")):
            p.append(
                f"tensor {key} is stored {dtype}: only float8_e4m3fn linear weights ({FP8_DTYPE}) "
                "with 128x128 block scales are served; use the bf16 checkpoint"
            )
        elif dtype == FP8_DTYPE:
            stored[key[: -len(".weight")]] = shape
        if key.endswith(FOREIGN_SCALES):
            p.append(
                f"tensor {key}: per-tensor or static FP8 scales are not supported (block scales "
                "`weight_scale_inv` only); use the bf16 checkpoint, or --quantization fp8 with it"
            )
    if stored and quant is None:
        example = sorted(stored)[0]
        p.append(
            f"{len(stored)} weights are stored float8_e4m3fn (e.g. {example}.weight) but config.json "
            "has no quantization_config: the scales' layout is unknown; add the checkpoint's "
            "quantization_config (quant_method fp8, weight_block_size) or use the bf16 checkpoint"
        )
        return None
    if quant is not None and not stored:
        p.append(
            "config.json declares quantization_config (fp8) but no weight is stored float8_e4m3fn; "
            "remove the quantization_config or use the FP8 checkpoint it belongs to"
        )
        return None
    weights = {}  # model module name -> shape, of every 2-D weight the model loads
    for key, (_, shape) in headers.items():
        name = rename(key) if key.endswith(".weight") else None
        if name is not None and len(shape) == 2:
            weights[name[: -len(".weight")]] = shape
    if not stored:
        if request != "fp8":
            return None
        return at_load_layout(weights, linears, quant)
    bn, bk = quant.block
    names = {}
    for module, shape in sorted(stored.items()):
        scale = headers.get(module + SCALE_SUFFIX)
        want = (-(-shape[0] // bn), -(-shape[1] // bk)) if len(shape) == 2 else None
        if len(shape) != 2:
            p.append(f"{module}.weight is stored FP8 with shape {list(shape)}; FP8 linears are 2-D")
        elif scale is None:
            p.append(
                f"{module}.weight is stored FP8 without {module}{SCALE_SUFFIX}: the checkpoint is "
                "incomplete; re-download it"
            )
        elif scale[0] not in SCALE_DTYPES or tuple(scale[1]) != want:
            p.append(
                f"{module}{SCALE_SUFFIX} is {scale[0]} {list(scale[1])}; weight_block_size "
                f"[{bn}, {bk}] needs float32 {list(want)} for a {list(shape)} weight: the config's "
                "weight_block_size does not match the checkpoint; fix config.json or re-download"
            )
        if quant.skips(module):
            p.append(
                f"{module}.weight is stored FP8 but quantization_config.modules_to_not_convert "
                "lists it: the checkpoint contradicts its config; re-download it"
            )
        name = rename(module + ".weight")
        if name is None:
            continue  # a tensor the engine never loads (vision tower, MTP head)
        name = name[: -len(".weight")]
        if not linears.match(name):
            p.append(
                f"{module}.weight is stored FP8, but ddtree serves that tensor only in the model "
                "dtype (FP8 covers the decoder layers' linears); use a checkpoint that keeps it bf16"
            )
            continue
        names[name] = tuple(shape)
    orphans = [
        k for k in headers if k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] not in stored
    ]
    if orphans:
        p.append(
            f"{orphans[0]} scales a weight that is not stored FP8 ({len(orphans)} such); the "
            "checkpoint is inconsistent; re-download it"
        )
    p.extend(_group_problems(set(names), set(weights)))
    return Fp8Layout(quant.block, names)


def target_linear_shapes(cfg) -> dict:
    """State-dict module name -> [out, in] of every decoder linear of a target (`TargetConfig`), from
    its geometry alone (the memory plan's and an inflated pair's FP8 layout)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q_rows = cfg.num_attention_heads * hd * (2 if cfg.attn_output_gate else 1)
    kv = cfg.num_key_value_heads * hd
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    linear = set(cfg.linear_layer_ids)
    out = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if i in linear:
            hv = cfg.linear_num_value_heads
            parts = {
                "in_proj_qkv": (2 * key_dim + value_dim, h),
                "in_proj_z": (value_dim, h),
                "in_proj_b": (hv, h),
                "in_proj_a": (hv, h),
                "out_proj": (h, value_dim),
            }
            out.update({f"{p}linear_attn.{k}": v for k, v in parts.items()})
        else:
            out[p + "self_attn.q_proj"] = (q_rows, h)
            out[p + "self_attn.k_proj"] = (kv, h)
            out[p + "self_attn.v_proj"] = (kv, h)
            out[p + "self_attn.o_proj"] = (h, cfg.num_attention_heads * hd)
        out[p + "mlp.gate_proj"] = (cfg.intermediate_size, h)
        out[p + "mlp.up_proj"] = (cfg.intermediate_size, h)
        out[p + "mlp.down_proj"] = (h, cfg.intermediate_size)
    return out


def drafter_linear_shapes(cfg) -> dict:
    """Like `target_linear_shapes` for a DFlash drafter (`DrafterConfig`): fc and its layers."""
    h, hd = cfg.hidden_size, cfg.head_dim
    out = {"fc": (h, len(cfg.target_layer_ids) * h)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out[p + "self_attn.q_proj"] = (cfg.num_attention_heads * hd, h)
        out[p + "self_attn.k_proj"] = (cfg.num_key_value_heads * hd, h)
        out[p + "self_attn.v_proj"] = (cfg.num_key_value_heads * hd, h)
        out[p + "self_attn.o_proj"] = (h, cfg.num_attention_heads * hd)
        out[p + "mlp.gate_proj"] = (cfg.intermediate_size, h)
        out[p + "mlp.up_proj"] = (cfg.intermediate_size, h)
        out[p + "mlp.down_proj"] = (h, cfg.intermediate_size)
    return out


def fp8_weight_bytes(shapes: dict, block, act_bytes: int, local=None) -> int:
    """Bytes an FP8 layout saves against the model dtype (negative: what it costs): each converted
    [out, in] weight holds 1 byte an element instead of `act_bytes`, plus its float32 scales: a row
    per bn rows, or one per row for a fused projection whose parts are not whole blocks
    (`models/quant.py`). `local(name, shape)`: one tensor-parallel rank's shape of it."""
    bn, bk = block
    shapes = {n: tuple(local(n, s) if local is not None else s) for n, s in shapes.items()}
    per_row = set()
    for group in FUSED_GROUPS:
        for name in shapes:
            if name.endswith("." + group[0]):
                stem = name[: -len(group[0])]
                parts = [stem + g for g in group if stem + g in shapes]
                if any(shapes[p][0] % bn for p in parts[:-1]):
                    per_row.update(parts)
    saved = 0
    for name, (o, i) in shapes.items():
        rows = o if name in per_row else -(-o // bn)
        saved += o * i * (act_bytes - 1) - 4 * rows * (-(-i // bk))
    return saved
