"""`ddtree inflate --dtype fp8`: an inflated pair quantized to block FP8 ([128, 128]) and written in
Qwen's checkpoint layout loads back as stored with the same numbers (state and logits, bit for bit),
equals the model-dtype pair quantized at load (--quantization fp8, and so the servers of
`inflate:SHAPE --quantization fp8`), and its config passes the checks. Tiny shapes whose widths are
not whole 128-blocks (hidden 448, MLP 1100: ragged K blocks, fused parts with per-row scales) and
whole ones (q|k|v rows). ~15 s."""

from __future__ import annotations

import json
import os

import pytest
import torch
from inflate_fixtures import shape
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def written(request, tmp_path_factory):
    """(kind, in-memory FP8 pair, FP8 dir, model-dtype dir)."""
    from ddtree.assets import default_model_paths
    from ddtree.tools.inflate import inflate_pair, write_pair
    from ddtree.tools.inflate.pair import quantize_pair

    t, d = default_model_paths()
    root = tmp_path_factory.mktemp(f"fp8_inflate_{request.param}")
    plain = inflate_pair(t, d, shape(request.param), dtype=torch.float32)
    plain_dir = write_pair(plain, str(root / "plain"), shard_bytes=8 << 20)
    pair = inflate_pair(t, d, shape(request.param), dtype=torch.float32)
    quantize_pair(pair)
    return request.param, pair, write_pair(pair, str(root / "fp8"), shard_bytes=8 << 20), plain_dir


def _bits(state: dict) -> dict:
    return {k: v.contiguous().view(-1).view(torch.uint8) for k, v in state.items()}


def test_written_fp8_pair_is_qwen_layout_and_loads_as_built(written):
    from ddtree.models.loader import load_drafter, load_target
    from ddtree.models.quant import Fp8Linear, checkpoint_state

    kind, pair, (tdir, ddir), _ = written
    with open(os.path.join(tdir, "config.json")) as f:
        quant = json.load(f)["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    assert "lm_head" in quant["modules_to_not_convert"]
    stored = {}
    for name in os.listdir(tdir):
        if name.endswith(".safetensors"):
            stored.update(load_file(os.path.join(tdir, name)))
    fp8 = [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]
    assert fp8 and all(k.endswith(".weight") for k in fp8)
    for k in fp8:  # Qwen's scale shape: [ceil(out / 128), ceil(in / 128)]
        out, inp = stored[k].shape
        scale = stored[k[: -len(".weight")] + ".weight_scale_inv"]
        assert (
            tuple(scale.shape) == (-(-out // 128), -(-inp // 128)) and scale.dtype == torch.float32
        )
    for model, load, path in (
        (pair.target, lambda p: load_target(p, torch.float32), tdir),
        (pair.drafter, lambda p: load_drafter(p, torch.float32), ddir),
    ):
        loaded = load(path)
        assert any(isinstance(m, Fp8Linear) for m in loaded.modules())
        assert _bits(checkpoint_state(loaded)).keys() == _bits(checkpoint_state(model)).keys()
        a, b = _bits(checkpoint_state(loaded)), _bits(checkpoint_state(model))
        assert all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(3, 8192, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = load_target(tdir, torch.float32).forward_train(ids)[0]
        assert torch.equal(got, pair.target.forward_train(ids)[0])


def test_quantizing_the_written_plain_pair_at_load_is_the_fp8_pair(written):
    from ddtree.models.loader import load_drafter, load_target
    from ddtree.models.quant import checkpoint_state

    kind, pair, (tdir, ddir), (ptdir, pddir) = written
    for a, b in (
        (load_target(ptdir, torch.float32, quantization="fp8"), load_target(tdir, torch.float32)),
        (
            load_drafter(pddir, torch.float32, quantization="fp8"),
            load_drafter(ddir, torch.float32),
        ),
    ):
        sa, sb = _bits(checkpoint_state(a)), _bits(checkpoint_state(b))
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_fp8_pair_resolves_and_plans_fp8_bytes(written):
    from ddtree.config import ServerArgs, resolve_server_args
    from ddtree.config.memory_plan import memory_plan

    _, _, (tdir, ddir), (ptdir, _) = written
    args = resolve_server_args(
        ServerArgs(
            model_path=tdir,
            speculative_algorithm="DDTREE",
            speculative_draft_model_path=ddir,
            device="cpu",
        )
    )
    plain = resolve_server_args(ServerArgs(model_path=ptdir, device="cpu"))
    assert args.target_fp8 is not None and not args.target_fp8.at_load
    fp8_plan, plain_plan = memory_plan(args, 8 << 30), memory_plan(plain, 8 << 30)
    assert fp8_plan.target_weight_bytes < 0.5 * plain_plan.target_weight_bytes  # fp32 -> fp8
    assert "block FP8 [128, 128]" in fp8_plan.format()
