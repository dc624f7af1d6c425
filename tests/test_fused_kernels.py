"""Fused layer kernels (ddtree/kernels/fused): each Triton kernel vs its PyTorch reference, the dispatch switches,
and a tiny Qwen3 target + DFlash drafter forward through the kernels vs the reference path.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before the kernel module is
imported). The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even), so bf16 results
are compared with a few-ulp tolerance; fp32 ones tightly.
"""

import pytest
import torch
from triton_utils import DEV, load_kernel_module, rel

kernels = load_kernel_module("ddtree.kernels.fused.triton")

import ddtree.kernels.fused as fused  # noqa: E402
from ddtree import envs  # noqa: E402
from ddtree.kernels.fused import reference as R  # noqa: E402
from ddtree.models.layers import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
# the interpreter's truncation biases each rounding toward zero
BF16_REL = 2.5e-2 if DEV == "cpu" else 5e-3


def close(got, ref, dtype):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:  # a few bf16 ulps (2^-8 relative each) apart at most, and close on the whole
        torch.testing.assert_close(got.float(), ref.float(), rtol=3e-2, atol=3e-2)
        assert rel(got, ref) < BF16_REL


def norm_weight(n, dtype, gen, offset=False):
    w = 0.2 * torch.randn(n, generator=gen)
    return (w if offset else 1.0 + w).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 96), (13, 128)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("offset", [False, True])
def test_add_rmsnorm_matches_reference(dtype, rows, n, with_residual, offset):
    gen = torch.Generator().manual_seed(rows * n)
    x = (3 * torch.randn(rows, n, generator=gen)).to(dtype).to(DEV)
    r = torch.randn(rows, n, generator=gen).to(dtype).to(DEV) if with_residual else None
    w = norm_weight(n, dtype, gen, offset)
    got, got_sum = kernels.add_rmsnorm(x, r, w, 1e-6, offset)
    ref, ref_sum = R.add_rmsnorm_reference(x, r, w, 1e-6, offset)
    close(got, ref, dtype)
    close(got_sum, ref_sum, dtype)
    if not with_residual:
        assert got_sum is x


def test_add_rmsnorm_takes_row_strided_input():
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(5, 3, 80, generator=gen).to(DEV)
    x = big[..., :64]  # rows 80 apart
    r = torch.randn(5, 3, 64, generator=gen).to(DEV)
    w = norm_weight(64, torch.float32, gen)
    got, s = kernels.add_rmsnorm(x, r, w, 1e-6)
    ref, rs = R.add_rmsnorm_reference(x, r, w, 1e-6)
    close(got, ref, torch.float32)
    close(s, rs, torch.float32)


def fused_qkv(lead, hq, hkv, d, dtype, gen, q_width=None):
    """q, k, v as column views of one [..., (Hq + 2 Hkv) D] projection output, like the model's."""
    qw = q_width or hq * d
    qkv = torch.randn(*lead, qw + 2 * hkv * d, generator=gen).to(dtype).to(DEV)
    q = qkv[..., :qw]
    k = qkv[..., qw : qw + hkv * d].view(*lead, hkv, d)
    return qkv, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(1,), (9,), (2, 5)])
@pytest.mark.parametrize("partial", [1.0, 0.25])
@pytest.mark.parametrize("offset", [False, True])
def test_qk_norm_rope_matches_reference(dtype, lead, partial, offset):
    hq, hkv, d = 4, 2, 32
    gen = torch.Generator().manual_seed(len(lead) * 100 + lead[-1])
    _, q, k = fused_qkv(lead, hq, hkv, d, dtype, gen)
    q = q.view(*lead, hq, d)
    rope = RotaryEmbedding(d, 10000.0, None, partial)
    pos = torch.randint(0, 300, lead, generator=gen).to(DEV)
    cos, sin = rope.cos_sin(pos, dtype)
    qw, kw = norm_weight(d, dtype, gen, offset), norm_weight(d, dtype, gen, offset)
    got = kernels.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, offset)
    ref = R.qk_norm_rope_reference(q, k, qw, kw, cos, sin, 1e-6, offset)
    for g, r in zip(got, ref):
        assert g.is_contiguous()
        close(g, r, dtype)
    # either side alone
    _, k_only = kernels.qk_norm_rope(None, k, None, kw, cos, sin, 1e-6, offset)
    close(k_only, ref[1], dtype)
    q_only, _ = kernels.qk_norm_rope(q, None, qw, None, cos, sin, 1e-6, offset)
    close(q_only, ref[0], dtype)


def test_qk_norm_rope_gated_query_heads():
    """Qwen3.5 gated attention: query heads are every other head_dim chunk of the q projection (head stride 2D)."""
    hq, hkv, d, T = 3, 1, 16, 5
    gen = torch.Generator().manual_seed(3)
    _, qg, k = fused_qkv((T,), hq, hkv, d, torch.float32, gen, q_width=2 * hq * d)
    q = qg.view(T, hq, 2 * d)[..., :d]
    cos, sin = RotaryEmbedding(d, 10000.0, None, 0.5).cos_sin(
        torch.arange(T).to(DEV), torch.float32
    )
    qw, kw = norm_weight(d, torch.float32, gen, True), norm_weight(d, torch.float32, gen, True)
    got = kernels.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, True)
    ref = R.qk_norm_rope_reference(q, k, qw, kw, cos, sin, 1e-6, True)
    for g, r in zip(got, ref):
        close(g, r, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,inter", [((1,), 40), ((7,), 96), ((2, 3), 1100)])
def test_silu_mul_matches_reference(dtype, lead, inter):
    gen = torch.Generator().manual_seed(inter)
    gu = (2 * torch.randn(*lead, 2 * inter, generator=gen)).to(dtype).to(DEV)
    close(kernels.silu_mul(gu), R.silu_mul_reference(gu), dtype)


def test_kernels_catch_a_wrong_reference():
    """The comparisons above can fail: a RoPE with the wrong sign is far outside the tolerance."""
    gen = torch.Generator().manual_seed(0)
    _, q, k = fused_qkv((6,), 2, 2, 16, torch.float32, gen)
    q = q.view(6, 2, 16)
    cos, sin = RotaryEmbedding(16, 10000.0).cos_sin(torch.arange(6).to(DEV) + 3, torch.float32)
    w = norm_weight(16, torch.float32, gen)
    got, _ = kernels.qk_norm_rope(q, k, w, w, cos, sin, 1e-6)
    wrong, _ = R.qk_norm_rope_reference(q, k, w, w, cos, -sin, 1e-6)
    with pytest.raises(AssertionError):
        close(got, wrong, torch.float32)


# --- dispatch -------------------------------------------------------------------------------------------------


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls into the Triton module through the dispatch."""
    calls = []
    mod = fused._triton(interpreted=DEV == "cpu")
    for name in ("add_rmsnorm", "qk_norm_rope", "silu_mul"):
        fn = getattr(mod, name)
        monkeypatch.setattr(
            mod, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n) or _fn(*a, **kw)
        )
    return calls


def small_inputs():
    x = torch.randn(3, 32).to(DEV)
    cos, sin = RotaryEmbedding(16, 10000.0).cos_sin(torch.arange(3).to(DEV), torch.float32)
    q = torch.randn(3, 2, 16).to(DEV)
    return x, torch.ones(32).to(DEV), q, torch.ones(16).to(DEV), cos, sin


def run_all(x, w, q, qw, cos, sin):
    fused.add_rmsnorm(x, x, w, 1e-6)
    fused.rmsnorm(x, w, 1e-6)
    fused.qk_norm_rope(q, q, qw, qw, cos, sin, 1e-6)
    fused.silu_mul(x)


def test_dispatch_switches(monkeypatch, kernel_calls):
    inputs = small_inputs()
    monkeypatch.setenv(fused.INTERPRET_ENV, "1")
    run_all(*inputs)
    assert kernel_calls == ["add_rmsnorm", "add_rmsnorm", "qk_norm_rope", "silu_mul"]
    kernel_calls.clear()
    monkeypatch.setenv(envs.REFERENCE.name, "kernels")
    run_all(*inputs)
    assert kernel_calls == []
    monkeypatch.delenv(envs.REFERENCE.name)
    x, w, q, qw, cos, sin = inputs
    fused.add_rmsnorm(x, x, w.requires_grad_(), 1e-6)  # autograd needs the reference
    assert kernel_calls == []
    fused.qk_norm_rope(
        q, q, qw, qw, cos[:, :12], sin[:, :12], 1e-6
    )  # odd rotary dim pairs: still fine
    fused.qk_norm_rope(
        q[..., :12], None, qw[:12], None, cos[:, :12], sin[:, :12], 1e-6
    )  # D=12: reference
    assert kernel_calls == ["qk_norm_rope"]
    if DEV == "cpu":  # on the CPU the interpreter is opt-in
        kernel_calls.clear()
        monkeypatch.delenv(fused.INTERPRET_ENV)
        run_all(*small_inputs())
        assert kernel_calls == []


# --- whole models through the kernels ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_models_through_kernels_match_reference_path(monkeypatch, kernel_calls, dtype):
    from ddtree.bench.random_pair import build_pair, pair_configs

    shape = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=1e4,
    )
    tcfg, dcfg = pair_configs(shape, 2, 4, "float32")
    target, drafter = build_pair(tcfg, dcfg, torch.device(DEV), dtype, 0)
    for p in list(target.parameters()) + list(drafter.parameters()):
        if p.dim() == 1:  # non-trivial norm weights
            p.data.add_(0.2 * torch.randn_like(p))
    ids = torch.randint(0, 101, (1, 7), generator=torch.Generator().manual_seed(0)).to(DEV)
    taps = tuple(dcfg.target_layer_ids)

    def run():
        with torch.no_grad():
            logits, feats = target.forward_train(ids, tap_layers=taps)
            anchors = torch.tensor([[1, 3]], device=DEV)
            block = target.embed_tokens(ids[:, :4]).unsqueeze(1).expand(1, 2, 4, -1)
            hidden = drafter.forward_train(feats, block, anchors)
        return logits, feats, hidden

    monkeypatch.setenv(envs.REFERENCE.name, "kernels")
    ref = run()
    assert kernel_calls == []
    monkeypatch.delenv(envs.REFERENCE.name)
    monkeypatch.setenv(fused.INTERPRET_ENV, "1")
    got = run()
    layers = tcfg.num_hidden_layers + dcfg.num_hidden_layers
    assert kernel_calls.count("silu_mul") == layers
    assert (
        kernel_calls.count("qk_norm_rope") == layers + dcfg.num_hidden_layers
    )  # + drafter context K
    assert (
        kernel_calls.count("add_rmsnorm") == 2 * layers + 2 + 1
    )  # + final norms + drafter hidden_norm
    for g, r in zip(got, ref):
        close(g, r, dtype) if dtype == torch.float32 else torch.testing.assert_close(
            g.float(), r.float(), rtol=0.1, atol=0.1
        )
        assert rel(g, r) < (1e-5 if dtype == torch.float32 else 3e-2)
