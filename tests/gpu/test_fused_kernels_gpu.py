"""The fused decoder-layer kernels (ddtree/kernels/fused) on the device against their references, at
Qwen3-8B shapes (bf16), M = 1, 65, 520 tokens, and a 2-layer Qwen3-8B-shaped target forward through
the model code. Formerly the check of studies/gpu_fused_kernels.py, which now only times."""

import pytest
import torch

from ddtree import envs

pytestmark = pytest.mark.gpu

H, HQ, HKV, D, INTER, EPS = 4096, 32, 8, 128, 12288, 1e-6
MAX_REL, L2_REL = 1e-2, 3e-3  # max |diff| / max |ref|: a few bf16 ulps of the largest element


def err(got, ref):
    g, r = got.double(), ref.double()
    return ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item(), (
        (g - r).norm() / r.norm().clamp_min(1e-30)
    ).item()


@pytest.mark.parametrize("m", [1, 65, 520])
def test_fused_kernels_match_reference(m):
    pytest.importorskip("triton")
    from ddtree.kernels.fused import reference as R
    from ddtree.kernels.fused import triton as tk
    from ddtree.models.layers import RotaryEmbedding

    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(m)

    def rnd(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen, device=dev)).to(dt)

    x, res = rnd(m, H), rnd(m, H, s=4.0)
    w = (1 + 0.2 * torch.randn(H, generator=gen, device=dev)).to(dt)
    qkv = rnd(m, (HQ + 2 * HKV) * D, s=2.0)
    qw = (1 + 0.2 * torch.randn(D, generator=gen, device=dev)).to(dt)
    kw = (1 + 0.2 * torch.randn(D, generator=gen, device=dev)).to(dt)
    cos, sin = RotaryEmbedding(D, 1e6).cos_sin(
        torch.randint(0, 40000, (m,), generator=gen, device=dev), dt
    )
    gu = rnd(m, 2 * INTER, s=2.0)
    q, k = qkv[:, : HQ * D].view(-1, HQ, D), qkv[:, HQ * D : (HQ + HKV) * D].view(-1, HKV, D)
    bad = []
    for name, got, ref in (
        ("add_rmsnorm", tk.add_rmsnorm(x, res, w, EPS), R.add_rmsnorm_reference(x, res, w, EPS)),
        ("rmsnorm", tk.add_rmsnorm(x, None, w, EPS)[:1], (R.rmsnorm_reference(x, w, EPS),)),
        (
            "add_rmsnorm(1+w)",
            tk.add_rmsnorm(x, res, w - 1, EPS, True),
            R.add_rmsnorm_reference(x, res, w - 1, EPS, True),
        ),
        (
            "qk_norm_rope",
            tk.qk_norm_rope(q, k, qw, kw, cos, sin, EPS),
            R.qk_norm_rope_reference(q, k, qw, kw, cos, sin, EPS),
        ),
        ("silu_mul", (tk.silu_mul(gu),), (R.silu_mul_reference(gu),)),
    ):
        for j, (g, r) in enumerate(zip(got, ref)):
            assert g.shape == r.shape and g.dtype == r.dtype, (
                name,
                g.shape,
                r.shape,
                g.dtype,
                r.dtype,
            )
            mx, l2 = err(g, r)
            if not (mx < MAX_REL and l2 < L2_REL):
                bad.append((f"{name}[{j}]", mx, l2))
    assert not bad, bad


def test_two_layer_target_forward_matches_reference(monkeypatch):
    pytest.importorskip("triton")
    from ddtree.bench.random_pair import QWEN3_8B, build_pair, pair_configs

    dev = torch.device("cuda")
    tcfg, dcfg = pair_configs(dict(QWEN3_8B, num_layers=2), 1, 16, "bfloat16")
    target, _ = build_pair(tcfg, dcfg, dev, torch.bfloat16, 0)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    ids = torch.randint(0, tcfg.vocab_size, (1, 65), device=dev)
    out = {}
    for ref in (True, False):
        if ref:
            monkeypatch.setenv(envs.REFERENCE.name, "kernels")
        else:
            monkeypatch.delenv(envs.REFERENCE.name)
        with torch.no_grad():
            out[ref] = target.forward_train(ids, tap_layers=(0,))
    for g, r in zip(out[False][:2], out[True][:2]):
        assert err(g, r)[1] < 2e-2
