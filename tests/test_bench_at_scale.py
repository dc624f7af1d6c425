"""`ddtree bench at-scale`: the table's ratios, and the whole run end to end on the CPU (tiny shape,
one served config, one level)."""

from __future__ import annotations

import json
import os

import pytest
from inflate_fixtures import shape


def _level(c, tput, tau=1.0):
    pct = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 2.0}
    return {
        "concurrency": c,
        "completed": 4,
        "failed": 0,
        "output_throughput": tput,
        "ttft_ms": pct,
        "tpot_ms": pct,
        "mean_accept_length": tau,
    }


def test_table_ratios():
    from ddtree.bench.at_scale_report import table_rows

    rows = table_rows(
        {
            "DFLASH": [_level(1, 200.0), _level(8, 400.0)],
            "NONE": [_level(1, 100.0)],
            "DDTREE B=64": [_level(1, 300.0), _level(8, 200.0)],
        }
    )
    got = {(r["concurrency"], r["config"]): (r["ratio"], r["ratio_to"]) for r in rows}
    assert got[(1, "DFLASH")] == (2.0, "NONE")
    assert got[(1, "DDTREE B=64")] == (1.5, "DFLASH")
    assert got[(8, "DDTREE B=64")] == (0.5, "DFLASH")
    assert got[(8, "DFLASH")] == (None, None)  # no NONE at 8: no ratio, not a wrong one
    assert got[(1, "NONE")] == (None, None)


def test_level_sizes_scale_with_concurrency():
    import argparse

    from ddtree.bench.at_scale import level_items

    ns = argparse.Namespace(min_prompts=4, waves=2)
    assert [len(level_items(list("abc"), c, ns)) for c in (1, 2, 4, 64)] == [4, 4, 8, 128]


def test_bad_config_is_refused(capsys):
    from ddtree.bench.at_scale import main

    assert main(["--configs", "EAGLE"]) == 2
    assert "--configs" in capsys.readouterr().err


def test_smoke_end_to_end(tmp_path):
    """Inflate to a tiny shape, serve it (one config, one level) through launch_server and the
    serving client, and compare τ with the small pair: the same machinery as the H200 run."""
    from ddtree.bench.at_scale import main

    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps({k: v for k, v in shape("dense").items() if k != "drafter"}))
    out = tmp_path / "out"
    rc = main(
        [
            "--smoke",
            "--shape",
            str(spec),
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(out),
            "--configs",
            "DFLASH",
            "--concurrency",
            "1",
            "--parts",
            "serving,tau",
            "--port",
            "30177",
        ]
    )
    assert rc == 0
    report = json.loads((out / "at_scale.json").read_text())
    (row,) = report["table"]
    assert row["config"] == "DFLASH" and row["failed"] == 0 and row["output_tok_s"] > 0
    # greedy, fp32: the inflated pair accepts exactly what the small pair does
    assert report["tau"]["DFLASH"]["inflated"] == pytest.approx(report["tau"]["DFLASH"]["small"])
    assert os.path.exists(out / "at_scale.png")


def test_auto_budget_config():
    from ddtree.bench.at_scale import parse_config
    from ddtree.bench.at_scale_validity import config_name

    assert parse_config("ddtreeauto") == ("DDTREE", "auto") == parse_config("DDTREE-AUTO")
    assert config_name(*parse_config("DDTREEAUTO")) == "DDTREE B=auto"
    assert parse_config("DDTREE16") == ("DDTREE", 16)
