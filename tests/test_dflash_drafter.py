"""The drafter forward (paged inference path and the training path) against an independent plain-PyTorch
reference of z-lab's DFlash semantics written here from the weights alone."""

import math

import pytest
import torch
from hf_fixtures import save_hf_qwen3
from pair_fixtures import save_random_drafter

from ddtree.engine.model_runner import ModelRunner, RunnerConfig
from ddtree.engine.scheduling.request import Req, SamplingParams
from ddtree.models.loader import load_drafter, load_target


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = (
        torch.cat([ang.cos(), ang.cos()], -1).float(),
        torch.cat([ang.sin(), ang.sin()], -1).float(),
    )
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def reference_draft_logits(W, cfg, embed, lm_head, features, block_ids, start):
    """features [L, K*H] (taps of positions 0..L-1), block_ids [S] at positions start.. -> logits [S-1, V]."""
    hd, nh, nkv, theta = (
        cfg["head_dim"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["rope_theta"],
    )
    L, S = features.shape[0], block_ids.shape[0]
    ctx = rms(features @ W["fc.weight"].T, W["hidden_norm.weight"])
    x = embed[block_ids]
    kpos = torch.cat([torch.arange(L), start + torch.arange(S)])
    qpos = start + torch.arange(S)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = rms(
            (h @ W[p + "self_attn.q_proj.weight"].T).view(S, nh, hd),
            W[p + "self_attn.q_norm.weight"],
        )
        both = torch.cat([ctx, h])
        k = rms(
            (both @ W[p + "self_attn.k_proj.weight"].T).view(L + S, nkv, hd),
            W[p + "self_attn.k_norm.weight"],
        )
        v = (both @ W[p + "self_attn.v_proj.weight"].T).view(L + S, nkv, hd)
        q, k = rope(q, qpos, theta), rope(k, kpos, theta)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        kind = (cfg.get("layer_types") or ["full_attention"] * 99)[i]
        diff = qpos[:, None] - kpos[None, :]
        vis = torch.ones_like(diff, dtype=torch.bool)
        # z-lab: sliding layers are causal in-block, window on both sides
        if kind == "sliding_attention":
            vis = (diff >= 0) & (diff < cfg["sliding_window"])
        scores = scores.masked_fill(~vis[None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(S, nh * hd)
        x = x + out @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g, u = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ W[p + "mlp.down_proj.weight"].T
    return rms(x, W["norm.weight"])[1:] @ lm_head.T


@pytest.mark.parametrize("variant", ["full", "sliding"])
def test_drafter_matches_reference(tmp_path, variant):
    save_hf_qwen3(tmp_path / "t", num_hidden_layers=4)
    extra = {}
    if variant == "sliding":
        extra = dict(
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=5,
            use_sliding_window=True,
        )
    _, cfg = save_random_drafter(
        tmp_path / "t", tmp_path / "d", num_layers=2, block_size=6, layer_ids=[0, 2], **extra
    )
    target = load_target(str(tmp_path / "t"), torch.float32)
    drafter = load_drafter(str(tmp_path / "d"), torch.float32)
    W = {k: v.detach() for k, v in drafter.state_dict().items()}
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()

    runner = ModelRunner(
        target,
        drafter,
        RunnerConfig(
            page_size=4,
            num_pages=64,
            max_running_requests=4,
            max_context=128,
            block_size=6,
            max_verify_width=6,
        ),
        "cpu",
        torch.float32,
    )
    prompts = [
        list(range(3, 14)),
        [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    ]
    reqs = [Req(prompt_ids=p, params=SamplingParams(temperature=0)) for p in prompts]
    runner.prefill(reqs, [len(p) for p in prompts])
    roots = torch.tensor([40, 41])
    rnd = runner.begin(reqs)
    rnd.roots = roots
    got = runner.propose(rnd, 6)
    mask = cfg["dflash_config"]["mask_token_id"]
    for i, p in enumerate(prompts):
        _, taps = target.forward_train(torch.tensor([p]), tap_layers=(0, 2))
        block = torch.tensor([int(roots[i])] + [mask] * 5)
        ref = reference_draft_logits(W, cfg, embed, lm_head, taps[0], block, len(p))
        torch.testing.assert_close(got[i], ref, rtol=1e-4, atol=1e-4)

        # training path: one block anchored at len(p) sees exactly the same context
        seq = torch.tensor([p + [int(roots[i])] + [0] * 6])
        _, taps_full = target.forward_train(seq, tap_layers=(0, 2))
        hidden = drafter.forward_train(
            taps_full, target.embed_tokens(block)[None, None], torch.tensor([[len(p)]])
        )
        train_logits = drafter.logits(hidden[0, 0, 1:], target.lm_head)
        torch.testing.assert_close(train_logits, ref, rtol=1e-4, atol=1e-4)
