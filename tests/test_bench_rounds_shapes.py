"""`bench rounds --shape`: random pairs of the inflate shapes (dense and hybrid)."""

from __future__ import annotations

import json

import pytest


def test_production_shape_configs():
    from ddtree.bench.random_pair import shape_configs

    t, d = shape_configs("qwen3.6-27b", None, 16, "bfloat16")
    assert t.is_hybrid and len(t.linear_layer_ids) == 48 and t.hidden_size == 5120
    assert d.num_hidden_layers == 5 and d.num_attention_heads == 32 and d.head_dim == 128
    assert [d.layer_window(i) for i in range(5)] == [2048] * 4 + [None]
    assert len(d.target_layer_ids) == 5
    t8, d8 = shape_configs("qwen3-8b", None, 16, "bfloat16")
    assert (
        not t8.is_hybrid
        and t8.num_hidden_layers == 36
        and d8.target_layer_ids == (1, 9, 17, 25, 33)
    )


@pytest.mark.parametrize("strategy", ["extra_buffer", "no_buffer"])
def test_hybrid_smoke_run(tmp_path, monkeypatch, strategy):
    """--mamba-strategy acts: every hybrid runner of the run has that commit strategy."""
    from ddtree.bench.rounds import main
    from ddtree.engine import model_runner

    seen = []
    init = model_runner.ModelRunner.__init__

    def spy(self, target, drafter, cfg, *a):
        seen.append(cfg.mamba_strategy)
        init(self, target, drafter, cfg, *a)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", spy)
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "--smoke",
                "--shape",
                "qwen3.6-27b",
                "--rounds",
                "1",
                "--budgets",
                "8",
                "--batch-sizes",
                "1",
                "--accept-lengths",
                "",
                "--output",
                str(out),
                "--no-plot",
                "--mamba-strategy",
                strategy,
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert {r["config"] for r in rows} == {"AR", "DFLASH", "DDTREE B=8"}
    assert all(r["ms"] > 0 for r in rows)
    assert seen and set(seen) == {strategy}


def test_mamba_strategy_is_refused_for_dense_shapes():
    from ddtree.bench.rounds import main

    with pytest.raises(SystemExit, match="hybrid targets only"):
        main(["--smoke", "--mamba-strategy", "no_buffer"])
