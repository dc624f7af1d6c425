"""studies/fp8_served.py's decisions that the device run cannot afford to get wrong: which levels the
memory plan lets a server take, the order of the servers, and the BENCHMARKS tables from its rows
(a run cut short, a level the plan refused, a server that failed)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "studies"))

import fp8_served  # noqa: E402
import fp8_serving_summary as summary  # noqa: E402


def test_levels_past_the_plans_cap_are_skipped_and_the_cap_measured():
    assert fp8_served.plan_levels((1, 8, 32, 64), 98) == ([1, 8, 32, 64], [])
    assert fp8_served.plan_levels((1, 8, 32, 64), 58) == ([1, 8, 32, 58], [64])
    assert fp8_served.plan_levels((1, 8, 32, 64), 32) == ([1, 8, 32], [64])  # the cap is a level
    assert fp8_served.plan_levels((1, 8, 32, 64), 15) == ([1, 8, 15], [32, 64])
    assert fp8_served.plan_levels((8,), 0) == ([], [8])  # holds none: nothing to measure


def test_the_8b_table_comes_first_and_each_part_keeps_its_flags():
    ns = fp8_served.make_parser().parse_args(["--parts", "8b,ar,27b"])
    runs = fp8_served.plan_runs(ns)
    assert [r.name for r in runs[:4]] == [
        "8b DFLASH bf16",
        "8b DFLASH fp8",
        "8b auto fp8",
        "8b auto bf16",
    ]
    assert [r.name for r in runs[4:6]] == ["ar AR bf16", "ar AR fp8"]
    assert runs[4].levels == (1,) and runs[6].name == "27b DFLASH bf16"  # beside the pre-warm
    ns.device, ns.attention_backend = "cuda", "triton"
    flags = fp8_served.server_flags(ns, runs[2])
    assert flags[flags.index("--model-path") + 1] == "inflate:qwen3-8b"
    assert "--speculative-draft-quantization" in flags and "auto" in flags
    ar = fp8_served.server_flags(ns, runs[5])  # AR has no drafter to quantize
    assert "--quantization" in ar and "--speculative-draft-quantization" not in ar
    assert "--disable-radix-cache" in fp8_served.server_flags(ns, runs[6])


def _row(part, config, quant, c, tok_s, tau=None, **kw):
    return dict(
        part=part,
        config=config,
        quant=quant,
        concurrency=c,
        output_tok_s=tok_s,
        tau=tau,
        mean_decode_batch=1.0,
        failed=0,
        **{"round_ms": None, **kw},
    )


def test_markdown_gives_the_ratios_and_says_what_was_left_out():
    report = {
        "device": "H100",
        "meta": {"max_tokens": 128},
        "bandwidth": {"bandwidth_Bps": 3.0e12},
        "rows": [
            _row("8b", "DFLASH", "bf16", 64, 100.0, 6.5),
            _row("8b", "DFLASH", "fp8", 64, 150.0, 6.6),
            _row("8b", "auto", "fp8", 64, 180.0, 7.0),
            _row("ar", "AR", "bf16", 1, 140.0, round_ms=7.0, floor_ms=5.0),
            _row("ar", "AR", "fp8", 1, 190.0, round_ms=5.4, floor_ms=2.7),
            _row("27b", "auto", "bf16", 15, 900.0, 8.0),
        ],
        "skipped": [
            {"run": "8b auto bf16", "why": "time budget (20 s left)"},
            {"run": "27b auto bf16", "concurrency": 64, "why": "plan holds 15"},
        ],
        "errors": {"27b DFLASH fp8": "server exited with 1"},
        "plans": {"27b auto bf16": {"running_requests": 15}},
    }
    md = summary.markdown(report)
    assert (
        "| 8B, 64 | 100.0 (6.50) | 150.0 (6.60) | — (time budget (20 s left)) | 180.0 (7.00) |"
        in md
    )
    assert "| 1.20× (—) | 1.50× / — |" in md  # auto / DFLASH at FP8; FP8 / bf16 DFLASH
    assert "| 27B, 64 | — | — (server failed: see the notes) | — (plan holds 15) | — |" in md
    assert "| fp8 | 5.400 | 2.700 | 2.00× | 190.0 |" in md
    assert "auto bf16 15" in md and "27b DFLASH fp8: server exited with 1" in md
