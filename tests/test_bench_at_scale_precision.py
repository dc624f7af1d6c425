"""The bf16 DFLASH study's machinery: the engine's rounds walked on fixed text, and in fp32 the
inflated pair's fixed-text acceptance is the small pair's exactly (so a bf16 gap is rounding)."""

from __future__ import annotations

import json

import pytest
import torch
from inflate_fixtures import shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_walk_tau_follows_the_rounds():
    from ddtree.tools.studies.at_scale_precision import walk_tau

    # anchors 0..5: accept 2 at 0 -> next round at 3 (accept 0) -> at 4 (accept 1) -> done at 6
    assert walk_tau(torch.tensor([2, 9, 9, 0, 1, 9])) == pytest.approx((3 + 1 + 2) / 3)
    assert walk_tau(torch.tensor([0, 0])) == 1.0


def test_fp32_inflated_equals_small_on_fixed_text(tmp_path):
    from ddtree.tools.studies.at_scale_precision import main

    spec = tmp_path / "dense.json"
    spec.write_text(json.dumps(shape("dense")))
    out = tmp_path / "rows.json"
    argv = ["--shape", str(spec), "--prompts", "1", "--tokens", "24", "--variants", "big-fp32"]
    assert main(argv + ["--json", str(out)]) == 0
    small, big = json.loads(out.read_text())["rows"]
    assert (small["variant"], big["variant"]) == ("small-fp32", "big-fp32")
    assert big["tau_rounds"] == small["tau_rounds"] and big["tau_tf"] == small["tau_tf"]
    assert big["target_top1_agree"] == 1.0 and big["chains_shorter"] == 0
    assert small["tau_rounds"] > 1.5  # the drafts are accepted at all
