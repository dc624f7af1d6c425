"""What a `bench serving` level did on the server side, from its /metrics before and after the
level (servers started with --enable-metrics; None otherwise): the chosen-budget histogram, the
rounds per verify width and per policy rung (ar / chain / tree<B>; of them the exploration rounds,
a rung above the policy's best), the budget policy's predicted vs the realised accept length, the
round ms per rung the policy believes (auto), and the per-round host time (engine step and server
loop outside the round; publishing hidden under it), the HTTP event loop's lag and the Python
garbage collector's pauses.
"""

from __future__ import annotations

from collections import defaultdict

from ddtree.engine.round.clock import DEVICE_PARTS, PHASES


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted labels): value}. A --dp-size server's replicas
    (label `dp_rank`) read as one server: counters and histograms summed, gauges averaged."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple], float] = {}
    gauges: dict[tuple[str, tuple], int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "dp_rank"))
            key = (s.name, labels)
            out[key] = out.get(key, 0.0) + s.value
            if fam.type == "gauge":
                gauges[key] = gauges.get(key, 0) + 1
    for key, n in gauges.items():
        out[key] /= n
    return out


async def scrape(base_url: str, api_key: str | None) -> dict | None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(base_url.rstrip("/") + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    return parse(r.text) if r.status_code == 200 else None


def delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    d = defaultdict(float)
    for k, v in after.items():
        d[k] = v - before.get(k, 0.0)

    def one(name: str, **labels) -> float:
        return d.get((name, tuple(sorted(labels.items()))), 0.0)

    # cumulative le-buckets -> per-bucket counts
    les = sorted(
        (float(dict(lab)["le"]), v)
        for (n, lab), v in d.items()
        if n == "ddtree_spec_budget_bucket" and dict(lab)["le"] != "+Inf"
    )
    hist, prev = {}, 0.0
    for le, cum in les:
        if cum - prev:
            hist[str(int(le))] = int(cum - prev)
        prev = cum
    widths = {
        dict(lab)["width"]: int(v)
        for (n, lab), v in d.items()
        if n == "ddtree_spec_verify_width_rounds_total" and v
    }
    rung_rounds = {
        dict(lab)["rung"]: int(v)
        for (n, lab), v in d.items()
        if n == "ddtree_spec_rung_rounds_total" and v
    }
    explore_rounds = {
        dict(lab)["rung"]: int(v)
        for (n, lab), v in d.items()
        if n == "ddtree_spec_explore_rounds_total" and v
    }
    per_rung = {}  # auto: what each rung delivered at this level
    for rung, n in rung_rounds.items():
        req = one("ddtree_spec_rung_request_rounds_total", rung=rung)
        per_rung[rung] = {
            "rounds": n,
            "batch": req / n,
            "round_ms": 1e3 * one("ddtree_spec_rung_round_seconds_total", rung=rung) / n,
            "device_ms": 1e3 * one("ddtree_spec_rung_device_seconds_total", rung=rung) / n,
            "predicted_accept_length": 1
            + one("ddtree_spec_rung_predicted_drafts_total", rung=rung) / req
            if req
            else None,
            "realised_accept_length": 1
            + one("ddtree_spec_rung_accepted_drafts_total", rung=rung) / req
            if req
            else None,
        }
    cost_ms: dict[str, dict[str, float]] = {}  # a gauge: the value after the level
    for (n, lab), v in after.items():
        if n == "ddtree_spec_rung_cost_seconds":
            lab = dict(lab)
            cost_ms.setdefault(lab["batch"], {})[lab["rung"]] = 1e3 * v
    count = one("ddtree_spec_budget_count")
    spread_n = one("ddtree_spec_verify_rows_spread_count")
    priced = one("ddtree_spec_priced_rounds_total")
    accept_n = sum(
        v for (n, _), v in d.items() if n == "ddtree_spec_accept_length_count"
    )  # every algorithm label: a server runs one
    accept_s = sum(v for (n, _), v in d.items() if n == "ddtree_spec_accept_length_sum")
    pred_n = one("ddtree_spec_predicted_request_rounds_total")
    parts = {}
    for part in ("round", "host", "server", "hidden", "grammar", *DEVICE_PARTS):
        n = one("ddtree_round_seconds_count", part=part)
        parts[part] = 1e3 * one("ddtree_round_seconds_sum", part=part) / n if n else None
    host = parts["host"]
    lag_n = one("ddtree_http_loop_lag_seconds_count")
    late = one("ddtree_http_loop_lag_seconds_bucket", le="0.01")
    gc_pauses = {}  # server/gc_watch.py: generation -> collections, their ms, those over 50 ms
    for (n, lab), v in d.items():
        if n == "ddtree_gc_pause_seconds_count" and v:
            g = dict(lab)["generation"]
            gc_pauses[g] = {
                "count": int(v),
                "total_ms": 1e3 * one("ddtree_gc_pause_seconds_sum", generation=g),
                "over_50ms": int(
                    v - one("ddtree_gc_pause_seconds_bucket", generation=g, le="0.05")
                ),
            }
    return {
        "budget_histogram": hist,  # budget bucket upper bound -> request-rounds
        "verify_width_rounds": widths,
        "rung_rounds": rung_rounds,  # auto: rounds per choice (ar, chain, tree<B>)
        "explore_rounds": explore_rounds,  # of those, exploration rounds (a rung above the best)
        # auto: rung -> rounds, mean batch, round ms, predicted and realised accept length
        "per_rung": per_rung,
        "policy_cost_ms": cost_ms,  # auto: batch bucket -> rung -> the policy's round ms
        "mean_budget": one("ddtree_spec_budget_sum") / count if count else None,
        # verify rows per request-round (root + drafted nodes) and, per round, their standard
        # deviation across the batch (mean over the rounds): how unequally one round divides them
        "mean_rows": one("ddtree_spec_verify_rows_sum") / count if count else None,
        "rows_spread": one("ddtree_spec_verify_rows_spread_sum") / spread_n if spread_n else None,
        # the accept length of the request-rounds that drafted (tokens emitted, bonus included)
        "spec_accept_length": accept_s / accept_n if accept_n else None,
        # the cost model's round ms beside the measured round ms of the same rounds (auto)
        "predicted_round_ms": 1e3 * one("ddtree_spec_predicted_round_seconds_total") / priced
        if priced
        else None,
        "priced_round_ms": 1e3 * one("ddtree_spec_priced_round_seconds_total") / priced
        if priced
        else None,
        "predicted_accept_length": 1 + one("ddtree_spec_predicted_accepted_drafts_total") / pred_n
        if pred_n
        else None,
        "realised_accept_length": 1 + one("ddtree_spec_realised_accepted_drafts_total") / pred_n
        if pred_n
        else None,
        "round_ms": parts["round"],
        "host_ms": None if host is None else host + (parts["server"] or 0.0),
        "hidden_ms": parts["hidden"],
        # host ms per round with grammar requests: their trees and masks (grammar_round.py)
        "grammar_host_ms": parts["grammar"],
        # on the GPU's clock (CUDA; engine/round/clock.py): a round's device span, the GPU idle
        # before it (host work between rounds nothing hid), and the span's phases
        "device_ms": parts["device"],
        "idle_ms": parts["idle"],
        "device_phase_ms": {p: parts[f"device_{p}"] for p in PHASES},
        # the HTTP loop's lag (a 10 ms timer's lateness): mean ms, and the share of probes >10 ms late
        "loop_lag_ms": 1e3 * one("ddtree_http_loop_lag_seconds_sum") / lag_n if lag_n else None,
        "loop_lag_over_10ms": 1 - late / lag_n if lag_n else None,
        "gc_pauses": gc_pauses,
    }
