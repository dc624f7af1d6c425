"""Random-weight (target, DFlash drafter) pairs built directly on the device, and the memory floor they imply.

Weights are a seeded normal (std 0.02, HF's initializer_range; norms 1), so activations stay finite through
36 layers and no timing ever runs on zeros or uninitialised memory.
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.shapes import drafter_config_for, qwen3_config

INIT_STD = 0.02
# Qwen3-8B: 36 layers, hidden 4096, GQA 32/8, head dim 128, MLP 12288, vocab 151936; drafter 5 layers.
QWEN3_8B = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "num_layers": 36,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "rope_theta": 1e6,
}
SMOKE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 192,
    "max_position_embeddings": 4096,
    "rope_theta": 1e6,
}


# A tiny hybrid (3 Gated DeltaNet + 1 gated attention layers) for `bench rounds --smoke`.
SMOKE_HYBRID = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 192,
    "full_attention_interval": 4,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "attn_output_gate": True,
    "max_position_embeddings": 4096,
}
DRAFTER_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "layer_types",
    "sliding_window",
)


def shape_configs(
    shape: str, drafter_layers: int | None, block_size: int, dtype: str, smoke: bool = False
) -> tuple[TargetConfig, DrafterConfig]:
    """Configs of a `ddtree inflate --shape` (qwen3-8b, qwen3.6-27b or a config.json), dense or
    hybrid, with that shape's drafter (layers, heads, sliding windows); `smoke` swaps a hybrid shape
    for SMOKE_HYBRID."""
    from ddtree.models.shapes import is_hybrid, resolve_shape

    t, d = resolve_shape(shape)
    if smoke and is_hybrid(t):
        t, d = dict(SMOKE_HYBRID), {"num_hidden_layers": 2}
    vocab = int(t["vocab_size"])
    arch = "Qwen3_5ForCausalLM" if is_hybrid(t) else "Qwen3ForCausalLM"
    base = {"architectures": [arch], "max_position_embeddings": 40960, "rope_theta": 1e6}
    tcfg = TargetConfig.from_dict({**base, **t, "mask_token_id": vocab - 1, "torch_dtype": dtype})
    n = drafter_layers or int(d.get("num_hidden_layers", 5))
    dd = drafter_config_for(tcfg, num_layers=n, block_size=block_size, torch_dtype=dtype)
    dd.update({k: d[k] for k in DRAFTER_KEYS if k in d and (k != "layer_types" or len(d[k]) == n)})
    dd["use_sliding_window"] = bool(dd.get("sliding_window"))
    return tcfg, DrafterConfig.from_dict(dd)


def pair_configs(
    shape: dict, drafter_layers: int, block_size: int, dtype: str
) -> tuple[TargetConfig, DrafterConfig]:
    """Target config of `shape`; drafter with z-lab tap spacing (`default_target_layer_ids`) and a MASK that is
    a real embedding row (the last one)."""
    shape = dict(shape)
    vocab = shape.pop("vocab_size")
    tcfg = TargetConfig.from_dict(
        qwen3_config(vocab, mask_token_id=vocab - 1, torch_dtype=dtype, **shape)
    )
    dcfg = DrafterConfig.from_dict(
        drafter_config_for(
            tcfg, num_layers=drafter_layers, block_size=block_size, torch_dtype=dtype
        )
    )
    return tcfg, dcfg


@torch.no_grad()
def init_random(model: nn.Module, seed: int, device) -> nn.Module:
    gen = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:
            p.fill_(1.0)  # RMSNorm scales
        else:
            p.normal_(0.0, INIT_STD, generator=gen)
    return model.eval()


def build_pair(tcfg: TargetConfig, dcfg: DrafterConfig, device, dtype: torch.dtype, seed: int = 0):
    """(target, drafter) allocated straight on `device` in `dtype` (meta construction, no host copy)."""
    from ddtree.models.loader import build_target  # dense or hybrid

    with torch.device("meta"):
        target = build_target(tcfg).to(dtype)
        drafter = DFlashDrafter(dcfg).to(dtype)
    target = init_random(target.to_empty(device=device), seed, device)
    drafter = init_random(drafter.to_empty(device=device), seed + 1, device)
    return target, drafter


def read_bytes(target: nn.Module) -> int:
    """Bytes one target forward must read: every decoder layer, the final norm and the LM head. The embedding
    table is left out (a forward reads only the rows of its tokens); a tied LM head counts once."""
    seen: set[int] = set()
    total = 0
    for name, p in target.named_parameters(remove_duplicate=False):
        if id(p) in seen or (
            name.startswith("model.embed_tokens") and p is not target.lm_head.weight
        ):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def drafter_read_bytes(drafter: nn.Module, target: nn.Module) -> int:
    """Bytes a draft step reads: the drafter's weights plus the target LM head it borrows."""
    return (
        sum(p.numel() * p.element_size() for p in drafter.parameters())
        + target.lm_head.weight.numel() * target.lm_head.weight.element_size()
    )


def embedding_bytes(target: nn.Module) -> int:
    w = target.model.embed_tokens.weight
    return 0 if w is target.lm_head.weight else w.numel() * w.element_size()
