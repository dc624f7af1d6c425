"""Building blocks shared by the target and drafter models (HF Qwen3 numerics)."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ddtree.kernels.fused import add_rmsnorm, silu_mul
from ddtree.models.parallel import RowParallelLinear, TPGroup


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: statistics in fp32, scale applied after casting back (matches HF bit for bit).
    `norm(x)` -> normed; `norm(x, residual)` -> (normed(x + residual), x + residual), one fused kernel."""

    offset = False  # Qwen3.5's (1 + weight) norm sets this

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if self.offset else torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        normed, s = add_rmsnorm(x, residual, self.weight, self.eps, self.offset)
        return normed if residual is None else (normed, s)


def fuse_linears(owner: nn.Module, fused: str, parts: Sequence[tuple[str, int]]) -> None:
    """`owner.<fused>` (an nn.Linear) holds the output rows of HF's separate `owner.<part>` linears, stacked in
    `parts` order ((name, rows), ...). Checkpoints keep HF names: `state_dict()` shows the parts (row views of
    the fused weight/bias, no copy), `load_state_dict()` takes the parts (concatenated)."""
    table = owner.__dict__.setdefault("_fused_linears", {})
    if not table:
        owner.register_state_dict_post_hook(_split_fused)
        owner.register_load_state_dict_pre_hook(_concat_fused)
    table[fused] = tuple(parts)


# a block-FP8 projection's scales are split by their rows per part (`models/quant.py`)
_FUSED_SUFFIXES = ("weight", "bias", "weight_scale_inv")


def _part_rows(module, fused: str, suffix: str, parts) -> list[int]:
    rows = [r for _, r in parts]
    if suffix == "weight_scale_inv":
        return getattr(module, fused).part_scale_rows(rows)
    return rows


def _split_fused(module, state_dict, prefix, local_metadata):
    for fused, parts in module._fused_linears.items():
        for suffix in _FUSED_SUFFIXES:
            key = f"{prefix}{fused}.{suffix}"
            if key not in state_dict:
                continue
            t = state_dict.pop(key)
            sizes = _part_rows(module, fused, suffix, parts)
            for (name, _), piece in zip(parts, t.split(sizes, 0)):
                state_dict[f"{prefix}{name}.{suffix}"] = piece


def _concat_fused(module, state_dict, prefix, *_):
    for fused, parts in module._fused_linears.items():
        for suffix in _FUSED_SUFFIXES:
            keys = [f"{prefix}{name}.{suffix}" for name, _ in parts]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused}.{suffix}"] = torch.cat(
                    [state_dict.pop(k) for k in keys], 0
                )


class MLP(nn.Module):
    """SwiGLU MLP with gate|up as one GEMM (`gate_up_proj`; HF `gate_proj`/`up_proj` in checkpoints)."""

    def __init__(self, hidden: int, inter: int, tp: TPGroup | None = None):
        super().__init__()
        self.inter = inter  # this rank's rows of gate and of up (all of them without TP)
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = RowParallelLinear(inter, hidden, tp=tp)
        fuse_linears(self, "gate_up_proj", (("gate_proj", inter), ("up_proj", inter)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


def _inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scale factor for cos/sin) for the supported rope types."""
    inv = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim)
    )
    if scaling is None:
        return inv.float(), 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (inv / factor).float(), 1.0
    if kind == "yarn":
        orig = float(scaling.get("original_max_position_embeddings", 4096))
        beta_fast, beta_slow = (
            float(scaling.get("beta_fast", 32)),
            float(scaling.get("beta_slow", 1)),
        )

        def dim_for(rot):
            return (rotary_dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low = max(math.floor(dim_for(beta_fast)), 0)
        high = min(math.ceil(dim_for(beta_slow)), rotary_dim - 1)
        ramp = (torch.arange(rotary_dim // 2, dtype=torch.float64, device="cpu") - low) / max(
            high - low, 1e-3
        )
        extrapolation = 1 - ramp.clamp(0, 1)
        inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
        mscale = float(
            scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
        )
        return inv.float(), mscale
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE tables: cos/sin looked up by absolute position for the first `rotary_dim` channels (the
    rotation itself runs fused with the q/k norms: `ddtree.kernels.fused.qk_norm_rope`)."""

    def __init__(
        self, head_dim: int, theta: float, scaling: dict | None = None, partial: float = 1.0
    ):
        super().__init__()
        self.rotary_dim = int(head_dim * partial)
        # NOTE: a plain attribute, not a buffer, so meta-device construction and dtype casts never touch it.
        self.inv_freq, self.mscale = _inv_freq(self.rotary_dim, theta, scaling)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.mscale).to(dtype), (emb.sin() * self.mscale).to(dtype)


def torch_dtype(name: str) -> torch.dtype:
    table = {
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp32": torch.float32,
        "half": torch.float16,
        "float": torch.float32,
    }
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r}; use one of bfloat16, float16, float32")
    return table[name]
