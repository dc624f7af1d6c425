"""The round-cost side of the budget policy, measured once at startup on the device.

With CUDA graphs a round is three replays whose cost depends on the padded batch and the width
only (the split count follows the context bucket; the KV read grows with the context): the draft
graph (skipped at width 1), the verify graph of the width, the commit graph. `measure` replays
each (batch bucket, width) a few times with every row in the padding state and takes the median,
so the table is the device's own; the context's KV read is added analytically
(`kv_s_per_token`, at the device's measured-copy bandwidth estimate). The table is cached in a
JSON file keyed by the device, torch, the model shapes, the buckets and the widths
(`DDTREE_BUDGET_PROFILE_DIR`), so a restart costs nothing. Without graphs (the CPU, hybrid
targets today) the roofline `AnalyticCost` stands in, fitted to a few timed eager forwards of the
target (`fitted_cost`), or from the weights and nominal device numbers when that fails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time

import numpy as np
import torch

from ddtree import envs
from ddtree.engine.budget.policy import AnalyticCost, CostTable, RoundCost, rungs
from ddtree.engine.budget.rows import RowCost
from ddtree.engine.config import SpecConfig, budget_ladder

logger = logging.getLogger("ddtree")

REPLAYS = 7
HBM_BYTES_PER_S = {"cuda": 4.0e12, "cpu": 2.0e10}
FLOPS = {"cuda": 5.0e14, "cpu": 1.0e11}


def _bytes(module) -> tuple[int, int]:
    """(weight bytes, parameters) of a module."""
    ps = list(module.parameters())
    return sum(p.numel() * p.element_size() for p in ps), sum(p.numel() for p in ps)


def analytic_cost(runner, spec: SpecConfig) -> AnalyticCost:
    kind = runner.device.type if runner.device.type in HBM_BYTES_PER_S else "cpu"
    t_bytes, t_params = _bytes(runner.target)
    d_bytes, d_params = _bytes(runner.drafter) if runner.drafter is not None else (0, 0)
    head = runner.target.lm_head.weight.numel()
    return AnalyticCost(
        budget_ladder(spec.budget),
        t_bytes,
        2.0 * t_params,
        d_bytes + head * runner.target.lm_head.weight.element_size(),
        2.0 * (d_params + head),
        spec.block_size,
        _kv_bytes_per_token(runner),
        HBM_BYTES_PER_S[kind],
        FLOPS[kind],
        1.5e-3 if kind == "cuda" else 1e-3,
        chain=spec.chain_rung,
    )


@torch.inference_mode()
def fitted_cost(runner, spec: SpecConfig, rows: int = 64) -> AnalyticCost:
    """The roofline with the eager device's own numbers (no graphs: launches and Python dominate
    small forwards): the target forward timed at 1 and `rows` rows gives a fixed time per
    forward and a time per row; the drafter scales them by its layer and parameter counts."""
    base = analytic_cost(runner, spec)
    now, model = _clock(runner.device), runner.target

    def timed(n: int) -> float:
        ids = torch.zeros(1, n, dtype=torch.int64, device=runner.device)
        best = float("inf")
        for _ in range(3):
            t0 = now()
            model.forward_train(ids)
            best = min(best, now() - t0)
        return best

    t1, tn = timed(1), timed(rows)
    per_row = max((tn - t1) / (rows - 1), 1e-9)
    fixed = max(t1 - per_row, 1e-6)
    t_cfg = runner.target.config
    d_layers = runner.drafter.config.num_hidden_layers if runner.drafter is not None else 0
    flops = base.target_flops_per_row / per_row  # the rate that gives the measured time per row
    return dataclasses.replace(
        base,
        bandwidth=float("inf"),  # the weight read is in the fixed time
        flops=flops,
        overhead=fixed,
        draft_overhead=fixed * d_layers / max(t_cfg.num_hidden_layers, 1),
    )


def _kv_bytes_per_token(runner) -> float:
    n = runner.kv.bytes / runner.kv.k.shape[1]
    if runner.draft_kv is not None:
        n += runner.draft_kv.bytes / runner.draft_kv.k.shape[1]
    return n


def _clock(device):
    if device.type == "cuda":

        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return now
    return time.perf_counter


@torch.inference_mode()
def measure(runner, spec: SpecConfig, replays: int = REPLAYS) -> CostTable:
    """Median seconds of draft + verify + commit per (batch bucket, rung), every row padded; each
    rung's draft is its own spec's graph (the tree built at the rung; the chain)."""
    g = runner.graphs
    ladder = budget_ladder(spec.budget)
    now = _clock(runner.device)
    plan = rungs(ladder, spec.chain_rung)
    drafts = [
        None if b == 0 or g.draft_graph is None else g._draft_set(spec.tree_spec(b, chain))
        for b, chain in plan
    ]
    table = np.zeros((len(g.buckets), 1, len(plan)))
    g.pad_rows()  # the replays below touch no request's rows (width 1 steps the state in place)
    for i, bs in enumerate(g.buckets):
        for j, ((b, _), draft) in enumerate(zip(plan, drafts)):
            w = 1 + b
            gs, v = g.verify_sets[w], g.verify_graphs[w]
            commit = g.commit_graphs.get((w, bs))
            times = []
            for _ in range(replays + 1):
                t0 = now()
                if draft is not None:
                    draft.run(bs, [0] * bs)
                gs.run(bs, [v.n] * bs)
                if commit is not None:
                    commit.replay()
                elif w in g.commit_families:
                    g.commit_families[w].forward(bs)
                times.append(now() - t0)
            table[i, 0, j] = statistics.median(times[1:])  # the first may compile
    kind = runner.device.type if runner.device.type in HBM_BYTES_PER_S else "cpu"
    kv = _kv_bytes_per_token(runner) / HBM_BYTES_PER_S[kind]
    ctx = (runner.cfg.max_context,)
    return CostTable(ladder, tuple(g.buckets), ctx, table, kv, spec.chain_rung)


# prefill chunks and eager verify row counts the row-cost curves are measured at (clipped to the
# runner's context)
PREFILL_POINTS = (16, 128, 512, 2048)
EAGER_ROWS = (1, 16, 64, 256)


@torch.inference_mode()
def measure_rows(runner, spec: SpecConfig, replays: int = REPLAYS) -> RowCost:
    """The `RowCost` curves: with captured graphs, the draft graph of the spec's full tree per
    batch bucket and every verify graph (+ commit) per (bucket, width), a width-w verify of bs
    rows standing for bs * w packed rows (the rows padded: the context's read is priced apart);
    without graphs, timed eager target forwards (the drafter's curve scaled from the target's by
    layers). Prefill: timed eager target forwards of a chunk."""
    now = _clock(runner.device)
    g = runner.graphs

    def median(fn) -> float:
        times = []
        for _ in range(replays + 1):
            t0 = now()
            fn()
            times.append(now() - t0)
        return statistics.median(times[1:])  # the first may compile

    def forward(n: int):
        ids = torch.zeros(1, n, dtype=torch.int64, device=runner.device)
        return lambda: runner.target.forward_train(ids)

    top = runner.cfg.max_context
    prefill = {p: median(forward(p)) for p in PREFILL_POINTS if p <= top}
    kind = runner.device.type if runner.device.type in HBM_BYTES_PER_S else "cpu"
    kv = _kv_bytes_per_token(runner) / HBM_BYTES_PER_S[kind]
    verify: dict[int, list[float]] = {}
    draft: dict[int, float] = {}
    if g is not None:  # uncaptured graphs (CPU tests) run the same sets eagerly
        g.pad_rows()  # the replays below touch no request's rows
        dset = None if g.draft_graph is None else g._draft_set(spec.tree_spec(spec.budget, False))
        for bs in g.buckets:
            if dset is not None:
                draft[bs] = median(lambda: dset.run(bs, [0] * bs))
            for w in g.widths:
                gs, v = g.verify_sets[w], g.verify_graphs[w]
                commit = g.commit_graphs.get((w, bs))

                def step():
                    gs.run(bs, [v.n] * bs)
                    if commit is not None:
                        commit.replay()
                    elif w in g.commit_families:
                        g.commit_families[w].forward(bs)

                verify.setdefault(bs * w, []).append(median(step))
    else:
        for n in EAGER_ROWS:
            verify[n] = [median(forward(n))]
    if not draft:
        # the drafter's forward over bs blocks of S rows, as a share of the target's by layers
        t_layers = max(runner.target.config.num_hidden_layers, 1)
        d_layers = runner.drafter.config.num_hidden_layers if runner.drafter is not None else 0
        base = RowCost.from_points({1: 0.0}, verify, {}, 0.0)
        for bs in (1, 8, 64):
            draft[bs] = base.verify(bs * spec.block_size) * d_layers / t_layers
    return RowCost.from_points(draft, verify, prefill, kv)


def profile_key(runner, spec: SpecConfig) -> str:
    dev = runner.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    t, d = runner.target.config, runner.drafter.config if runner.drafter is not None else None
    shape = [
        t.hidden_size,
        t.num_hidden_layers,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.vocab_size,
        getattr(t, "intermediate_size", 0),
    ]
    if d is not None:
        shape += [d.hidden_size, d.num_hidden_layers, d.num_attention_heads]
    g = runner.graphs
    parts = [name, torch.__version__, str(runner.dtype), shape, g.buckets, g.widths]
    parts += [spec.block_size, spec.budget, spec.topk_cap, spec.shadow_linear, spec.chain_rung]
    parts += ["per-rung drafts"]  # tables before each rung had its own draft spec are stale
    pool = runner.state_pool
    if pool is not None:  # hybrid: the state commit's cost
        parts += [pool.strategy, str(pool.ssm_dtype)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def profile_dir() -> str | None:
    d = envs.BUDGET_PROFILE_DIR.get()
    if d.strip().lower() == "off":
        return None
    return d or os.path.join(os.path.expanduser("~"), ".cache", "ddtree", "budget")


def _cached(path: str | None, load, build, save):
    """load(path) if the file reads, else build() written to path (write-then-rename: --dp-size
    replicas may write the same profile at once)."""
    if path is not None and os.path.exists(path):
        try:
            with open(path) as f:
                got = load(json.load(f))
            logger.info("Budget policy: round costs from %s.", path)
            return got
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("Budget policy: ignoring the cost profile %s (%s).", path, e)
    got = build()
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(save(got), f)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("Budget policy: could not cache the cost profile at %s (%s).", path, e)
    return got


def row_cost(runner, spec: SpecConfig) -> RowCost:
    """The batch-wide budget's `RowCost`: from the cache file keyed like the rung table (device,
    torch, shapes, buckets, widths; with graphs only: eager timings are cheap and noisy), else
    measured now and cached."""
    folder = profile_dir()
    g = runner.graphs
    graphed = g is not None and g.capture
    path = None
    if folder is not None and graphed:
        path = os.path.join(folder, profile_key(runner, spec) + "-rows.json")
    cost = _cached(path, RowCost.from_json, lambda: measure_rows(runner, spec), RowCost.to_json)
    logger.info(
        "Budget policy: row costs: draft %s ms by batch %s; verify %s ms by rows %s.",
        ", ".join(f"{1e3 * x:.2f}" for x in cost.draft_s),
        list(cost.batches),
        ", ".join(f"{1e3 * x:.2f}" for x in cost.verify_s),
        list(cost.rows),
    )
    return cost


def round_cost(runner, spec: SpecConfig) -> RoundCost:
    """The measured table (from the cache file, else measured now and cached) when graphs are
    captured, else the analytic estimate."""
    g = runner.graphs
    if g is None or not g.capture:
        try:
            cost = fitted_cost(runner, spec)
        except Exception as e:  # noqa: BLE001 - the estimate must not stop the server
            logger.warning("Budget policy: eager timing failed (%s); roofline round costs.", e)
            return analytic_cost(runner, spec)
        logger.info(
            "Budget policy: eager round costs fitted (no captured CUDA graphs): %.2f ms per "
            "forward + %.3f ms per row.",
            1e3 * cost.overhead,
            1e3 * cost.target_flops_per_row / cost.flops,
        )
        return cost
    folder = profile_dir()
    path = None if folder is None else os.path.join(folder, profile_key(runner, spec) + ".json")
    if path is not None and os.path.exists(path):
        try:
            with open(path) as f:
                table = CostTable.from_json(json.load(f))
            logger.info("Budget policy: round costs from %s.", path)
            return table
        except (OSError, ValueError, KeyError) as e:
            logger.warning("Budget policy: ignoring the cost profile %s (%s).", path, e)
    t0 = time.perf_counter()
    table = measure(runner, spec)
    logger.info(
        "Budget policy: round costs measured in %.1f s (batch %s x rung %s; ms at batch 1: %s).",
        time.perf_counter() - t0,
        list(table.batches),
        ["chain" if c else f"B{b}" for b, c in rungs(table.ladder, table.chain)],
        ", ".join(f"{1e3 * x:.2f}" for x in table.table[0, 0]),
    )
    if path is not None:
        try:  # write-then-rename: --dp-size replicas may write the same profile at once
            os.makedirs(folder, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(table.to_json(), f)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("Budget policy: could not cache the cost profile at %s (%s).", path, e)
    return table
