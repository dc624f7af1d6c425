"""Load HF-format model directories: single or sharded safetensors, key prefixes, tied embeddings,
block-FP8 linears.

With tensor parallelism each rank builds its local shapes (`tp_layout.shard_target` / `shard_drafter`)
and reads only its slices of each tensor (safetensors `get_slice`: no rank reads whole weights); an
FP8 weight's scales are sliced with it (whole blocks: `tp_layout.fp8_cuts`). Which linears are block
FP8 is `checkpoint.fp8_layout`'s answer from the safetensors headers, with its problems raised as a
`ConfigError` before any weight is read: stored FP8 modules are swapped in before the load,
`--quantization fp8` quantizes the loaded weights (`quant.quantize_model`)."""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ddtree.models import checkpoint as ckpt
from ddtree.models import quant
from ddtree.models.checkpoint import Fp8Layout, safetensors_files
from ddtree.models.configs import ConfigError, DrafterConfig, TargetConfig
from ddtree.models.drafters import build_drafter, drafter_class
from ddtree.models.layers import torch_dtype
from ddtree.models.parallel import TPGroup
from ddtree.models.qwen3 import Qwen3ForCausalLM
from ddtree.models.tp_layout import ShardMap, fp8_cuts, shard_drafter, shard_target

__all__ = ["build_target", "load_drafter", "load_state", "load_target", "safetensors_files"]


def _slices(f, key: str, pieces) -> torch.Tensor:
    view = f.get_slice(key)
    rank = len(view.get_shape())
    parts = []
    for dim, start, stop in pieces:
        index = [slice(None)] * rank
        index[dim] = slice(start, stop)
        parts.append(view[tuple(index)])
    return torch.cat(parts, pieces[0][0]) if len(parts) > 1 else parts[0]


def _read_scale(f, key: str, name: str, shards: ShardMap | None, block, rows: int) -> torch.Tensor:
    """float32 block scales of this rank's slice of a weight, with `rows` rows: the weight's blocks,
    or one row per weight row (a fused projection whose parts are not whole blocks: each block's
    scale repeated)."""
    pieces = None if shards is None else shards.pieces(name[: -len("_scale_inv")])
    if pieces is None:
        t = f.get_tensor(key)
    else:  # whole blocks (fp8_cuts): a piece's block range is exact, a ragged last block included
        t = _slices(f, key, [(d, a // block[d], -(-b // block[d])) for d, a, b in pieces])
    t = t.float()
    if rows != t.shape[0]:  # one scale row per weight row
        t = t.repeat_interleave(block[0], 0)[:rows]
    return t


def _read(f, key: str, name: str, shards: ShardMap | None) -> torch.Tensor:
    """The whole tensor, or this rank's pieces of it (concatenated, the vocab shard zero-padded)."""
    pieces = None if shards is None else shards.pieces(name)
    if pieces is None:
        return f.get_tensor(key)
    t = _slices(f, key, pieces)
    pad = shards.vocab_pad(name)
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])], 0)
    return t


def load_state(
    module: nn.Module,
    path: str,
    rename,
    optional: tuple[str, ...] = (),
    shards: ShardMap | None = None,
    block: tuple[int, int] | None = None,
) -> None:
    """Copy tensors into `module`'s parameters. `rename(key) -> name | None` maps checkpoint keys to
    state-dict names (None skips the tensor, e.g. a vision tower or MTP head). State-dict names are HF's: a fused
    projection (`qkv_proj`, `gate_up_proj`) shows up as row views named after its HF parts, so the parts are
    copied straight into their rows of the fused weight. `shards` picks one TP rank's slices; `block`: the
    checkpoint's FP8 weight_block_size (its `weight_scale_inv` tensors load as float32)."""
    params = module.state_dict(keep_vars=True)
    loaded: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = rename(key)
                if name is None or name not in params:
                    continue
                p = params[name]
                if name.endswith(ckpt.SCALE_SUFFIX) and block is not None:
                    tensor = _read_scale(f, key, name, shards, block, p.shape[0])
                else:
                    tensor = _read(f, key, name, shards)
                if tuple(tensor.shape) != tuple(p.shape):
                    raise ValueError(
                        f"{path}: tensor {key} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}"
                    )
                with torch.no_grad():
                    p.copy_(tensor.to(p.dtype))
                loaded.add(name)
    missing = [n for n in params if n not in loaded and not n.startswith(optional)]
    if missing:
        raise ValueError(
            f"{path}: missing tensors for {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )


def fp8_layout(
    path: str, cfg, rename, linears: re.Pattern, request: str | None, tp: TPGroup | None
) -> Fp8Layout | None:
    """The checkpoint's FP8 layout under `request` (None / fp8 / unquant); every problem raised
    together as a ConfigError, before any weight is read."""
    p: list[str] = []
    layout = ckpt.fp8_layout(path, cfg.quantization, rename, linears, request, p)
    if layout is not None and tp is not None and tp.size > 1:
        cuts = fp8_cuts(cfg, tp.size, layout.shapes, layout.block)
        if cuts:
            p.append(f"--tp-size {tp.size} cuts the FP8 weight blocks of {', '.join(cuts)}")
    if p:
        raise ConfigError([f"{path}: {line}" for line in p])
    return layout


def _build(make, layout: Fp8Layout | None, dtype: torch.dtype, device: str) -> nn.Module:
    """The model built on the meta device in `dtype`, its stored-FP8 linears swapped in, then
    allocated on `device` (dtype casts come first: `.to(dtype)` would cast float8 weights too)."""
    with torch.device("meta"):
        model = make().to(dtype)
        if layout is not None and not layout.at_load:
            quant.to_fp8(model, layout)
    return model.to_empty(device=device)


def _finish(model: nn.Module, layout: Fp8Layout | None, request: str | None, dtype) -> nn.Module:
    if layout is not None and layout.at_load:
        quant.quantize_model(model, layout)
    elif layout is not None and request == "unquant":
        quant.dequantize_model(model, dtype)
    quant.prepare(model)
    return model.eval()


def build_target(cfg: TargetConfig, tp: TPGroup | None = None) -> nn.Module:
    if cfg.is_hybrid:
        # hybrid targets live in their own module
        from ddtree.models.qwen3_5 import (
            Qwen3_5ForCausalLM,
        )

        return Qwen3_5ForCausalLM(cfg, tp)
    return Qwen3ForCausalLM(cfg, tp)


def _shards(cfg, tp: TPGroup | None) -> ShardMap | None:
    return None if tp is None or tp.size == 1 else ShardMap(cfg, tp.size, tp.rank)


def load_target(
    path: str,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    tp: TPGroup | None = None,
    quantization: str | None = None,
) -> nn.Module:
    """The target, or with `tp` of size > 1 this rank's shard of it (its `config` the local one).
    `quantization`: None (as stored: a block-FP8 checkpoint loads its FP8 linears) or fp8 (a
    model-dtype checkpoint's decoder linears quantized at load)."""
    full = TargetConfig.from_path(path)
    rename = ckpt.target_rename(full.weight_prefix)
    layout = fp8_layout(path, full, rename, ckpt.TARGET_LINEARS, quantization, tp)
    cfg = shard_target(full, tp.size) if tp is not None else full
    dt = torch_dtype(cfg.dtype if dtype == "auto" else dtype) if isinstance(dtype, str) else dtype
    model = _build(lambda: build_target(cfg, tp), layout, dt, device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    optional = ("lm_head.",) if cfg.tie_word_embeddings else ()
    block = None if layout is None else layout.block
    load_state(model, path, rename, optional, _shards(full, tp), block)
    return _finish(model, layout, quantization, dt)


def load_drafter(
    path: str,
    dtype: torch.dtype,
    device: str = "cpu",
    tp: TPGroup | None = None,
    quantization: str | None = None,
    options: dict | None = None,
) -> nn.Module:
    """The drafter (the class `models/drafters.py` registers for its architecture), sharded like
    the target under `tp` (why: `DFlashDrafter`). A config the drafter cannot run raises
    ConfigError naming the field before any weight file is read. `quantization`: None (as stored),
    fp8 (quantized at load) or unquant (stored FP8 dequantized to `dtype`). `options`: the drafter
    class's constructor arguments (`build_drafter`)."""
    full = DrafterConfig.from_path(path)
    drafter_class(full)  # an unloadable config is refused here, before any weight file is read
    layout = fp8_layout(path, full, ckpt.drafter_rename, ckpt.DRAFTER_LINEARS, quantization, tp)
    cfg = shard_drafter(full, tp.size) if tp is not None else full
    model = _build(lambda: build_drafter(cfg, tp, **(options or {})), layout, dtype, device)
    block = None if layout is None else layout.block
    load_state(model, path, ckpt.drafter_rename, shards=_shards(full, tp), block=block)
    return _finish(model, layout, quantization, dtype)


def save_model(
    module: nn.Module,
    path: str,
    config: dict,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    skip: tuple[str, ...] = (),
    state_dict: dict | None = None,
) -> None:
    """Write `config.json` and safetensors (sharded with an index when `max_shard_bytes` is given);
    `state_dict`: the tensors to write (default: the module's)."""
    os.makedirs(path, exist_ok=True)
    state = {}
    for name, p in (module.state_dict() if state_dict is None else state_dict).items():
        if skip and name.startswith(skip):
            continue
        state[name] = (p.to(dtype) if dtype is not None else p).detach().contiguous().cpu()
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if not max_shard_bytes:
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
