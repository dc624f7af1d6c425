"""Block-FP8 linear layers, and the conversions between them and `nn.Linear` (kernels: `kernels/fp8`).

`Fp8Linear` holds a float8_e4m3fn `weight` [out, in] and a float32 `weight_scale_inv` [ceil(out / g),
ceil(in / bk)] (+ a bias in the model dtype): the checkpoint's names and numbers. g, the scale's row
group, is the checkpoint's bn, or 1 when a fused projection's parts are not whole blocks of bn rows
(every part is quantized in blocks of its own, as a checkpoint stores it: the toy models' 32-row
k_proj beside a 64-row q_proj): each part's block scales are then repeated once per row, the same
values. Fused projections keep HF's part names in state dicts (`layers.fuse_linears`), their scales
split by the rows of each part.

Which linears convert is an `Fp8Layout` (`models/checkpoint.py`): `to_fp8` swaps them in empty on the
meta device before a stored FP8 checkpoint loads, `quantize_model` converts loaded weights
(--quantization fp8 and inflated pairs: per HF part, the math of a stored checkpoint's blocks),
`dequantize_model` turns them back (an FP8 drafter served in the model dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels import fp8
from ddtree.kernels.fp8 import reference as R
from ddtree.models.checkpoint import Fp8Layout
from ddtree.models.gated_deltanet import GatedDeltaNet
from ddtree.models.parallel import ParallelLMHead, RowParallelLinear, TPGroup, all_reduce


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        block: tuple[int, int],
        group_n: int,
        dtype: torch.dtype,
        device=None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block, self.group_n, self.group_k = tuple(block), group_n, block[1]
        shape = (_cdiv(out_features, group_n), _cdiv(in_features, self.group_k))
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=R.FP8, device=device), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.scale_t: torch.Tensor | None = None  # cuBLAS's scale layout (`prepare`)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, block={list(self.block)}, "
            f"scale rows per {self.group_n}"
        )

    def prepare(self) -> None:
        """After the weights loaded (never inside a graph capture): the scale layout the cuBLAS
        block-scaled GEMM reads, where it can run this weight."""
        w = self.weight
        self.scale_t = (
            fp8.cublas_scale(self.weight_scale_inv)
            if fp8.cublas_ok(w, self.group_n, self.group_k)
            else None
        )

    def part_scale_rows(self, rows: list[int]) -> list[int]:
        """Scale rows of each fused part of `rows` weight rows (the state-dict split)."""
        return list(rows) if self.group_n == 1 else [_cdiv(r, self.group_n) for r in rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8.linear(
            x,
            self.weight,
            self.weight_scale_inv,
            self.group_n,
            self.group_k,
            self.bias,
            self.scale_t,
        )

    def rows_from(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The output rows [start:] only (the drafter's context k|v of its fused q|k|v)."""
        if start % self.group_n:
            return self(x)[..., start:]
        b = None if self.bias is None else self.bias[start:]
        s = self.weight_scale_inv[start // self.group_n :]
        return fp8.linear(x, self.weight[start:], s, self.group_n, self.group_k, b)


class Fp8RowParallelLinear(Fp8Linear):
    """`RowParallelLinear` in block FP8: partial sums over this rank's input columns (whole bk blocks:
    `tp_layout.fp8_cuts`), all-reduced; the bias added once, after."""

    def __init__(self, *args, tp: TPGroup | None = None, **kw):
        super().__init__(*args, **kw)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None or self.tp.size == 1:
            return super().forward(x)
        y = fp8.linear(x, self.weight, self.weight_scale_inv, self.group_n, self.group_k)
        y = all_reduce(y, self.tp)
        return y if self.bias is None else y + self.bias


def linear_rows(linear: nn.Module, x: torch.Tensor, start: int) -> torch.Tensor:
    """Output rows [start:] of a linear (nn.Linear or Fp8Linear) without computing the others."""
    if isinstance(linear, Fp8Linear):
        return linear.rows_from(x, start)
    b = linear.bias
    return F.linear(x, linear.weight[start:], None if b is None else b[start:])


def _empty(linear: nn.Linear, rows: list[int], block, tp) -> Fp8Linear:
    bn = block[0]
    group_n = bn if all(r % bn == 0 for r in rows[:-1]) else 1
    cls = Fp8RowParallelLinear if isinstance(linear, RowParallelLinear) else Fp8Linear
    kw = {"tp": tp} if cls is Fp8RowParallelLinear else {}
    return cls(
        linear.in_features,
        linear.out_features,
        linear.bias is not None,
        block,
        group_n,
        linear.weight.dtype,
        linear.weight.device,
        **kw,
    )


def _quantized(linear: nn.Linear, rows: list[int], block, tp) -> Fp8Linear:
    """`linear` in block FP8: each part's rows quantized in blocks of their own."""
    m = _empty(linear, rows, block, tp)
    qs, ss = [], []
    for part in linear.weight.detach().split(rows, 0):
        q, s = R.quantize_weight(part, block)
        qs.append(q)
        ss.append(s if m.group_n != 1 else s.repeat_interleave(block[0], 0)[: part.shape[0]])
    with torch.no_grad():
        m.weight.copy_(torch.cat(qs))
        m.weight_scale_inv.copy_(torch.cat(ss))
        if m.bias is not None:
            m.bias.copy_(linear.bias)
    return m


def _dequantized(m: Fp8Linear, dtype: torch.dtype) -> nn.Linear:
    with torch.device("meta"):
        if isinstance(m, Fp8RowParallelLinear):
            lin = RowParallelLinear(m.in_features, m.out_features, m.bias is not None, m.tp)
        else:
            lin = nn.Linear(m.in_features, m.out_features, m.bias is not None)
    w = R.dequantize(m.weight, m.weight_scale_inv, m.group_n, m.group_k)
    lin.weight = nn.Parameter(w.to(dtype), requires_grad=False)
    if m.bias is not None:
        lin.bias = nn.Parameter(m.bias.detach().to(dtype), requires_grad=False)
    return lin


def _parts(owner: nn.Module, attr: str, linear: nn.Module) -> tuple[tuple[str, int], ...]:
    table = owner.__dict__.get("_fused_linears", {})
    return table.get(attr, ((attr, linear.out_features),))


def _linears(model: nn.Module, kind: type):
    """(owner, attribute, module, prefix) of every `kind` child (the LM head excluded)."""
    for prefix, owner in list(model.named_modules()):
        for attr, child in list(owner.named_children()):
            if isinstance(child, kind) and not isinstance(child, ParallelLMHead):
                yield owner, attr, child, f"{prefix}.{attr}".lstrip(".")


def _convert(model: nn.Module, layout: Fp8Layout, make) -> int:
    names = layout.modules
    for prefix, gdn in list(model.named_modules()):
        if isinstance(gdn, GatedDeltaNet) and any(f"{prefix}.{p}" in names for p in gdn.parts()):
            gdn.regroup_in_proj()
    n = 0
    for owner, attr, lin, prefix in _linears(model, nn.Linear):
        parts = _parts(owner, attr, lin)
        stem = prefix[: -len(attr)]
        inside = [stem + name in names for name, _ in parts]
        if not any(inside):
            continue
        if not all(inside):  # the checks refuse such a checkpoint; a layout built by hand too
            raise ValueError(f"{prefix}: parts {[p for p, _ in parts]} are partly in {names}")
        tp = getattr(lin, "tp", None)
        setattr(owner, attr, make(lin, [r for _, r in parts], layout.block, tp))
        n += 1
    return n


def to_fp8(model: nn.Module, layout: Fp8Layout) -> int:
    """Swap the layout's linears for empty `Fp8Linear`s (on the model's device, meta before a load);
    returns how many modules converted."""
    return _convert(model, layout, _empty)


@torch.no_grad()
def quantize_model(model: nn.Module, layout: Fp8Layout) -> int:
    """Quantize the layout's loaded linears in place (one module at a time: the model-dtype weights
    of a module are freed as its FP8 copy takes their place)."""
    n = _convert(model, layout, _quantized)
    prepare(model)
    return n


@torch.no_grad()
def dequantize_model(model: nn.Module, dtype: torch.dtype) -> int:
    """Every `Fp8Linear` back to a linear of `dtype` holding its dequantized weight."""
    n = 0
    for owner, attr, m, _ in _linears(model, Fp8Linear):
        setattr(owner, attr, _dequantized(m, dtype))
        n += 1
    return n


def prepare(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.prepare()


def fp8_modules(model: nn.Module) -> list[Fp8Linear]:
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def warm_up(model: nn.Module, dtype: torch.dtype, max_rows: int) -> int:
    """Every FP8 library kernel the model's linears may launch at 1..max_rows rows of `dtype`
    activations, compiled now (`fp8.warm_up`, once per weight shape); the calls made."""
    seen, calls = set(), 0
    for m in fp8_modules(model):
        key = (tuple(m.weight.shape), m.group_n, m.group_k)
        if key not in seen:
            seen.add(key)
            w, s = m.weight, m.weight_scale_inv
            calls += fp8.warm_up(w, s, m.group_n, m.group_k, dtype, max_rows, m.scale_t)
    return calls


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict in the checkpoint layout: HF part names, and each part's scales in
    blocks of bn rows (a fused projection holding one scale row per weight row keeps every bn-th)."""
    state = model.state_dict()
    for owner, attr, m, prefix in _linears(model, Fp8Linear):
        if m.group_n != 1:
            continue
        stem = prefix[: -len(attr)]
        for name, _ in _parts(owner, attr, m):
            key = f"{stem}{name}.weight_scale_inv"
            state[key] = state[key][:: m.block[0]]
    return state


def quantization_config(model: nn.Module, layout: Fp8Layout) -> dict:
    """config.json's `quantization_config` for a model quantized by `layout` (Qwen's fields; its
    other 2-D weights, kept in the model dtype, listed in modules_to_not_convert)."""
    kept = sorted(
        name[: -len(".weight")]
        for name, t in model.state_dict().items()
        if name.endswith(".weight") and t.dim() == 2 and t.dtype != R.FP8
    )
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(layout.block),
        "modules_to_not_convert": kept,
    }
