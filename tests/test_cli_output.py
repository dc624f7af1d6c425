"""Help and output of the console script: every generate sampling flag and every bench flag has
help that shows its default, `ddtree bench --help` exits 0, serving tables carry units, `bench
serving` writes strict JSON, and `generate --json` prints only JSON on stdout."""

import argparse
import asyncio
import json
import subprocess
import sys

import pytest
from server_fixtures import REPO_ROOT, build_tiny_pair


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action)


def _flags_lacking(parser, actions) -> list[str]:
    bad = []
    for action in actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = _expanded_help(parser, action) if action.help else ""
        if "default" not in text:
            bad.append(f"{'/'.join(action.option_strings)}: {text!r}")
    return bad


def test_generate_sampling_flags_have_help_and_defaults():
    from ddtree.generate import make_parser

    parser = make_parser()
    group = next(g for g in parser._action_groups if g.title == "generation")
    assert {"--temperature", "--top-p", "--top-k", "--seed", "--max-tokens"} <= {
        s for a in group._group_actions for s in a.option_strings
    }
    assert _flags_lacking(parser, group._group_actions) == []
    top_p = next(a for a in group._group_actions if "--top-p" in a.option_strings)
    assert "(default: 1.0)" in _expanded_help(parser, top_p)


@pytest.mark.parametrize(
    "module", ["ddtree.bench.acceptance", "ddtree.bench.rounds", "ddtree.bench.serving"]
)
def test_every_bench_flag_has_help_and_default(module):
    import importlib

    parser = importlib.import_module(module).make_parser()
    assert _flags_lacking(parser, parser._actions) == []


def test_bench_help_exits_0_and_lists_subcommands(capsys):
    from ddtree.cli import main

    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name in ("acceptance", "rounds", "serving"):
        assert f"\n  {name} " in out
    assert main(["bench"]) == 2 and main(["bench", "nope"]) == 2


def _level(**over) -> dict:
    row = {
        "concurrency": 4,
        "request_rate": float("inf"),
        "completed": 8,
        "failed": 0,
        "errors": [],
        "duration_s": 2.0,
        "request_throughput": 4.0,
        "output_throughput": 512.0,
        "total_token_throughput": 600.0,
        "total_output_tokens": 1024,
        "ttft_ms": {"mean": 9.0, "p50": 8.0, "p90": 12.0, "p99": 15.0},
        "tpot_ms": {"mean": 3.0, "p50": 2.5, "p90": 4.0, "p99": 5.0},
        "e2e_latency_ms": {"mean": 400.0, "p50": 390.0, "p90": 450.0, "p99": 480.0},
        "mean_accept_length": 5.5,
        "requests": None,
    }
    row.update(over)
    return row


def test_serving_table_has_units():
    from ddtree.bench.serving_report import format_table

    header, units, row = format_table([_level()]).splitlines()
    assert (
        "TTFT p50" in header and "(ms)" in units and "(tok/s)" in units and "(tok/round)" in units
    )
    assert len(header) == len(units) == len(row)
    assert row.split()[11] == "5.50" and "512.0" in row  # after "cache hit" (-: not reported)
    assert row.split()[-11:] == ["-"] * 11  # no server metrics in this level
    full = format_table(
        [
            _level(
                mean_budget=12.5,
                mean_rows=13.5,
                rows_spread=2.0,
                predicted_round_ms=9.5,
                priced_round_ms=10.25,
                predicted_accept_length=3.25,
                host_ms=0.4,
                grammar_host_ms=0.75,
                idle_ms=1.25,
            )
        ]
    )
    want = ["12.5", "13.5", "2.0", "9.50", "10.25", "3.25", "-", "0.40", "0.75", "-", "1.25"]
    assert full.splitlines()[2].split()[-11:] == want


def test_serving_level_reads_budgets_from_metrics():
    """bench serving's server-side columns: the /metrics delta of one level."""
    from ddtree.bench.serving_metrics import delta, parse
    from ddtree.engine.budget.planner import RoundRecord
    from ddtree.engine.round.clock import RoundTiming
    from ddtree.server.metrics import ServerMetrics

    m = ServerMetrics("DDTREE", 16)
    m.on_round(
        RoundRecord(17, [16, 16], [3.0, 5.0], [2, 4], timing=RoundTiming(0.008, 0.001)),
        0.0005,
        0.0002,
    )
    before = parse(m.render().decode())
    ph = {"plan": 0.0002, "draft": 0.001, "verify": 0.003, "commit": 0.0005}
    m.on_round(
        RoundRecord(
            9,
            [8, 8, 8],
            [2.0, 2.0, 2.0],
            [1, 3, 2],
            timing=RoundTiming(0.006, 0.002, device_s=0.0045, idle_s=0.001, device_phases=ph),
            predicted_s=0.005,
        ),
        0.001,
        0.0,
    )
    m.on_round(
        RoundRecord(1, [0, 0, 0], [0.0, 0.0, 0.0], [0, 0, 0], timing=RoundTiming(0.004, 0.002)),
        0.001,
        0.0,
    )
    d = delta(before, parse(m.render().decode()))
    assert d["budget_histogram"] == {"0": 3, "8": 3}
    assert d["verify_width_rounds"] == {"9": 1, "1": 1}
    assert d["mean_budget"] == 4.0
    # rows per request-round (1 + budget), their per-round spread, the drafting rows' accept
    # length, and the priced round's predicted vs measured (device) ms
    assert d["mean_rows"] == 5.0 and d["rows_spread"] == 0.0
    assert d["spec_accept_length"] == pytest.approx(3.0)
    assert d["predicted_round_ms"] == pytest.approx(5.0)
    assert d["priced_round_ms"] == pytest.approx(4.5)
    assert d["predicted_accept_length"] == 2.0 and d["realised_accept_length"] == 2.0
    assert abs(d["round_ms"] - 5.0) < 1e-9 and abs(d["host_ms"] - 3.0) < 1e-9
    # the GPU's clock: only the round that carried it (a CPU round has none, not zeros)
    assert d["device_ms"] == pytest.approx(4.5) and d["idle_ms"] == pytest.approx(1.0)
    assert d["device_phase_ms"] == pytest.approx(
        {"plan": 0.2, "draft": 1.0, "verify": 3.0, "commit": 0.5}
    )
    assert d["per_rung"] == {}  # a fixed budget: no rung
    assert delta(None, before) is None


def test_serving_json_is_strict(tmp_path, monkeypatch, capsys):
    """An unpaced run (--request-rate inf, the default) used to write `Infinity`: not JSON."""
    import ddtree.bench.serving as serving

    async def fake_run(ns, items):
        return {
            "base_url": ns.base_url,
            "model": "m",
            "num_prompts": len(items),
            "max_tokens": ns.max_tokens,
            "temperature": ns.temperature,
            "dataset": "synthetic",
            "results": [_level(), _level(concurrency=16, mean_accept_length=float("nan"))],
        }

    monkeypatch.setattr(serving, "run", fake_run)
    monkeypatch.setattr(serving, "plot", lambda report, path: None)
    out = tmp_path / "serving.json"
    assert serving.main(["--num-prompts", "2", "--output", str(out)]) == 0

    def refuse(name):
        raise AssertionError(f"non-JSON constant {name}")

    report = json.loads(out.read_text(), parse_constant=refuse)
    assert report["results"][0]["request_rate"] is None
    assert report["results"][1]["mean_accept_length"] is None
    assert "(tok/round)" in capsys.readouterr().out
    asyncio.run(asyncio.sleep(0))  # the patched coroutine left no loop behind


def test_generate_json_prints_only_json_on_stdout(tmp_path):
    target, drafter = build_tiny_pair(str(tmp_path))
    cmd = [
        sys.executable,
        "-m",
        "ddtree",
        "generate",
        "--model-path",
        target,
        "--speculative-algorithm",
        "DDTREE",
        "--speculative-draft-model-path",
        drafter,
        "--device",
        "cpu",
        "--max-tokens",
        "6",
        "--prompt",
        "ab",
        "--prompt",
        "cd",
        "--json",
        "--compare-ar",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]  # every stdout line parses
    assert [r["prompt"] for r in rows] == ["ab", "cd"] and all("token_ids" in r for r in rows)
    assert "speed-up DDTREE over AR at batch 1" in proc.stderr  # the statistics went to stderr
    # the AR run really decoded (its args are the speculative run's with the algorithm replaced)
    assert "outputs identical to AR: True" in proc.stderr, proc.stderr[-2000:]


def test_plots_are_optional(monkeypatch, tmp_path, capsys):
    """Without matplotlib (`pip install .`, no tools extra) a bench skips its PNG with one line and
    writes its JSON as always."""
    import sys

    from ddtree.bench import plots, serving

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert plots.pyplot() is None
    assert "ddtree[tools]" in capsys.readouterr().err
    report = {"results": [], "model": "m", "num_prompts": 0, "max_tokens": 1}
    assert serving.plot(report, str(tmp_path / "x.png")) is False
    assert not (tmp_path / "x.png").exists()
