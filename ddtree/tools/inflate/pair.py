"""`inflate_pair`: the widened pair built in memory on any device (from `plan.plan_pair`'s configs);
`write_pair`: the pair as two HF model directories."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.tools.inflate.drafter import inflate_drafter
from ddtree.tools.inflate.plan import plan_pair
from ddtree.tools.inflate.target import inflate_target
from ddtree.tools.inflate.writer import copy_tokenizer, write_model


@dataclass
class InflatedPair:
    target: nn.Module
    drafter: nn.Module
    target_config: dict  # config.json dicts
    drafter_config: dict
    carriers: list[int]  # big target layer of each source layer
    source_target_dir: str


def _load_source(path: str, device) -> nn.Module:
    from ddtree.models.loader import load_target

    return load_target(path, torch.float32, str(device))


@torch.no_grad()
def inflate_pair(
    src_target: str,
    src_drafter: str,
    shape: str | dict,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> InflatedPair:
    """Build the widened pair in memory on `device` (nothing written): the 27B pair is built this
    way on the GPU. `shape`: "qwen3-8b", "qwen3.6-27b", a config.json path or dict (see
    `ddtree.models.shapes`)."""
    from ddtree.models.loader import load_drafter

    device = torch.device(device)
    src_t = _load_source(src_target, device)
    src_d = load_drafter(src_drafter, torch.float32, str(device))
    plan = plan_pair(src_t.config, src_d.config, shape, str(dtype).removeprefix("torch."))
    tcfg = TargetConfig.from_dict(plan.target_config)
    target, carriers = inflate_target(src_t, tcfg, plan.residual, device, dtype, seed)
    dcfg = DrafterConfig.from_dict(plan.drafter_config)
    drafter = inflate_drafter(src_d, dcfg, tcfg, plan.residual, device, dtype, carriers)
    return InflatedPair(
        target, drafter, plan.target_config, plan.drafter_config, carriers, src_target
    )


def quantize_pair(pair: InflatedPair) -> None:
    """The pair in block FP8 ([128, 128] blocks, every decoder linear but the GDN's b / a rows, as
    --quantization fp8 quantizes at load), its configs given the matching quantization_config."""
    from ddtree.models import checkpoint as ckpt
    from ddtree.models.quant import quantization_config, quantize_model

    for model, config, shapes, linears in (
        (pair.target, pair.target_config, ckpt.target_linear_shapes, ckpt.TARGET_LINEARS),
        (pair.drafter, pair.drafter_config, ckpt.drafter_linear_shapes, ckpt.DRAFTER_LINEARS),
    ):
        layout = ckpt.at_load_layout(shapes(model.config), linears, None)
        quantize_model(model, layout)
        config["quantization_config"] = quantization_config(model, layout)


def write_pair(pair: InflatedPair, out_dir: str, shard_bytes: int | None = None) -> tuple[str, str]:
    """OUT/target (weights, config, tokenizer, chat template) and OUT/drafter; their paths."""
    tdir, ddir = os.path.join(out_dir, "target"), os.path.join(out_dir, "drafter")
    kw = {} if shard_bytes is None else {"shard_bytes": shard_bytes}
    write_model(pair.target, tdir, pair.target_config, **kw)
    copy_tokenizer(pair.source_target_dir, tdir)
    write_model(pair.drafter, ddir, pair.drafter_config, **kw)
    return tdir, ddir
