"""`ddtree bench acceptance` end to end on the embedded pair: JSON rows, plots, and a folder it creates."""

import json

from ddtree.bench.acceptance import main


def test_acceptance_rows_and_plots(tmp_path, one_torch_thread):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "import json\n\n\ndef load(path):\n    "}) + "\n")
    out = tmp_path / "not" / "yet" / "acc.json"
    assert (
        main(
            [
                "--prompts-file",
                str(prompts),
                "--budgets",
                "8,32",
                "--shadow-linear",
                "off,on",
                "--temperature",
                "0",
                "--max-tokens",
                "24",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    assert [(r["algorithm"], r["budget"], r["shadow_linear"]) for r in rows] == [
        ("DFLASH", None, False),
        ("DDTREE", 8, False),
        ("DDTREE", 8, True),
        ("DDTREE", 32, False),
        ("DDTREE", 32, True),
    ]
    for r in rows:
        assert set(r) >= {
            "algorithm",
            "budget",
            "shadow_linear",
            "temperature",
            "tau",
            "rounds",
            "tokens",
        }
        assert (
            r["tokens"] == 24 and abs(r["tau"] - (r["tokens"] - 1) / r["rounds"]) < 0.006
        )  # the first token comes from prefill
    assert rows[0]["tau"] > 2, "the embedded drafter is accepted"
    assert (out.parent / "acc_tau.png").stat().st_size > 0 and (
        out.parent / "acc_hist.png"
    ).stat().st_size > 0


def test_dflash_and_dflash2_in_one_table(tmp_path, one_torch_thread, capsys):
    """Two drafters, one table: a DFlash2 drafter warm-started from the embedded DFlash one
    (identity convolutions, zero rescoring) drafts DFlash's chain exactly, so their DFLASH rows
    agree, and so do DDTree over its unary marginals and DFlash's DDTREE; its DDTREE rows come per
    tree (path-conditioned, marginal). ~50 s."""
    from ddtree.assets import default_model_paths
    from ddtree.models.configs import DrafterConfig, TargetConfig
    from ddtree.models.drafters import build_drafter
    from ddtree.models.loader import save_model
    from ddtree.tools.train.drafter import drafter_config_for
    from ddtree.tools.train.selector import warm_start

    t, d = default_model_paths()
    src = json.loads(open(f"{d}/config.json").read())
    cfg = drafter_config_for(
        TargetConfig.from_path(t),
        src["num_hidden_layers"],
        src["block_size"],
        src["dflash_config"]["mask_token_id"],
        tuple(src["dflash_config"]["target_layer_ids"]),
        torch_dtype="float32",
        architecture="DFlash2DraftModel",
        selector_rank=16,
    )
    drafter = build_drafter(DrafterConfig.from_dict(cfg))
    warm_start(drafter, d)
    save_model(drafter, str(tmp_path / "d2"), cfg)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "import json\n\n\ndef load(path):\n    "}) + "\n")
    out = tmp_path / "acc.json"
    argv = ["--speculative-draft-model-path", f"{d},{tmp_path / 'd2'}", "--budgets", "16"]
    argv += ["--shadow-linear", "off", "--temperature", "0", "--max-tokens", "24"]
    assert main(argv + ["--prompts-file", str(prompts), "--output", str(out)]) == 0
    rows = json.loads(out.read_text())
    keys = [(r["drafter"].split()[0], r["algorithm"], r["tree"]) for r in rows]
    assert keys == [
        ("DFlash", "DFLASH", None),
        ("DFlash", "DDTREE", None),
        ("DFlash2", "DFLASH", None),
        ("DFlash2", "DDTREE", "path"),
        ("DFlash2", "DDTREE", "marginal"),
    ]
    assert rows[0]["tau"] == rows[2]["tau"] > 2
    assert rows[1]["tau"] == rows[4]["tau"]  # the marginal tree reads the same unary logits
    text = capsys.readouterr().out
    assert "best DDTREE B=16" in text and "x its DFLASH chain" in text
