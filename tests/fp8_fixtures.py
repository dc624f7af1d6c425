"""Block-FP8 checkpoints in Qwen's exact layout, written from a model-dtype checkpoint by code of the
tests' own (not the library's quantizer): config.json gains `quantization_config {quant_method: fp8,
fmt: e4m3, activation_scheme: dynamic, weight_block_size, modules_to_not_convert}`; each converted
`X.weight` is float8_e4m3fn beside a `X.weight_scale_inv` [ceil(out / bn), ceil(in / bk)] (abs-max /
448 per block, as Qwen's and DeepSeek's are made); the LM head, embeddings, norms, the conv and the
GDN's b / a rows stay in the checkpoint's dtype (Qwen3.5 / 3.6 FP8 checkpoints keep in_proj_a / b in
bf16 and list them in modules_to_not_convert)."""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

QWEN_FP8_LINEARS = re.compile(
    r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
    r"|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))\.weight$|^(model\.)?fc\.weight$"
)


def quantize_block(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    bn, bk = block
    o, i = w.shape
    padded = F.pad(w.float(), (0, -i % bk, 0, -o % bn))
    tiles = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-10) / 448.0
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[:o, :i].contiguous(), scale


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    bn, bk = block
    o, i = q.shape
    s = scale.float().repeat_interleave(bn, 0)[:o].repeat_interleave(bk, 1)[:, :i]
    return q.float() * s


def write_fp8_checkpoint(
    src: str,
    dst: str,
    block=(128, 128),
    scale_dtype=torch.float32,
    edit_tensors=None,
    edit_quant=None,
    fp8=QWEN_FP8_LINEARS,
) -> str:
    """`dst`: `src` converted to block FP8 (every other file copied). `edit_tensors(tensors)` /
    `edit_quant(quantization_config)` change the result in place (the refusal tests)."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    tensors = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, name)))
    out, skipped = {}, []
    for key, t in tensors.items():
        if fp8.search(key) and t.dim() == 2:
            q, s = quantize_block(t, block)
            out[key] = q
            out[key[: -len(".weight")] + ".weight_scale_inv"] = s.to(scale_dtype)
        else:
            out[key] = t
            if key.endswith(".weight") and t.dim() == 2:
                skipped.append(key[: -len(".weight")])
    if edit_tensors is not None:
        edit_tensors(out)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    quant = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
        "modules_to_not_convert": skipped,
    }
    if edit_quant is not None:
        edit_quant(quant)
    cfg["quantization_config"] = quant
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return dst


def dequantized_checkpoint(fp8_dir: str, dst: str, dtype=torch.float32) -> str:
    """The model-dtype checkpoint whose weights are an FP8 checkpoint's dequantized values (the
    reference its FP8 model is compared with)."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(fp8_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    block = cfg.pop("quantization_config")["weight_block_size"]
    tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
    out = {}
    for key, t in tensors.items():
        if key.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(key[: -len(".weight")] + ".weight_scale_inv")
        out[key] = (dequantize_block(t, scale, block) if scale is not None else t.float()).to(dtype)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(fp8_dir):
        if name not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(fp8_dir, name), os.path.join(dst, name))
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return dst
