"""PNG plots for the benchmarks (matplotlib, headless). matplotlib is optional (`pip install
'ddtree[tools]'`): without it every plot is skipped with one line on stderr and the JSON results
are written as always."""

from __future__ import annotations

import collections
import sys


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (a note on stderr) when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'ddtree[tools]'): no PNG", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tau_vs_budget(rows: list[dict], path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    groups = collections.defaultdict(list)

    def who(r):  # `bench acceptance` over several drafters / DFlash2 trees labels its rows
        tree = f" {r['tree']}" if r.get("tree") else ""
        return f"{r['drafter']}{tree} " if r.get("drafter") else ""

    for r in rows:
        if r["algorithm"] == "DDTREE":
            key = (who(r), r["temperature"], r["shadow_linear"])
            groups[key].append((r["budget"], r["tau"]))
    for (name, temp, shadow), pts in sorted(groups.items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            label=f"{name}DDTREE T={temp}{' shadow' if shadow else ''}",
        )
    dflash = [r for r in rows if r["algorithm"] == "DFLASH"]
    for i, r in enumerate(dflash):
        ax.axhline(
            r["tau"],
            linestyle="--",
            linewidth=1,
            color=f"C{len(groups) + i}",
            label=f"{who(r)}DFLASH T={r['temperature']}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget B (tree nodes, root excluded)")
    ax.set_ylabel("mean accepted length τ (tokens/round)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def accept_histograms(hists: dict[str, list[int]], path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    n = len(hists)
    fig, axes = plt.subplots(n, 1, figsize=(6, 1.6 * n + 0.5), sharex=True, squeeze=False)
    for ax, (label, lengths) in zip(axes[:, 0], hists.items()):
        counts = collections.Counter(lengths)
        xs = sorted(counts)
        ax.bar(xs, [counts[x] / len(lengths) for x in xs])
        ax.set_ylabel("frac", fontsize=7)
        ax.set_title(label, fontsize=8)
    axes[-1, 0].set_xlabel("tokens emitted per round (accepted + bonus)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def round_costs(rows: list[dict], floor_ms: float, phases: tuple[str, ...], path: str) -> bool:
    """Per-round time of each benchmark row as stacked stage bars (ms), with the memory floor marked."""
    plt = pyplot()
    if plt is None:
        return False
    labels = [
        f"{r['config']} b{r['batch']} ctx{r['context']}"
        + (f" acc={r['forced_accept']}" if r.get("forced_accept") is not None else "")
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.2))
    left = [0.0] * len(rows)
    for i, p in enumerate(phases):
        widths = [r["phases_ms"][p] for r in rows]
        ax.barh(range(len(rows)), widths, left=left, color=f"C{i}", label=p)
        left = [a + w for a, w in zip(left, widths)]
    other = [max(r["ms"] - a, 0.0) for r, a in zip(rows, left)]
    ax.barh(range(len(rows)), other, left=left, color="0.8", label="other")
    ax.axvline(floor_ms, color="k", linestyle="--", linewidth=1, label=f"floor {floor_ms:.2f} ms")
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("ms per round (median)")
    ax.legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
