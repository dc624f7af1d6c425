#!/usr/bin/env python3
"""Summarise an Nsight Compute SASS source page (`ncu -i R --page source --csv --print-source sass > F.csv`):
stall-reason totals over the kernel and the instructions that collect the most warp-stall samples.

    python3 bench/ncu_sass_summary.py F.csv [--top 25]
"""

import argparse
import csv
from collections import Counter


def load(path):
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = rows[head]
    return cols, [dict(zip(cols, r)) for r in rows[head + 1 :] if len(r) == len(cols)]


def num(v):
    try:
        return float(v)
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    cols, rows = load(a.csv)
    stalls = [c for c in cols if c.startswith("stall_") and "(Not Issued)" not in c]
    total = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rows)
    per = Counter({s: sum(num(r[s]) for r in rows) for s in stalls})
    print(f"{len(rows)} instructions, {total:.0f} samples")
    print(
        "stalls: "
        + ", ".join(f"{s[6:]} {100 * v / total:.1f}%" for s, v in per.most_common(8) if v)
    )
    ops = Counter()
    for r in rows:
        ops[r["Source"].split()[0] if r["Source"].split() else "?"] += num(
            r["Warp Stall Sampling (All Samples)"]
        )
    print("by opcode: " + ", ".join(f"{o} {100 * v / total:.1f}%" for o, v in ops.most_common(12)))
    top = sorted(rows, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))[: a.top]
    for r in top:
        n = num(r["Warp Stall Sampling (All Samples)"])
        why = sorted(((num(r[s]), s[6:]) for s in stalls), reverse=True)[:2]
        print(
            f"{100 * n / total:5.1f}%  {r['Address'][-5:]}  {r['Source'].strip()[:60]:60s} "
            + " ".join(f"{w}:{100 * v / max(n, 1):.0f}%" for v, w in why if v)
        )


if __name__ == "__main__":
    main()
