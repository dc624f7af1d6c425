"""Summarise a `DDTREE_POLICY_TRACE` file: per batch size, how often each rung was chosen, what the
policy expected of every rung when it chose (mean tokens per round, seconds, rate, rounds where
the rung rated within 5% of the best) and what the chosen rounds realised (tokens per round,
wall and device ms: each line's `last`, the round before it).

    PYTHONPATH=. python3 studies/policy_trace.py policy_trace_auto.jsonl [--batches 4,8]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

import numpy as np


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(rows: list[dict], batches: list[int] | None = None) -> dict:
    """{bs: {"rounds", "chosen": {rung: n}, "expected": {rung: {tokens, ms, rate, near_best}},
    "realised": {rung: {rounds, tokens, round_ms, device_ms}}}}."""
    out: dict[int, dict] = {}
    by_bs: dict[int, list[dict]] = {}
    for r in rows:
        by_bs.setdefault(r["bs"], []).append(r)
    for bs in sorted(by_bs):
        if batches and bs not in batches:
            continue
        rs = by_bs[bs]
        names = rs[0]["rungs"]
        tok = np.array([r["tokens"] for r in rs])
        ms = np.array([r["ms"] for r in rs])
        rate = np.array([r["rate"] for r in rs])
        near = rate >= 0.95 * rate.max(1, keepdims=True)
        chosen: dict[str, int] = {}
        for r in rs:
            chosen[r["rung"]] = chosen.get(r["rung"], 0) + 1
        out[bs] = {
            "rounds": len(rs),
            "chosen": chosen,
            "expected": {
                n: {
                    "tokens": round(float(tok[:, j].mean()), 2),
                    "ms": round(float(ms[:, j].mean()), 2),
                    "rate": round(float(rate[:, j].mean()), 0),
                    "near_best": int(near[:, j].sum()),
                }
                for j, n in enumerate(names)
            },
        }
    # what the rounds realised: a line's `last` is the round before it, at its own batch size
    real: dict[int, dict[str, list]] = {}
    for r in rows:
        last = r.get("last")
        if last and last["rung"]:
            real.setdefault(last["bs"], {}).setdefault(last["rung"], []).append(last)
    for bs, per in real.items():
        if bs not in out:
            continue
        out[bs]["realised"] = {
            n: {
                "rounds": len(xs),
                "tokens": round(1 + float(np.mean([x["accepted"] for x in xs])), 2),
                "round_ms": round(float(np.mean([x["round_ms"] for x in xs])), 2),
                "device_ms": (
                    round(float(np.mean([x["device_ms"] for x in xs])), 2)
                    if all(x["device_ms"] is not None for x in xs)
                    else None
                ),
            }
            for n, xs in per.items()
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a DDTREE_POLICY_TRACE file (.jsonl or .jsonl.gz)")
    p.add_argument("--batches", help="comma list of batch sizes (default: all)")
    a = p.parse_args(argv)
    batches = [int(x) for x in a.batches.split(",")] if a.batches else None
    for bs, s in summarise(load(a.trace), batches).items():
        print(f"batch {bs}: {s['rounds']} rounds, chosen {s['chosen']}")
        for n, e in s["expected"].items():
            got = s.get("realised", {}).get(n)
            real = (
                f" | realised {got['rounds']} rd: {got['tokens']} tok, {got['round_ms']} ms"
                + (f" (device {got['device_ms']})" if got["device_ms"] is not None else "")
                if got
                else ""
            )
            print(
                f"  {n:>7}: expected {e['tokens']:6.2f} tok, {e['ms']:6.2f} ms, "
                f"{e['rate']:7.0f} tok/s, near best {e['near_best']:4d}{real}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
