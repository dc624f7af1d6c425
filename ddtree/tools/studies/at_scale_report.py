"""The at-scale run's one table (per concurrency and config: output tok/s, TTFT / TPOT p50 / p99, τ,
and the throughput ratio DDTREE / DFLASH or DFLASH / NONE), the ceiling any budget policy can
reach with this pair (`ceiling_rows`), the validity lines, and the PNG."""

from __future__ import annotations

from ddtree.engine.round.clock import PHASES


def ratio_base(config: str) -> str | None:
    return "DFLASH" if config.startswith("DDTREE") else "NONE" if config == "DFLASH" else None


def table_rows(serving: dict[str, list[dict]]) -> list[dict]:
    """A row per (concurrency, config), with the ratio to its base config at that concurrency."""
    by = {(cfg, lv["concurrency"]): lv for cfg, levels in serving.items() for lv in levels}
    rows = []
    for c in sorted({c for _, c in by}):
        for cfg in serving:
            lv = by.get((cfg, c))
            if lv is None:
                continue
            base = by.get((ratio_base(cfg), c))
            ratio = (
                lv["output_throughput"] / base["output_throughput"]
                if base and base["output_throughput"]
                else None
            )
            rows.append(
                {
                    "concurrency": c,
                    "config": cfg,
                    "prompts": lv["completed"] + lv["failed"],
                    "failed": lv["failed"],
                    "output_tok_s": lv["output_throughput"],
                    "ttft_p50": lv["ttft_ms"]["p50"],
                    "ttft_p99": lv["ttft_ms"]["p99"],
                    "tpot_p50": lv["tpot_ms"]["p50"],
                    "tpot_p99": lv["tpot_ms"]["p99"],
                    "tau": lv["mean_accept_length"],
                    # from the server's /metrics (None without): verify rows per request and
                    # their spread across a round's batch; the cost model's round ms beside
                    # the measured round ms of the rounds it priced (auto)
                    "rows_per_req": lv.get("mean_rows"),
                    "rows_spread": lv.get("rows_spread"),
                    "round_pred_ms": lv.get("predicted_round_ms"),
                    "round_meas_ms": lv.get("priced_round_ms"),
                    "ratio": ratio,
                    "ratio_to": ratio_base(cfg) if ratio is not None else None,
                }
            )
    return rows


def _per_round(lv: dict) -> float | None:
    """Tokens per ms of one request's decode rounds from the server's /metrics: tau over the
    round's wall time plus the host time outside it (None without --enable-metrics)."""
    ms = lv.get("round_ms")
    if not ms or lv.get("mean_accept_length") is None:
        return None
    return lv["mean_accept_length"] / (ms + (lv.get("host_ms") or 0.0))


def _rung_of(config: str) -> str | None:
    """The policy's rung name a fixed config runs at every round (None: not one rung)."""
    if config in ("NONE", "DFLASH"):
        return "ar" if config == "NONE" else "chain"
    b = config.rsplit("B=", 1)[-1] if config.startswith("DDTREE B=") else ""
    return f"tree{b}" if b.isdigit() else None


def _cost_check(lv: dict, fixed: dict[str, dict], c: int) -> dict[str, dict]:
    """{rung: {"policy": ms, "served": ms}}: the round ms the adaptive server's policy believes
    (its batch bucket holding c) beside the round ms the fixed server of that rung served at c."""
    table = (lv.get("server") or {}).get("policy_cost_ms") or {}
    buckets = sorted(int(b) for b in table)
    bucket = next((b for b in buckets if b >= c), buckets[-1] if buckets else None)
    out = {}
    for name, flv in fixed.items():
        rung = _rung_of(name)
        policy = table.get(str(bucket), {}).get(rung) if bucket is not None else None
        if rung and policy is not None and flv.get("round_ms"):
            out[rung] = {"policy": policy, "served": flv["round_ms"]}
    return out


def ceiling_rows(serving: dict[str, list[dict]], adaptive: set[str] | None = None) -> list[dict]:
    """Per concurrency with a DFLASH level: the best fixed config's output tok/s over DFLASH's
    (the oracle fixed budget: the most any policy that picks one budget per level gets from the
    configs this run served; NONE and DFLASH count as fixed), the same predicted from /metrics
    (tau / (round + host ms) per config over DFLASH's), and each adaptive config (names with
    "auto" unless given) over DFLASH and over the oracle, with the round ms its policy believes
    per rung beside the fixed servers' served round ms (the cost side of its choice). A ratio is
    None where its inputs are."""
    if adaptive is None:
        adaptive = {n for n in serving if "auto" in n.lower()}
    by = {(cfg, lv["concurrency"]): lv for cfg, levels in serving.items() for lv in levels}
    rows = []
    for c in sorted({c for _, c in by}):
        base = by.get(("DFLASH", c))
        if base is None or not base["output_throughput"]:
            continue
        fixed = {n: by[(n, c)] for n in serving if n not in adaptive and (n, c) in by}
        oracle = max(fixed, key=lambda n: fixed[n]["output_throughput"])
        pred = {n: _per_round(lv) for n, lv in fixed.items() if n != "NONE"}
        pred = {n: v for n, v in pred.items() if v is not None}
        p_base = pred.get("DFLASH")
        p_best = max(pred, key=pred.get) if pred and p_base else None
        row = {
            "concurrency": c,
            "oracle_config": oracle,
            "oracle_ratio": fixed[oracle]["output_throughput"] / base["output_throughput"],
            "predicted_config": p_best,
            "predicted_ratio": pred[p_best] / p_base if p_best else None,
            "adaptive": {},
        }
        for n in sorted(adaptive):
            lv = by.get((n, c))
            if lv is None:
                continue
            tput = lv["output_throughput"]
            row["adaptive"][n] = {
                "ratio": tput / base["output_throughput"],
                "of_oracle": tput / fixed[oracle]["output_throughput"],
                "cost_ms": _cost_check(lv, fixed, c),
                "per_rung": (lv.get("server") or {}).get("per_rung") or {},
            }
        rows.append(row)
    return rows


def print_ceiling(rows: list[dict]) -> None:
    if not rows:
        return
    print("\nceiling: the best fixed config per level over DFLASH (measured; from /metrics rounds)")
    for r in rows:
        pred = (
            f"{r['predicted_ratio']:.2f}x ({r['predicted_config']})"
            if r["predicted_ratio"] is not None
            else "-"
        )
        auto = "".join(
            f"; {n} {a['ratio']:.2f}x = {a['of_oracle']:.2f} of the oracle"
            + "".join(
                f", {k} {v['policy']:.2f} ms believed / {v['served']:.2f} served"
                for k, v in a["cost_ms"].items()
            )
            for n, a in r["adaptive"].items()
        )
        print(
            f"{r['concurrency']:>4} oracle {r['oracle_ratio']:.2f}x ({r['oracle_config']}), "
            f"predicted {pred}{auto}"
        )
        for n, a in r["adaptive"].items():
            if a.get("per_rung"):
                print(f"       {n} per rung: " + rung_summary(a["per_rung"]))


def rung_summary(per_rung: dict[str, dict]) -> str:
    """'tree32 175 rd, b 1.0, 7.91 ms, tau 9.4 / 9.1 (predicted / realised); ...' by rounds."""
    parts = []
    for rung, v in sorted(per_rung.items(), key=lambda kv: -kv[1]["rounds"]):
        tau = ""
        if v.get("realised_accept_length") is not None:
            p = v.get("predicted_accept_length")
            tau = f", tau {p:.2f} / {v['realised_accept_length']:.2f}" if p else ""
        dev = f" (device {v['device_ms']:.2f})" if v.get("device_ms") else ""
        parts.append(
            f"{rung} {v['rounds']} rd, b {v['batch']:.1f}, {v['round_ms']:.2f} ms{dev}{tau}"
        )
    return "; ".join(parts) + " (tau: predicted / realised)"


def print_round_split(serving: dict[str, list[dict]]) -> None:
    """Per config and level, a decode round's wall time beside the GPU's clock of it
    (engine/round/clock.py): device = the round's span on the GPU, cut into its phases (plan: up
    to the draft's launch), idle = the GPU idle before it, host = the engine and server time outside
    the round (which `idle` shows unhidden)."""
    print(
        f"{'conc':>4} {'config':>14} {'batch':>6} {'round':>7} {'device':>7} "
        + "".join(f"{p:>7}" for p in PHASES)
        + f" {'idle':>6} {'host':>6}  (ms per decode round)"
    )

    def ms(v):
        return f"{v:.2f}" if v is not None else "-"

    for name, levels in serving.items():
        for lv in levels:
            srv, steps = lv.get("server") or {}, lv.get("steps") or {}
            batch = steps.get("mean_decode_batch")
            phases = srv.get("device_phase_ms") or {}
            print(
                f"{lv['concurrency']:>4} {name:>14} {ms(batch):>6} {ms(srv.get('round_ms')):>7} "
                f"{ms(srv.get('device_ms')):>7} "
                + "".join(f"{ms(phases.get(p)):>7}" for p in PHASES)
                + f" {ms(srv.get('idle_ms')):>6} {ms(srv.get('host_ms')):>6}"
            )


def print_table(rows: list[dict]) -> None:
    """rows/req and sd: verify rows per request and their spread across a round's batch; round
    pred / meas: the cost model's round ms and the measured one, of the rounds it priced."""
    print(
        f"{'conc':>4} {'config':>12} {'n':>4} {'fail':>4} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'p99':>8} "
        f"{'TPOT p50':>9} {'p99':>7} {'tau':>5} {'rows/req':>8} {'sd':>5} "
        f"{'round pred':>10} {'meas':>6}  ratio"
    )

    def num(v, width: int, digits: int) -> str:
        return f"{v:>{width}.{digits}f}" if v is not None else f"{'-':>{width}}"

    for r in rows:
        ratio = f"{r['ratio']:.2f}x vs {r['ratio_to']}" if r["ratio"] is not None else ""
        print(
            f"{r['concurrency']:>4} {r['config']:>12} {r['prompts']:>4} {r['failed']:>4} "
            f"{r['output_tok_s']:>10.1f} {r['ttft_p50']:>9.1f} {r['ttft_p99']:>8.1f} "
            f"{r['tpot_p50']:>9.2f} "
            f"{r['tpot_p99']:>7.2f} {r['tau']:>5.2f} {num(r.get('rows_per_req'), 8, 1)} "
            f"{num(r.get('rows_spread'), 5, 1)} {num(r.get('round_pred_ms'), 10, 2)} "
            f"{num(r.get('round_meas_ms'), 6, 2)}  {ratio}"
        )


def print_validity(rounds: list[dict], tau: dict) -> None:
    for r in rounds:
        flag = "within ±5%" if r["within_5pct"] else "OUTSIDE ±5%"
        print(
            f"rounds {r['config']:>12} b{r['batch']}: inflated {r['inflated_ms']:.2f} ms vs random "
            f"{r['random_ms']:.2f} ms = {r['ratio']:.3f}x ({flag})"
        )
    for cfg, t in tau.items():
        if t.get("inflated") is not None and t.get("small"):
            se = t.get("small_se")
            noise = f"; one SE of the small τ over these prompts: {100 * se / t['small']:.1f}%"
            print(
                f"tau {cfg:>12}: inflated {t['inflated']:.3f} vs small {t['small']:.3f} "
                f"({100 * (t['inflated'] / t['small'] - 1):+.1f}%{noise if se else ''})"
            )


def plot(rows: list[dict], path: str, title: str) -> None:
    from ddtree.bench.plots import pyplot

    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for k, cfg in enumerate(dict.fromkeys(r["config"] for r in rows)):
        rs = [r for r in rows if r["config"] == cfg]
        xs = [r["concurrency"] for r in rs]
        style = dict(marker="o", color=f"C{k % 10}")  # one colour per config in every panel
        axes[0].plot(xs, [r["output_tok_s"] for r in rs], label=cfg, **style)
        axes[2].plot(xs, [r["tpot_p50"] for r in rs], label=cfg, **style)
        if any(r["ratio"] is not None for r in rs):
            axes[1].plot(
                [r["concurrency"] for r in rs if r["ratio"] is not None],
                [r["ratio"] for r in rs if r["ratio"] is not None],
                label=f"{cfg} / {ratio_base(cfg)}",
                **style,
            )
    axes[0].set(ylabel="output tokens / s", title="throughput")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set(ylabel="throughput ratio", title="DDTREE / DFLASH and DFLASH / NONE")
    axes[2].set(ylabel="ms", title="TPOT p50", yscale="log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no ratio line when a base config is missing
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
