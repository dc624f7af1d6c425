"""Block-FP8 checkpoints (Qwen's layout, written by tests/fp8_fixtures.py from the toy pairs): they load
as stored (weights, scales), their logits stay within a stated bound of the dequantized model's,
quantizing the model-dtype checkpoint at load gives the same model bit for bit, and every layout that
would be read wrongly is refused before any weight is read, naming the field and the fix. ~10 s."""

from __future__ import annotations

import json
import os

import pytest
import torch
from fp8_fixtures import dequantized_checkpoint, quantize_block, write_fp8_checkpoint

from ddtree.config import ServerArgs, resolve_server_args
from ddtree.config.memory_plan import rank_weight_bytes, served_fp8
from ddtree.models import checkpoint as ckpt
from ddtree.models import loader
from ddtree.models.checkpoint import at_load_layout, target_linear_shapes
from ddtree.models.configs import ConfigError, TargetConfig
from ddtree.models.loader import load_drafter, load_target
from ddtree.models.quant import Fp8Linear


@pytest.fixture(scope="module")
def fp8_pairs(toy_pair, toy_hybrid_pair, tmp_path_factory):
    """{kind: (fp8 target, fp8 drafter, source target, source drafter)}."""
    root = tmp_path_factory.mktemp("fp8_pairs")
    out = {}
    for kind, (t, d) in (("dense", toy_pair), ("hybrid", toy_hybrid_pair)):
        ft = write_fp8_checkpoint(t, str(root / kind / "target"))
        fd = write_fp8_checkpoint(d, str(root / kind / "drafter"))
        out[kind] = (ft, fd, t, d)
    return out


def _parts(model) -> dict:
    """HF-named state dict of a model (the fused projections' parts)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_stored_fp8_loads_its_weights_and_scales(fp8_pairs, kind):
    from safetensors.torch import load_file

    ft, fd, _, _ = fp8_pairs[kind]
    for path, load in ((ft, load_target), (fd, lambda p: load_drafter(p, torch.float32))):
        stored = load_file(os.path.join(path, "model.safetensors"))
        model = load(path)
        n_fp8 = sum(isinstance(m, Fp8Linear) for m in model.modules())
        assert n_fp8 > 0
        state = _parts(model)
        rename = ckpt.target_rename("model.") if load is load_target else ckpt.drafter_rename
        scales = 0
        for key, t in stored.items():
            name = rename(key)
            if t.dtype == torch.float8_e4m3fn:
                assert state[name].dtype == torch.float8_e4m3fn
                assert torch.equal(state[name].view(torch.uint8), t.view(torch.uint8)), key
            elif key.endswith("weight_scale_inv"):
                got, rows = state[name], stored[key[: -len("_scale_inv")]].shape[0]
                if got.shape[0] != t.shape[0]:  # a fused part's scales repeated per row
                    assert got.shape[0] == rows
                    got = got[::128]
                assert torch.equal(got, t.float()), key
                scales += 1
            else:
                assert torch.equal(state[name], t), key
        assert scales == len([k for k in stored if k.endswith("_scale_inv")]) > 0


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_quantize_at_load_is_the_stored_checkpoint(fp8_pairs, kind):
    """--quantization fp8 on the model-dtype checkpoint = the block-FP8 checkpoint of the same
    weights, bit for bit (the same block math), and so are the logits."""
    ft, fd, t, d = fp8_pairs[kind]
    stored, at_load = load_target(ft), load_target(t, quantization="fp8")
    a, b = _parts(stored), _parts(at_load)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(
            a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)
        ), k
    ids = torch.randint(4, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(stored.forward_train(ids)[0], at_load.forward_train(ids)[0])
    ds, dl = load_drafter(fd, torch.float32), load_drafter(d, torch.float32, quantization="fp8")
    for k, v in _parts(ds).items():
        assert torch.equal(
            v.view(-1).view(torch.uint8), _parts(dl)[k].view(-1).view(torch.uint8)
        ), k


# The FP8 model differs from the model of its dequantized weights only by quantizing activations per
# token in groups of 128 (e4m3's 3 mantissa bits: a rounding error of RMS 2^-4 / sqrt(3) ~ 3.6% of
# each element). Measured on these toy pairs (seeded ids): ||diff|| / ||logits|| 0.032 dense, 0.028
# hybrid (max |diff| / max |logit| 0.042, 0.055); the bounds hold about 2x margin. The original fp32
# model is further off (weights quantized too: 0.046, 0.040), printed beside it.
LOGIT_BOUND = 0.06
LOGIT_MAX_BOUND = 0.12


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_logits_match_the_dequantized_model(fp8_pairs, kind, tmp_path):
    ft, _, t, _ = fp8_pairs[kind]
    fp8 = load_target(ft)
    deq = load_target(dequantized_checkpoint(ft, str(tmp_path / "deq")))
    assert not any(isinstance(m, Fp8Linear) for m in deq.modules())
    ids = torch.randint(4, 64, (3, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, ref = fp8.forward_train(ids)[0], deq.forward_train(ids)[0]
        orig = load_target(t).forward_train(ids)[0]
    err = ((got - ref).norm() / ref.norm()).item()
    worst = ((got - ref).abs().max() / ref.abs().max()).item()
    vs_orig = ((got - orig).norm() / orig.norm()).item()
    print(f"{kind}: fp8 vs dequantized {err:.4f} (max {worst:.4f}), vs original {vs_orig:.4f}")
    assert 0 < err < LOGIT_BOUND and worst < LOGIT_MAX_BOUND
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_unquant_drafter_is_the_dequantized_drafter(fp8_pairs, tmp_path):
    _, fd, _, _ = fp8_pairs["dense"]
    got = load_drafter(fd, torch.float32, quantization="unquant")
    ref = load_drafter(dequantized_checkpoint(fd, str(tmp_path / "deq")), torch.float32)
    assert not any(isinstance(m, Fp8Linear) for m in got.modules())
    a, b = got.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _bad(fp8_pairs, tmp_path, edit_tensors=None, edit_quant=None, drop_quant=False, **kw):
    _, _, t, _ = fp8_pairs["dense"]
    path = write_fp8_checkpoint(
        t, str(tmp_path / "bad"), edit_tensors=edit_tensors, edit_quant=edit_quant, **kw
    )
    if drop_quant:
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        del cfg["quantization_config"]
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    return path


SCALE = "model.layers.0.mlp.down_proj.weight_scale_inv"
K_PROJ = "model.layers.1.self_attn.k_proj"


def _fp8_lm_head(t):
    t["lm_head.weight"], t["lm_head.weight_scale_inv"] = quantize_block(
        t["lm_head.weight"], (128, 128)
    )


def _k_proj_unquantized(t):  # one part of the fused q|k|v kept in the model dtype
    t[K_PROJ + ".weight"] = t[K_PROJ + ".weight"].float()
    del t[K_PROJ + ".weight_scale_inv"]


REFUSALS = {
    "gptq": (
        dict(edit_quant=lambda q: q.update(quant_method="gptq")),
        "quant_method 'gptq' is not supported",
    ),
    "awq": (
        dict(edit_quant=lambda q: q.update(quant_method="awq")),
        "quant_method 'awq' is not supported",
    ),
    "bad block": (
        dict(edit_quant=lambda q: q.update(weight_block_size=[128, 100])),
        "weight_block_size [128, 100] is not supported",
    ),
    "one-number block": (
        dict(edit_quant=lambda q: q.update(weight_block_size=[128])),
        "weight_block_size [128] is not supported",
    ),
    "per-tensor": (dict(edit_quant=lambda q: q.pop("weight_block_size")), "no weight_block_size"),
    "static": (
        dict(edit_quant=lambda q: q.update(activation_scheme="static")),
        "activation_scheme 'static'",
    ),
    "e5m2": (dict(edit_quant=lambda q: q.update(fmt="e5m2")), "fmt 'e5m2'"),
    "unknown field": (
        dict(edit_quant=lambda q: q.update(kv_cache_scheme="fp8")),
        "fields ddtree does not know (kv_cache_scheme)",
    ),
    "block != scales": (
        dict(edit_quant=lambda q: q.update(weight_block_size=[64, 64])),
        "weight_block_size does not match",
    ),
    "missing scale": (dict(edit_tensors=lambda t: t.pop(SCALE)), f"without {SCALE}"),
    "no config": (dict(drop_quant=True), "has no quantization_config"),
    "fp8 lm_head": (
        dict(edit_tensors=_fp8_lm_head),
        "lm_head.weight is stored FP8, but ddtree serves that tensor only in the model dtype",
    ),
    "half a fused projection": (dict(edit_tensors=_k_proj_unquantized), "fused projection parts"),
    "per-tensor scale tensor": (
        dict(
            edit_tensors=lambda t: t.update(
                {"model.layers.0.mlp.down_proj.input_scale": torch.ones(1)}
            )
        ),
        "input_scale: per-tensor or static FP8 scales",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_layout_it_cannot_read_is_refused_before_weights_load(
    fp8_pairs, tmp_path, monkeypatch, case
):
    kw, message = REFUSALS[case]
    path = _bad(fp8_pairs, tmp_path, **kw)
    with pytest.raises(ConfigError) as e:
        resolve_server_args(ServerArgs(model_path=path, device="cpu"))
    assert any(message in line and "--model-path" in line for line in e.value.problems), (
        e.value.problems
    )

    def no_weights(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(loader, "safe_open", no_weights)
    with pytest.raises(
        ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        load_target(path)


def test_fp8_needs_fp8_tensor_cores(fp8_pairs):
    ft, fd, t, d = fp8_pairs["dense"]
    for args in (
        ServerArgs(model_path=ft, device="cuda"),
        ServerArgs(model_path=t, device="cuda", quantization="fp8"),
        ServerArgs(
            model_path=t,
            device="cuda",
            speculative_algorithm="DFLASH",
            speculative_draft_model_path=fd,
        ),
    ):
        with pytest.raises(ConfigError, match="sm_80: serve the bf16 checkpoint"):
            resolve_server_args(args, capability=(8, 0))
        assert resolve_server_args(args, capability=(8, 9)).device == "cuda"
    # an FP8 drafter served in the model dtype needs none
    args = ServerArgs(
        model_path=t,
        device="cuda",
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=fd,
        speculative_draft_quantization="unquant",
    )
    assert resolve_server_args(args, capability=(8, 0)).drafter_fp8 is not None


def test_memory_plan_counts_the_fp8_bytes_that_load(fp8_pairs):
    from ddtree.engine.setup import module_bytes

    for kind in ("dense", "hybrid"):
        ft, fd, t, d = fp8_pairs[kind]
        for target, drafter, kw in (
            (ft, fd, {}),
            (t, d, {"quantization": "fp8", "speculative_draft_quantization": "fp8"}),
            (ft, fd, {"speculative_draft_quantization": "unquant"}),
        ):
            args = resolve_server_args(
                ServerArgs(
                    model_path=target,
                    speculative_algorithm="DDTREE",
                    speculative_draft_model_path=drafter,
                    device="cpu",
                    **kw,
                )
            )
            loaded = module_bytes(
                load_target(target, torch.float32, quantization=args.quantization),
                load_drafter(
                    drafter, torch.float32, quantization=args.speculative_draft_quantization
                ),
            )
            planned = rank_weight_bytes(
                args.target_config, args.drafter_config, 1, "float32", served_fp8(args)
            )
            assert planned == loaded, (kind, kw)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_rank_fp8_bytes_are_what_a_27b_rank_builds(tp):
    """check-config's per-rank FP8 weights = the parameters of the FP8 model a rank builds."""
    from ddtree.models.loader import build_target
    from ddtree.models.parallel import TPGroup
    from ddtree.models.quant import to_fp8
    from ddtree.models.shapes import QWEN36_27B
    from ddtree.models.tp_layout import fp8_cuts, shard_target

    t = TargetConfig.from_dict(QWEN36_27B)
    layout = at_load_layout(target_linear_shapes(t), ckpt.TARGET_LINEARS, None)
    assert fp8_cuts(t, tp, layout.shapes, layout.block) == []
    with torch.device("meta"):
        model = build_target(shard_target(t, tp), TPGroup(0, tp)).to(torch.bfloat16)
        # per layer: gate|up and down, + q|k|v|z and out (48 GDN) or q|k|v and o (16 attention)
        assert to_fp8(model, layout) == 64 * 2 + 48 * 2 + 16 * 2
    built = {id(p): p for p in model.parameters()}
    n = sum(p.numel() * p.element_size() for p in built.values())
    assert rank_weight_bytes(t, None, tp, "bfloat16", (layout, None)) == n


def test_tp_that_cuts_blocks_is_refused(fp8_pairs):
    ft, fd, t, d = fp8_pairs["dense"]
    with pytest.raises(ConfigError, match="--tp-size 2 cuts the FP8 weight blocks"):
        resolve_server_args(ServerArgs(model_path=ft, device="cpu", tp_size=2))


def test_vlm_layout_fp8_checkpoint(tmp_path):
    """Qwen3.5 / 3.6 FP8 checkpoints are VLM-shaped (`model.language_model.*`, a vision tower, an MTP
    head, which may be FP8 too and are never loaded); the text model loads in FP8, bit for bit the
    model-dtype VLM checkpoint quantized at load. (Not against the dequantized model: this random
    tiny model moves its logits by ~25% under weight quantization alone, so a bound says nothing.)"""
    from hybrid_fixtures import save_hf_qwen3_5_vlm

    src = tmp_path / "vlm"
    save_hf_qwen3_5_vlm(src)

    def add_fp8_mtp(t):
        w = torch.randn(64, 64)
        t["mtp.fc.weight"], t["mtp.fc.weight_scale_inv"] = quantize_block(w, (128, 128))

    path = write_fp8_checkpoint(str(src), str(tmp_path / "fp8"), edit_tensors=add_fp8_mtp)
    with open(os.path.join(path, "config.json")) as f:
        assert "model.language_model.lm_head" not in json.load(f)["quantization_config"]
    args = resolve_server_args(ServerArgs(model_path=path, device="cpu"))
    assert args.target_fp8 is not None and all(
        n.startswith("model.layers.") for n in args.target_fp8.shapes
    )
    fp8, at_load = load_target(path), load_target(str(src), quantization="fp8")
    assert sum(isinstance(m, Fp8Linear) for m in fp8.modules()) > 4
    a, b = _parts(fp8), _parts(at_load)
    assert a.keys() == b.keys()
    assert all(
        torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)) for k in a
    )
    ids = torch.randint(2, 64, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(fp8.forward_train(ids)[0], at_load.forward_train(ids)[0])
