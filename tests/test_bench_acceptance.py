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
