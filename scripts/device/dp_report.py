"""The --dp-size device runs' table (scripts/device/dp.sh, dp_multi.sh): per concurrency, each
config's output tok/s, TTFT / TPOT p50 and the HTTP loop's lag from `bench at-scale`'s JSON, and
every config's throughput over the first (the baseline). Usage:
  python3 scripts/device/dp_report.py OUT/at_scale.json [OUT/dp_table.json]"""

from __future__ import annotations

import json
import sys


def rows(serving: dict[str, list[dict]]) -> list[dict]:
    names = list(serving)
    by = {(n, lv["concurrency"]): lv for n in names for lv in serving[n]}
    out = []
    for c in sorted({c for _, c in by}):
        base = by.get((names[0], c))
        for n in names:
            lv = by.get((n, c))
            if lv is None:
                continue
            sv = lv.get("server") or {}
            out.append(
                {
                    "concurrency": c,
                    "config": n,
                    "ok": lv["completed"],
                    "failed": lv["failed"],
                    "tok_s": lv["output_throughput"],
                    "vs_base": lv["output_throughput"] / base["output_throughput"]
                    if base and base["output_throughput"]
                    else None,
                    "ttft_p50_ms": lv["ttft_ms"]["p50"],
                    "tpot_p50_ms": lv["tpot_ms"]["p50"],
                    "tau": lv["mean_accept_length"],
                    "http_loop_lag_ms": sv.get("loop_lag_ms"),
                    "round_ms": sv.get("round_ms"),
                    "host_ms": sv.get("host_ms"),
                }
            )
    return out


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        report = json.load(f)
    table = rows(report.get("serving", {}))
    if not table:
        print("no serving results (see at_scale.log and the server logs)")
        return 1
    base = table[0]["config"]
    print(
        f"{'conc':>4} {'config':>14} {'ok':>4} {'fail':>4} {'tok/s':>9} {'vs ' + base:>12} "
        f"{'TTFT p50':>9} {'TPOT p50':>9} {'tau':>5} {'loop lag':>9} {'round ms':>9} {'host ms':>8}"
    )
    for r in table:
        print(
            f"{r['concurrency']:>4} {r['config']:>14} {r['ok']:>4} {r['failed']:>4} "
            f"{r['tok_s']:>9.1f} {fmt(r['vs_base'], '>11.3f')}x {r['ttft_p50_ms']:>9.1f} "
            f"{r['tpot_p50_ms']:>9.2f} {r['tau']:>5.2f} {fmt(r['http_loop_lag_ms'], '>9.3f')} "
            f"{fmt(r['round_ms'], '>9.2f')} {fmt(r['host_ms'], '>8.2f')}"
        )
    if len(argv) > 1:
        with open(argv[1], "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
