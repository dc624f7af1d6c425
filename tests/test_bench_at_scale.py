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
    from ddtree.tools.studies.at_scale_report import table_rows

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


def test_table_carries_rows_and_round_cost_per_level(capsys):
    """Per concurrency: verify rows per request and their spread, the cost model's round ms
    beside the measured one (auto's rounds); - where the server reported none."""
    from ddtree.tools.studies.at_scale_report import print_table, table_rows

    auto = _level(256, 900.0, tau=2.5)
    auto.update(mean_rows=3.3, rows_spread=1.25, predicted_round_ms=40.5, priced_round_ms=46.9)
    rows = table_rows({"DFLASH": [_level(256, 1000.0)], "DDTREE B=auto": [auto]})
    got = {r["config"]: r for r in rows}
    assert got["DDTREE B=auto"]["rows_per_req"] == 3.3
    assert got["DDTREE B=auto"]["rows_spread"] == 1.25
    assert (got["DDTREE B=auto"]["round_pred_ms"], got["DDTREE B=auto"]["round_meas_ms"]) == (
        40.5,
        46.9,
    )
    assert got["DFLASH"]["rows_per_req"] is None
    print_table(rows)
    head, dflash, line = capsys.readouterr().out.splitlines()
    assert "rows/req" in head and "round pred" in head
    assert line.split()[-7:] == ["3.3", "1.2", "40.50", "46.90", "0.90x", "vs", "DFLASH"]
    assert dflash.split()[-4:] == ["-"] * 4  # no ratio at 256: no NONE level


def test_ceiling_is_the_best_fixed_config_per_level():
    """The oracle fixed budget per concurrency from the run's own configs (auto is not fixed),
    the ratio /metrics' rounds predict, and auto against both."""
    from ddtree.tools.studies.at_scale_report import ceiling_rows

    def lv(c, tput, tau, round_ms, host_ms=0.5):
        return {**_level(c, tput, tau), "round_ms": round_ms, "host_ms": host_ms}

    serving = {
        "NONE": [lv(1, 150.0, 1.0, 5.5), lv(16, 2300.0, 1.0, 6.0)],
        "DFLASH": [lv(1, 600.0, 6.8, 7.5), lv(16, 4400.0, 6.8, 10.5)],
        "DDTREE B=64": [lv(1, 720.0, 9.5, 7.5), lv(16, 3400.0, 9.5, 24.5)],
        "DDTREE B=auto": [lv(1, 690.0, 9.0, 8.5), lv(16, 4000.0, 6.9, 11.5)],  # + costs below
        "DDTREE B=16": [lv(16, 3700.0, 7.5, 12.5)],
    }
    costs = {"1": {"chain": 7.0, "tree64": 9.0}, "32": {"chain": 16.0, "tree16": 18.0}}
    for level in serving["DDTREE B=auto"]:
        level["server"] = {"policy_cost_ms": costs}
    rows = {r["concurrency"]: r for r in ceiling_rows(serving)}
    one, many = rows[1], rows[16]
    assert (one["oracle_config"], one["oracle_ratio"]) == ("DDTREE B=64", pytest.approx(1.2))
    assert one["predicted_config"] == "DDTREE B=64"
    assert one["predicted_ratio"] == pytest.approx((9.5 / 8.0) / (6.8 / 8.0))
    auto = one["adaptive"]["DDTREE B=auto"]
    assert (auto["ratio"], auto["of_oracle"]) == (pytest.approx(1.15), pytest.approx(690 / 720))
    # the cost side: the policy's believed round ms (bucket 1) beside the fixed servers' rounds
    assert auto["cost_ms"] == {
        "chain": {"policy": 7.0, "served": 7.5},
        "tree64": {"policy": 9.0, "served": 7.5},
    }
    # concurrency 16 reads bucket 32 (the next one up, as the graphs run); no tree64 there
    assert set(rows[16]["adaptive"]["DDTREE B=auto"]["cost_ms"]) == {"chain", "tree16"}
    # under load DFLASH is its own oracle (ratio 1), NONE never the predicted one
    assert (many["oracle_config"], many["oracle_ratio"]) == ("DFLASH", 1.0)
    assert many["predicted_config"] == "DFLASH" and many["predicted_ratio"] == 1.0
    assert many["adaptive"]["DDTREE B=auto"]["of_oracle"] == pytest.approx(4000 / 4400)
    # without /metrics (no round_ms) no prediction, not a wrong one; no DFLASH level: no row
    bare = {
        k: [_level(1, v[0]["output_throughput"])] for k, v in serving.items() if k != "DDTREE B=16"
    }
    (row,) = ceiling_rows(bare)
    assert row["predicted_ratio"] is None and row["oracle_config"] == "DDTREE B=64"
    assert ceiling_rows({"NONE": [_level(1, 1.0)]}) == []


def test_level_sizes_scale_with_concurrency():
    import argparse

    from ddtree.tools.studies.at_scale import level_items

    ns = argparse.Namespace(min_prompts=4, waves=2)
    assert [len(level_items(list("abc"), c, ns)) for c in (1, 2, 4, 64)] == [4, 4, 8, 128]


def test_bad_config_is_refused(capsys):
    from ddtree.tools.studies.at_scale import main

    assert main(["--configs", "EAGLE"]) == 2
    assert "--configs" in capsys.readouterr().err


def test_configs_are_data(tmp_path):
    """Named configs, a JSON list of more, and every server's argv from them: an inflate: spec brings
    its own drafter, --server-flags go last."""
    import argparse

    from ddtree.tools.studies.at_scale_serve import load_configs, server_argv

    extra = tmp_path / "more.json"
    flags = ["--speculative-ddtree-budget", "32", "--speculative-ddtree-shadow-linear"]
    env = {"DDTREE_GC_FREEZE": "0"}
    extra.write_text(
        json.dumps(
            [
                {"name": "DDTREE shadow", "algorithm": "ddtree", "flags": flags},
                {"name": "DFLASH 0.5", "algorithm": "dflash", "env": env},
            ]
        )
    )
    cfgs = load_configs("NONE,DFLASH,DDTREE16,DDTREEauto", str(extra))
    assert [c.name for c in cfgs] == [
        "NONE",
        "DFLASH",
        "DDTREE B=16",
        "DDTREE B=auto",
        "DDTREE shadow",
        "DFLASH 0.5",
    ]
    assert [c.budget for c in cfgs] == [None, None, "16", "auto", "32", None]
    assert [dict(c.env) for c in cfgs] == [{}] * 5 + [env]
    ns = argparse.Namespace(
        port=1,
        device="cuda",
        attention_backend="triton",
        levels=[1, 64],
        max_total_tokens=None,
        disable_cuda_graph=False,
        server_flags="--mamba-scheduler-strategy no_buffer",
    )
    argv = server_argv(ns, "inflate:qwen3.6-27b", None, cfgs[4])
    assert "--speculative-draft-model-path" not in argv
    assert argv[argv.index("--model-path") + 1] == "inflate:qwen3.6-27b"
    assert argv[-2:] == ["--mamba-scheduler-strategy", "no_buffer"]
    assert argv[-5:-2] == flags
    for bad in ([{"name": "x"}], [{"name": "x", "algorithm": "EAGLE"}]):
        extra.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="--config-json"):
            load_configs("", str(extra))


def test_a_configs_env_reaches_its_server_alone(tmp_path, monkeypatch):
    """A config's "env" goes to its server's process on top of ours; a config without one
    inherits ours unchanged."""
    import argparse
    import subprocess

    from ddtree.tools.studies import at_scale_serve

    seen = []

    class Exited:
        returncode = 3

        def __init__(self, argv, env=None, **kw):
            seen.append(env)

        def poll(self):
            return 3

    monkeypatch.setattr(subprocess, "Popen", Exited)
    monkeypatch.setenv("AT_SCALE_TEST_OURS", "1")
    ns = argparse.Namespace(port=1, server_timeout_s=5)
    for env in ((("DDTREE_GC_FREEZE", "0"),), ()):
        with pytest.raises(RuntimeError, match="server exited with 3"):
            at_scale_serve.Server(ns, ["x"], str(tmp_path / "log"), env).__enter__()
    assert seen[0]["DDTREE_GC_FREEZE"] == "0" and seen[0]["AT_SCALE_TEST_OURS"] == "1"
    assert seen[1] is None  # inherits ours


def test_smoke_end_to_end(tmp_path):
    """The tiny hybrid shape served from memory (each server gets --model-path inflate:SHAPE and
    builds the pair itself, nothing written), one config, one level, through launch_server and the
    serving client, τ compared with the small pair: the machinery of the H200 27B run."""
    from ddtree.tools.studies.at_scale import main

    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps({k: v for k, v in shape("hybrid").items() if k != "drafter"}))
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
    assert report["meta"]["model_store"] == "memory"  # auto, for a hybrid shape
    assert not (tmp_path / "work").exists()  # nothing written
    # greedy, fp32: the inflated pair accepts exactly what the small pair does
    assert report["tau"]["DFLASH"]["inflated"] == pytest.approx(report["tau"]["DFLASH"]["small"])
    assert len(report["tau"]["DFLASH"]["small_per_prompt"]) == 2  # the sampling error's inputs
    assert report["tau"]["DFLASH"]["small_se"] >= 0
    assert os.path.exists(out / "at_scale.png")


def test_store_resolves_from_the_shape(tmp_path):
    """auto: disk for a dense shape, memory for a hybrid one (the inflate: spec, and nothing built or
    written without the rounds part)."""
    from ddtree.tools.studies.at_scale import build, make_parser, resolve_store

    for kind, store, flags in (("dense", "disk", ""), ("hybrid", "memory", "no_buffer")):
        spec = tmp_path / f"{kind}.json"
        spec.write_text(json.dumps(shape(kind)))
        work = tmp_path / f"work_{kind}"
        ns = make_parser().parse_args(["--shape", str(spec), "--work-dir", str(work)])
        resolve_store(ns)
        assert ns.model_store == store and flags in ns.server_flags
    assert build(ns, {}, need_pair=False) == (None, f"inflate:{spec}", None)
    assert not work.exists()
    ns = make_parser().parse_args(["--shape", str(spec), "--model-store", "disk"])
    resolve_store(ns)
    assert ns.model_store == "disk"  # explicit wins over auto
    ns = make_parser().parse_args(["--shape", str(spec), "--model-store", "disk", "--in-memory"])
    with pytest.raises(ValueError, match="--in-memory contradicts --model-store disk"):
        resolve_store(ns)


def test_auto_budget_config():
    from ddtree.tools.studies.at_scale_serve import parse_config

    cfg = parse_config("ddtreeauto")
    assert cfg.name == "DDTREE B=auto" and cfg.algorithm == "DDTREE" and cfg.budget == "auto"
    assert parse_config("DDTREE16").budget == "16"


def test_the_next_config_is_expected_to_take_the_fastest_time_so_far():
    """2026-12-02: after DFLASH (up in 33 s) and auto (up in 83 s: its start-up profile) the old
    estimate, the last config's time, skipped B=32 and B=16 with 81 s of the 290 s budget left
    (the run ended at 209 s). The fastest config so far is the estimate now (times here are
    illustrative)."""
    from types import SimpleNamespace

    from ddtree.tools.studies.at_scale import config_need_s, over

    assert config_need_s([]) == 0.0
    assert config_need_s([62.0, 114.0]) == 62.0
    import time

    ns = SimpleNamespace(t_start=time.perf_counter() - 209.0, time_budget_s=290.0)
    assert not over(ns, config_need_s([62.0, 114.0])) and over(ns, 114.0)


def test_source_drafter_reaches_the_servers(tmp_path):
    """--source-drafter (a DFlash2 drafter trained for the embedded target) is what an in-memory
    server inflates: its `inflate:` spec names the embedded target and that drafter."""
    from ddtree.assets import default_model_paths
    from ddtree.tools.inflate.source import InflateSource, parse_source
    from ddtree.tools.studies.at_scale import build, make_parser

    ns = make_parser().parse_args(
        ["--model-store", "memory", "--source-drafter", str(tmp_path / "d2")]
    )
    _, tdir, ddir = build(ns, {}, need_pair=False)
    assert ddir is None
    target = default_model_paths()[0]
    assert parse_source(tdir) == InflateSource("qwen3-8b", target, str(tmp_path / "d2"))
    ns = make_parser().parse_args(["--model-store", "memory"])
    assert build(ns, {}, need_pair=False)[1] == "inflate:qwen3-8b"


def test_small_pair_tau_uses_the_source_drafter(monkeypatch):
    """The tau check's small pair is the one the served pair was inflated from: --source-drafter's
    drafter, else the embedded one."""
    from types import SimpleNamespace

    import ddtree
    from ddtree.assets import default_model_paths
    from ddtree.tools.studies import at_scale_validity as val

    seen = []

    class Stop(Exception):
        pass

    def fake_llm(target, **kw):
        seen.append((target, kw["speculative_draft_model_path"]))
        raise Stop

    monkeypatch.setattr(ddtree, "LLM", fake_llm)
    cfg = SimpleNamespace(algorithm="DFLASH", budget=None)
    t, d = default_model_paths()
    for drafter, want in (("/x/d2", "/x/d2"), (None, d)):
        with pytest.raises(Stop):
            val.small_pair_tau(["p"], 4, [cfg], "cpu", drafter)
        assert seen.pop() == (t, want)
