"""Issue 44's serving comparison from a `bench at-scale` JSON run with studies/configs/fp8_serving.json:
per concurrency, DDTREE `auto` over DFLASH with both at FP8, FP8 over bf16 per config (output
tokens/s), and tau (accepted tokens a round) FP8 vs bf16.

    python3 studies/fp8_serving_summary.py OUT/at_scale.json
"""

from __future__ import annotations

import json
import sys

PAIRS = {"auto / DFLASH (fp8)": ("DDTREE B=auto fp8", "DFLASH fp8")}
PAIRS |= {"auto / DFLASH (bf16)": ("DDTREE B=auto", "DFLASH")}
PAIRS |= {"fp8 / bf16 DFLASH": ("DFLASH fp8", "DFLASH")}
PAIRS |= {"fp8 / bf16 auto": ("DDTREE B=auto fp8", "DDTREE B=auto")}


def main(argv=None) -> int:
    path = (argv or sys.argv[1:])[0]
    with open(path, encoding="utf-8") as f:
        serving = json.load(f).get("serving", {})
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
