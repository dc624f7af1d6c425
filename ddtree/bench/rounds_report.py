"""Reporting for `ddtree bench rounds` (ddtree/bench/rounds.py): result rows, the ratio to batch 1, the issue's
targets, the printed table and the plot."""

from __future__ import annotations

PHASES = ("draft", "tree", "verify", "accept", "commit")


def make_row(context, algo, budget, batch, trace, **kw) -> dict:
    name = {"NONE": "AR", "DFLASH": "DFLASH"}.get(algo, f"DDTREE B={budget}")
    forced = None if trace is None else (trace[0] if len(trace) == 1 else "trace")
    return {
        "context": context,
        "config": name,
        "algorithm": algo,
        "budget": budget if algo == "DDTREE" else None,
        "batch": batch,
        "forced_accept": forced,
        "accept_trace": trace,
        **kw,
    }


def add_vs_batch1(rows: list[dict]) -> None:
    """Per-round time of each row over the same config at batch 1."""
    base = {
        (r["context"], r["config"], r["forced_accept"]): r["ms"]
        for r in rows
        if r.get("ms") and r["batch"] == 1
    }
    for r in rows:
        b1 = base.get((r["context"], r["config"], r["forced_accept"]))
        if r.get("ms") and b1:
            r["vs_batch1"] = r["ms"] / b1


def target_checks(rows: list[dict]) -> list[dict]:
    """The issue's targets (#4 item 4, #7) against the unforced rows that ran."""
    got = {
        (r["context"], r["config"], r["batch"]): r
        for r in rows
        if r.get("ms") and r["forced_accept"] is None
    }
    out = []
    for ctx in sorted({k[0] for k in got}):
        targets = [
            ("AR b1 x floor", "AR", 1, "x_floor", 1.15),
            ("DDTREE B=64 b1 x floor", "DDTREE B=64", 1, "x_floor", 1.5 if ctx <= 1024 else 1.8),
            ("DDTREE B=256 b1 x floor", "DDTREE B=256", 1, "x_floor", 2.0),
            ("DDTREE B=64 b1 tree+accept % of round", "DDTREE B=64", 1, "tree_accept_pct", 3.0),
            ("DDTREE B=64 b8 / b1 per round", "DDTREE B=64", 8, "vs_batch1", 1.6),
        ]
        for name, config, batch, field, limit in targets:
            r = got.get((ctx, config, batch))
            if r is not None and field in r:
                out.append(
                    {
                        "context": ctx,
                        "name": name,
                        "value": r[field],
                        "limit": limit,
                        "ok": r[field] <= limit,
                    }
                )
    return out


def print_checks(checks: list[dict]) -> None:
    for c in checks:
        print(
            f"ctx {c['context']:>6} {c['name']:<40} {c['value']:>7.3f} <= {c['limit']:<5} "
            f"{'ok' if c['ok'] else 'MISSED'}"
        )


def print_header() -> None:
    cols = "".join(f"{p:>8}" for p in PHASES)
    print(
        f"{'ctx':>6} {'config':<13}{'b':>3} {'forced':>6} {'ms/round':>9} {'xfloor':>7} {'tok/rd':>7} |{cols}  "
        "(% of round)"
    )


def print_row(r: dict) -> None:
    forced = "-" if r["forced_accept"] is None else str(r["forced_accept"])
    split = "".join(f"{r['phases_pct'][p]:>7.1f}%" for p in PHASES)
    print(
        f"{r['context']:>6} {r['config']:<13}{r['batch']:>3} {forced:>6} {r['ms']:>9.3f} {r['x_floor']:>7.3f} "
        f"{r['emitted_mean']:>7.2f} |{split}",
        flush=True,
    )


def plot(rows: list[dict], floor: dict, path: str) -> None:
    from ddtree.bench.plots import round_costs

    if round_costs([r for r in rows if r.get("ms")], floor["floor_ms"], PHASES, path):
        print(f"wrote {path}")
