"""FP8 against bf16 served, from one run's JSON: BENCHMARKS rows.

- `bench at-scale` with studies/configs/fp8_serving.json (issue 44): per concurrency, DDTREE `auto`
  over DFLASH with both at FP8, FP8 over bf16 per config (output tokens/s), and tau (accepted
  tokens a round) FP8 vs bf16.
- studies/fp8_served.py's fp8_served.json (issue 58; it has "rows"): `markdown`, the tables
  BENCHMARKS takes: per shape and concurrency output tok/s (tau) of DFLASH / auto in bf16 / FP8
  with their ratios, AR at batch 1 against its weight floor, and what the memory plan or the time
  budget left out.

    python3 studies/fp8_serving_summary.py OUT/at_scale.json | OUT/fp8_served.json
"""

from __future__ import annotations

import json
import sys

PAIRS = {"auto / DFLASH (fp8)": ("DDTREE B=auto fp8", "DFLASH fp8")}
PAIRS |= {"auto / DFLASH (bf16)": ("DDTREE B=auto", "DFLASH")}
PAIRS |= {"fp8 / bf16 DFLASH": ("DFLASH fp8", "DFLASH")}
PAIRS |= {"fp8 / bf16 auto": ("DDTREE B=auto fp8", "DDTREE B=auto")}


CELLS = (("DFLASH", "bf16"), ("DFLASH", "fp8"), ("auto", "bf16"), ("auto", "fp8"))
SHAPES = {"8b": "8B", "27b": "27B"}


def _ratio(a: dict | None, b: dict | None) -> str:
    if not a or not b or not b["output_tok_s"]:
        return "—"
    return f"{a['output_tok_s'] / b['output_tok_s']:.2f}×"


def _cell(r: dict | None, why: str | None) -> str:
    if r is None:
        return f"— ({why})" if why else "—"
    tau = f" ({r['tau']:.2f})" if r.get("tau") else ""
    return f"{r['output_tok_s']:.1f}{tau}"


def markdown(report: dict) -> str:
    """The tables of an fp8_served.json (rows so far: a run cut short gives what it finished)."""
    rows = report.get("rows", [])
    at = {(r["part"], r["config"], r["quant"], r["concurrency"]): r for r in rows}
    why = {}
    for s in report.get("skipped", []):
        part, config, quant = s["run"].split()
        why[(part, config, quant, s.get("concurrency"))] = s["why"]
    for name in report.get("errors", {}):
        why.setdefault((*name.split(), None), "server failed: see the notes")
    bw = report.get("bandwidth", {}).get("bandwidth_Bps", 0) / 1e12
    out = [
        f"device: {report.get('device')}, torch {report.get('torch')}, copy bandwidth "
        f"{bw:.2f} TB/s; {report.get('meta', {}).get('max_tokens')} output tokens, held-out "
        f"prompts, T=0; {report.get('seconds', 0):.0f} s",
    ]
    for part, label in SHAPES.items():
        levels = sorted({r["concurrency"] for r in rows if r["part"] == part})
        levels += sorted(
            {
                s["concurrency"]
                for s in report.get("skipped", [])
                if s["run"].startswith(part + " ") and s.get("concurrency")
            }
            - set(levels)
        )
        if not levels:
            continue
        out += [
            "",
            f"{label}: output tok/s (τ)",
            "",
            "| shape, conc | DFLASH bf16 | DFLASH FP8 | auto bf16 | auto FP8 | auto / DFLASH, "
            "FP8 (bf16) | FP8 / bf16, DFLASH / auto |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in sorted(levels):
            got = [at.get((part, cfg, q, c)) for cfg, q in CELLS]
            cells = [
                _cell(g, why.get((part, cfg, q, c)) or why.get((part, cfg, q, None)))
                for g, (cfg, q) in zip(got, CELLS)
            ]
            df_b, df_f, au_b, au_f = got
            out.append(
                f"| {label}, {c} | "
                + " | ".join(cells)
                + f" | {_ratio(au_f, df_f)} ({_ratio(au_b, df_b)}) | "
                f"{_ratio(df_f, df_b)} / {_ratio(au_f, au_b)} |"
            )
        plans = report.get("plans", {})
        caps = [
            f"{cfg} {q} {plans[n]['running_requests']}"
            for cfg, q in CELLS
            if (n := f"{part} {cfg} {q}") in plans
        ]
        if caps:
            out.append(f"\nrunning requests the memory plan holds: {', '.join(caps)}")
        split = [
            f"{r['config']} {r['quant']} c={r['concurrency']}: {r['round_ms']:.2f} ms, batch "
            f"{r['mean_decode_batch'] or 0:.1f}"
            for r in rows
            if r["part"] == part and r.get("round_ms")
        ]
        if split:
            out.append("per decode round (/metrics): " + "; ".join(split))
    ar = {r["quant"]: r for r in rows if r["part"] == "ar"}
    if ar:
        out += ["", "| AR, batch 1 | round ms | weight floor ms | × floor | output tok/s |"]
        out.append("|---|---|---|---|---|")
        for q in ("bf16", "fp8"):
            r = ar.get(q)
            if r and r.get("round_ms"):
                out.append(
                    f"| {q} | {r['round_ms']:.3f} | {r['floor_ms']:.3f} | "
                    f"{r['round_ms'] / r['floor_ms']:.2f}× | {r['output_tok_s']:.1f} |"
                )
        if ar.get("fp8") and ar.get("bf16") and ar["bf16"].get("round_ms"):
            out.append(f"\nFP8 / bf16 round: {ar['fp8']['round_ms'] / ar['bf16']['round_ms']:.2f}")
    notes = [
        f"{s['run']}" + (f" c={s['concurrency']}" if s.get("concurrency") else "") + f": {s['why']}"
        for s in report.get("skipped", [])
    ]
    notes += [f"{name}: {err}" for name, err in report.get("errors", {}).items()]
    if report.get("startup_s"):
        notes.append(
            "server start-up s: "
            + ", ".join(f"{k} {v:.0f}" for k, v in report["startup_s"].items())
        )
    if report.get("prewarm"):
        notes.append(f"DeepGEMM pre-warm: {report['prewarm']}")
    if notes:
        out += ["", "Not measured / notes:"] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    path = (argv or sys.argv[1:])[0]
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    if "rows" in report:  # studies/fp8_served.py
        print(markdown(report), end="")
        return 0
    serving = report.get("serving", {})
    levels = {
        name: {lv["concurrency"]: lv for lv in rows if lv.get("output_throughput")}
        for name, rows in serving.items()
    }
    conc = sorted({c for rows in levels.values() for c in rows})
    print("output tok/s ratios (same run):")
    print(f"{'':>22} " + " ".join(f"c={c:<5}" for c in conc))
    for label, (a, b) in PAIRS.items():
        cells = []
        for c in conc:
            x, y = levels.get(a, {}).get(c), levels.get(b, {}).get(c)
            cells.append(
                f"{x['output_throughput'] / y['output_throughput']:<7.2f}" if x and y else "-      "
            )
        print(f"{label:>22} " + " ".join(cells))
    print("tau (tokens a round):")
    for name in sorted(levels):
        print(
            f"{name:>22} "
            + " ".join(
                f"{levels[name][c]['mean_accept_length']:<7.2f}" if c in levels[name] else "-      "
                for c in conc
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
