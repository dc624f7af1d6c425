"""Load HF-format model directories: single or sharded safetensors, key prefixes, tied embeddings.

With tensor parallelism each rank builds its local shapes (`tp_layout.shard_target` / `shard_drafter`)
and reads only its slices of each tensor (safetensors `get_slice`: no rank reads whole weights)."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ddtree.configs import DrafterConfig, TargetConfig
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.layers import torch_dtype
from ddtree.models.parallel import TPGroup
from ddtree.models.qwen3 import Qwen3ForCausalLM
from ddtree.models.tp_layout import ShardMap, shard_drafter, shard_target


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


def _read(f, key: str, name: str, shards: ShardMap | None) -> torch.Tensor:
    """The whole tensor, or this rank's pieces of it (concatenated, the vocab shard zero-padded)."""
    pieces = None if shards is None else shards.pieces(name)
    if pieces is None:
        return f.get_tensor(key)
    view = f.get_slice(key)
    rank = len(view.get_shape())
    parts = []
    for dim, start, stop in pieces:
        index = [slice(None)] * rank
        index[dim] = slice(start, stop)
        parts.append(view[tuple(index)])
    t = torch.cat(parts, pieces[0][0]) if len(parts) > 1 else parts[0]
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
) -> None:
    """Copy tensors into `module`'s parameters. `rename(key) -> name | None` maps checkpoint keys to
    state-dict names (None skips the tensor, e.g. a vision tower or MTP head). State-dict names are HF's: a fused
    projection (`qkv_proj`, `gate_up_proj`) shows up as row views named after its HF parts, so the parts are
    copied straight into their rows of the fused weight. `shards` picks one TP rank's slices."""
    params = module.state_dict(keep_vars=True)
    loaded: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = rename(key)
                if name is None or name not in params:
                    continue
                tensor = _read(f, key, name, shards)
                p = params[name]
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


def _target_rename(cfg: TargetConfig):
    prefix = cfg.weight_prefix

    def rename(key: str):
        if key.startswith(prefix):
            return "model." + key[len(prefix) :]
        if key == "lm_head.weight":
            return key
        return None

    return rename


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
) -> nn.Module:
    """The target, or with `tp` of size > 1 this rank's shard of it (its `config` the local one)."""
    full = TargetConfig.from_path(path)
    cfg = shard_target(full, tp.size) if tp is not None else full
    dt = torch_dtype(cfg.dtype if dtype == "auto" else dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = build_target(cfg, tp)
    model = model.to_empty(device=device).to(dt)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    optional = ("lm_head.",) if cfg.tie_word_embeddings else ()
    load_state(model, path, _target_rename(cfg), optional, _shards(full, tp))
    return model.eval()


def load_drafter(
    path: str, dtype: torch.dtype, device: str = "cpu", tp: TPGroup | None = None
) -> DFlashDrafter:
    """The drafter, sharded like the target under `tp` (why: `DFlashDrafter`)."""
    full = DrafterConfig.from_path(path)
    cfg = shard_drafter(full, tp.size) if tp is not None else full
    with torch.device("meta"):
        model = DFlashDrafter(cfg, tp)
    model = model.to_empty(device=device).to(dtype)
    load_state(
        model,
        path,
        lambda k: k[len("model.") :] if k.startswith("model.") else k,
        shards=_shards(full, tp),
    )
    return model.eval()


def save_model(
    module: nn.Module,
    path: str,
    config: dict,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    skip: tuple[str, ...] = (),
) -> None:
    """Write `config.json` and safetensors (sharded with an index when `max_shard_bytes` is given)."""
    os.makedirs(path, exist_ok=True)
    state = {}
    for name, p in module.state_dict().items():
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
