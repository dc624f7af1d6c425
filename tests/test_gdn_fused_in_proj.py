"""The GDN layer's one in_proj GEMM at inference (models/gated_deltanet.py): HF's four weights become
row views of one tensor on the first forward without autograd; the outputs equal the four GEMMs'
(training's path), writes into a part (loading, an optimizer) reach the fused weight, and weights
moved by `.to()` are fused again rather than read stale."""

import torch

from ddtree.models.configs import TargetConfig
from ddtree.models.gated_deltanet import IN_PROJ_PARTS, GatedDeltaNet
from ddtree.tools.train.toy import toy_hybrid_target_config


def _layer(seed=0):
    torch.manual_seed(seed)
    return GatedDeltaNet(TargetConfig.from_dict(toy_hybrid_target_config()))


def _parts(layer):
    return [getattr(layer, n).weight for n in IN_PROJ_PARTS]


def test_one_gemm_equals_the_four_and_shares_their_storage():
    layer = _layer()
    x = torch.randn(2, 5, layer.in_proj_qkv.in_features)
    train = layer(x, 0, None)  # autograd: HF's four GEMMs
    assert layer._fused is None
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with torch.no_grad():
        infer = layer(x, 0, None)
    w = layer._fused
    assert w is not None and w.shape[0] == sum(layer.in_splits)
    # the same sums up to fp32 rounding: MKL blocks a [*, 2H+...] GEMM and four narrower ones
    # alike on some CPUs (bit-equal) and not on others (AVX-512 here: 9e-8 on values ~0.6)
    torch.testing.assert_close(infer, train.detach(), rtol=1e-6, atol=1e-6)
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
    off = 0
    for p in _parts(layer):  # row views, no second copy
        assert p.data_ptr() == w[off].data_ptr() and p.requires_grad
        off += p.shape[0]


def test_writes_reach_the_fused_weight_and_moves_refuse():
    layer = _layer(1)
    x = torch.randn(3, layer.in_proj_qkv.in_features)
    with torch.no_grad():
        layer(x, 0, None)
        w = layer._fused
        layer.in_proj_z.weight.mul_(2)  # an optimizer step / a checkpoint copy into one part
        z = layer._in_proj(x)[1]
        assert layer._fused is w
        # the write is in the fused weight itself; its output is the part's GEMM up to fp32
        # rounding (one wide GEMM vs a narrow one: MKL's blocking differs by CPU), while a stale
        # weight would be off by a factor of 2
        z_rows = w[layer.in_splits[0] : layer.in_splits[0] + layer.in_splits[1]]
        assert torch.equal(z_rows, layer.in_proj_z.weight)
        torch.testing.assert_close(
            z, torch.nn.functional.linear(x, layer.in_proj_z.weight), rtol=1e-6, atol=1e-6
        )
    layer = layer.double()  # new storages for every parameter: the old fused tensor is stale
    with torch.no_grad():
        outs = layer._in_proj(x.double())
    assert layer._fused is not w and layer._fused.dtype == torch.float64
    for o, p in zip(outs, _parts(layer)):
        ref = torch.nn.functional.linear(x.double(), p)
        torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
