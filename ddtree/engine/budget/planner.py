"""The decoder's per-round budget plan: which verify width the round runs at and each request's
DDTree budget, from the load-aware policy (`--speculative-ddtree-budget auto`,
engine/budget/policy.py) or the fixed budget with per-request caps (`SamplingParams.ddtree_budget`).

A round's width is always one with verify graphs (`SpecConfig.verify_widths`). With auto the
round drafts at its rung: the tree spec of the smallest ladder budget that holds the largest
budget (every request at the rung's budget: exactly the fixed B=rung server's draft, verify and
commit; mixed budgets: built at that rung and each request cut to its budget inside the draft
graph, `build_tree(budgets=...)`), or the DFLASH chain's spec. Fixed budgets with per-request
caps build at the cap and cut. After the round `observe` feeds the trees' gain curves and the
chain's gain (read back with the round's tokens) and the realised accept lengths to the policy,
and keeps the round's `RoundRecord` for the metrics and the log.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ddtree.engine.budget.policy import BudgetPolicy, Decision, RoundCost, ServedCost, rung_name
from ddtree.engine.budget.trace import PolicyTrace
from ddtree.engine.config import SpecConfig, budget_ladder
from ddtree.engine.round.clock import RoundTiming
from ddtree.engine.scheduling.request import Req

CURVE_SCALE = 1 << 20  # gain curves ride the round's int64 read-back in fixed point
# a batch-wide budget serves where it rates this much above the dense decision (the model's
# interpolation between rungs is coarser than the rung table itself)
PACK_MARGIN = 0.03
PACKED_EMA = 0.2  # weight of the newest packed round in the packed cost's correction
PACKED_CLIP = 3.0  # the most one packed round's served / modelled seconds count as


class Policy(Protocol):
    """What the planner asks of a budget policy (`BudgetPolicy`, or a bench's or test's scripted
    one: `ScriptedPolicy`). `propose` / `carry` run under the verify and may return None: the
    planner then calls `choose` at the next round's plan."""

    cost: RoundCost | None

    def choose(self, slots, owners, caps, ctx: int, extra_s: float = 0.0) -> Decision: ...

    def propose(self, slots, owners, caps, ctx: int, extra_s: float = 0.0) -> Decision | None: ...

    def carry(self, d: Decision, prev_owners, owners, caps) -> Decision | None: ...

    def commit(self, d: Decision) -> Decision: ...

    def observe_curves(self, slots, budgets, curves, chain=None, full=None) -> tuple | None: ...

    def observe_accepted(self, pending: tuple | None, accepted) -> None: ...

    def reset(self) -> None: ...


class ScriptedPolicy:
    """A policy that decides each round at plan time from a script of its own (`choose`) and
    learns nothing: benches that force rungs, tests that vary budgets. Install it with
    `LLMEngine.set_budget_policy`."""

    cost: RoundCost | None = None

    def choose(self, slots, owners, caps, ctx: int, extra_s: float = 0.0) -> Decision:
        raise NotImplementedError

    def propose(self, slots, owners, caps, ctx: int, extra_s: float = 0.0) -> Decision | None:
        return None

    def carry(self, d: Decision, prev_owners, owners, caps) -> Decision | None:
        return None

    def commit(self, d: Decision) -> Decision:
        return d

    def observe_curves(self, slots, budgets, curves, chain=None, full=None) -> tuple | None:
        return None

    def observe_accepted(self, pending: tuple | None, accepted) -> None:
        pass

    def reset(self) -> None:
        pass


@dataclass
class RoundPlan:
    width: int  # verify width (1 = AR: no draft)
    budgets: list[int] | None  # per-request DDTree budgets (None: the spec's for every request)
    predicted: np.ndarray | None = None  # policy's calibrated expected accepted drafts per request
    slots: np.ndarray | None = None
    spec: tuple | None = None  # the draft graphs' tree spec (None: the decoder's own)
    chain: bool = False  # the round drafts the DFLASH chain (auto's chain rung)
    cut: list[int] | None = None  # budgets the draft must cut to (None: all at the spec's)
    explore: bool = False  # auto: a rung above the policy's best, run to measure the curve there
    full: list[bool] | None = None  # rows drafted at full depth (None: all; set by the decoder)
    predicted_s: float | None = None  # the cost model's seconds for the round (auto), if any
    # a batch-wide budget (auto, dense targets): the round verifies only the batch's `rows` most
    # valuable drafted nodes, packed (`ModelRunner.verify_packed`); `caps` bound each request's
    # share; `budgets` become the shares, once read back. None: a dense verify at `width`
    rows: int | None = None
    caps: list[int] | None = None
    raw_s: float | None = None  # packed: the cost model's seconds before the served correction

    @property
    def rung(self) -> str:
        """The metrics' name of the round's choice: ar, chain, tree<B> (B: the built budget) or
        packed (a batch-wide budget)."""
        return "packed" if self.rows is not None else rung_name(self.width - 1, self.chain)


@dataclass
class RoundRecord:
    """One decode round as the budget side saw it (read by metrics and the batch log)."""

    width: int
    budgets: list[int]
    predicted: list[float]  # expected accepted drafts (policy, calibrated); [] when fixed
    accepted: list[int]  # accepted drafts per request (emitted - 1)
    rung: str = ""  # RoundPlan.rung (auto), else ""
    explore: bool = False  # RoundPlan.explore
    timing: RoundTiming = field(default_factory=RoundTiming)  # filled as the layers measure it
    # the cost model's seconds for this round (auto: its rung at the batch and context, as the
    # policy priced it), beside the measured `timing`: the model's error, round by round
    predicted_s: float | None = None
    raw_s: float | None = None  # RoundPlan.raw_s (a packed round)

    @property
    def rows(self) -> int:
        """Verify rows the round chose: every request's root plus its drafted nodes."""
        return sum(1 + b for b in self.budgets)

    @property
    def rows_mean(self) -> float:
        """Verify rows per request (1 + budget), mean over the batch."""
        return self.rows / len(self.budgets) if self.budgets else 0.0

    @property
    def rows_spread(self) -> float:
        """Verify rows per request, standard deviation over the batch (0: one budget for all)."""
        return float(np.std(self.budgets)) if self.budgets else 0.0


class BudgetPlanner:
    def __init__(self, cfg: SpecConfig, slots: int, cost: RoundCost | None = None):
        self.cfg = cfg
        # the tree widths a budget maps to (auto: the ladder's; the chain's width is its own rung)
        self.widths = (
            [1 + b for b in budget_ladder(cfg.budget)]
            if cfg.adaptive
            else sorted(cfg.verify_widths)
        )
        self.policy: Policy | None = None
        if cfg.adaptive:
            self.policy = BudgetPolicy(budget_ladder(cfg.budget), cost, slots, cfg.chain_rung)
        self.last: RoundRecord | None = None
        self._served: tuple[int, int, int] | None = None  # the last auto round's (bs, ctx, rung)
        self.host_s = 0.0  # EMA of a round's host time outside the device work (engine + server)
        self._pending: tuple | None = None  # observe_curves' return, for `observe`
        self.trace = PolicyTrace() if self.policy is not None else PolicyTrace("")
        # batch-wide budgets (`enable_packing`: auto on a dense target): per batch bucket (a power
        # of two), served packed rounds' seconds over the model's, an EMA that corrects its next
        # predictions there (an eager packed verify's launches cost most where the batch is
        # small, so one factor for every batch would stop packing where it pays)
        self.packing = False
        self.packed_scale: dict[int, float] = {}
        # b -> the row counts a packed verify of b requests replays in a graph ([]: eager, any)
        self.packed_rows: Callable[[int], list[int]] = lambda b: []
        self._clear_overlap()

    def enable_packing(self, packed_rows: Callable[[int], list[int]] | None = None) -> None:
        """Let auto rounds verify one batch-wide budget of rows, packed, where the cost model
        rates that above the policy's dense rung (any batch: the requests that sample, ask for
        log-probs or are under a grammar get their nodes' logits back, the rest greedy tokens).
        packed_rows: the graphs' row counts for a batch (`ModelRunner.packed_rows`)."""
        if self.cfg.adaptive and self.cfg.algorithm == "DDTREE":
            self.packing = True
            if packed_rows is not None:
                self.packed_rows = packed_rows

    def _clear_overlap(self) -> None:
        # Off the critical path: while a round's verify runs (`observe_curves`) the planner
        # catches up on the round before (its served seconds, its calibration) and proposes the
        # next round's decision for the same requests; `plan` takes it when the batch is the
        # same, carries its rung to a batch that changed (`BudgetPolicy.carry`), and decides
        # there only where it cannot. The policy's host time (studies/host_time.py) would
        # otherwise sit between rounds with the device idle.
        self._batch: tuple | None = None  # the current round's (slots, reqs, caps, ctx)
        # (batch key, proposed Decision, its packed plan or None) for the next round
        self._next: tuple | None = None
        self._accepted: tuple | None = None  # (pending, accepted) of a finished round
        self._last_served: tuple[int, int, int] | None = None  # `_served` of `last`
        self._absorbed: RoundRecord | None = None  # the last record the policy has taken in

    @property
    def observes(self) -> bool:
        """Whether the round reads its trees' gain curves back (the policy learns from them)."""
        return self.policy is not None

    def reset(self) -> None:
        """Forget what the policy learned (after the warm-up's synthetic prompts)."""
        if self.policy is not None:
            self.policy.reset()
        self.last, self.host_s, self._served, self._pending = None, 0.0, None, None
        self.packed_scale = {}  # the warm-up's packed rounds compiled their kernels
        self._clear_overlap()
        if self.policy is not None and isinstance(self.policy.cost, ServedCost):
            self.policy.cost = ServedCost(self.policy.cost.base)  # the warm-up's rounds too

    def round_costs(self) -> dict[int, dict[str, float]]:
        """The policy's startup round seconds (the profile or estimate, before any served round
        corrects it) per batch bucket and rung (the metrics' rung names), at the shortest
        context ({} without the policy)."""
        pol = self.policy
        if not isinstance(pol, BudgetPolicy):
            return {}
        cost = pol.cost.base if isinstance(pol.cost, ServedCost) else pol.cost
        batches = getattr(cost, "batches", None) or (1, 2, 4, 8, 16, 32, 64)
        return {
            int(bs): dict(zip(pol.rung_names, cost.seconds(int(bs), 0).tolist())) for bs in batches
        }

    def set_cost(self, cost: RoundCost, served: bool = True) -> None:
        """The policy's round costs: `cost` (the startup profile or estimate), corrected by the
        rounds served (`ServedCost`) unless `served` is False (a bench pinning another
        machine's costs)."""
        if self.policy is not None:
            self.policy.cost = ServedCost(cost) if served else cost

    def set_policy(self, policy: Policy) -> None:
        """Serve `cfg.adaptive` rounds with another policy (a bench's forced rungs, a test's
        script); what the planner overlapped for the old one is dropped."""
        if not self.cfg.adaptive:
            raise ValueError("a budget policy needs --speculative-ddtree-budget auto")
        self.policy = policy
        self.trace = PolicyTrace() if isinstance(policy, BudgetPolicy) else PolicyTrace("")
        self._clear_overlap()

    def width_for(self, budget: int) -> int:
        return self.widths[bisect.bisect_left(self.widths, 1 + budget)]

    def plan(self, reqs: list[Req], max_ctx: int) -> RoundPlan:
        cfg = self.cfg
        if cfg.algorithm != "DDTREE":
            return RoundPlan(cfg.verify_width if cfg.algorithm == "DFLASH" else 1, None)
        caps = [min(r.params.ddtree_budget or cfg.budget, cfg.budget) for r in reqs]
        if self.policy is None:
            if all(c == cfg.budget for c in caps):
                return RoundPlan(cfg.verify_width, None)
            return RoundPlan(self.width_for(max(caps)), caps, cut=caps)
        nxt, self._next = self._next, None
        same = nxt is not None and nxt[0] == _batch_key(reqs, caps)
        slots = self._batch[0] if same else np.fromiter((r.slot for r in reqs), np.int64, len(reqs))
        d = None
        if nxt is not None:  # proposed while the last round's verify ran; a changed batch
            # takes the proposal's rung (None: it cannot, and `choose` decides here)
            d = nxt[1] if same else self.policy.carry(nxt[1], self._batch[1], reqs, caps)
        if d is not None:
            d = self.policy.commit(d)
        else:
            self._catch_up()
            d = self.policy.choose(slots, reqs, caps, max_ctx, self.host_s)
        self._batch = (slots, reqs, caps, max_ctx)
        if self.trace.on:
            self.trace.write(self.policy, d, slots, caps, max_ctx, self.host_s, self.last)
        self._served = (len(reqs), max_ctx, d.rung) if d.rung >= 0 else None
        packed = None
        if self.packing:  # rated under the last round's verify for the same batch (`_next`)
            packed = nxt[2] if same else self._packed(reqs, slots, caps, max_ctx, d)
        if packed is not None:
            self._served = None  # the rung table learns from dense rounds only
            return packed
        secs = None
        if self._served is not None and isinstance(self.policy, BudgetPolicy):
            secs = float(self.policy.cost.seconds(len(reqs), max_ctx)[d.rung])
        budgets = d.budgets.tolist()
        if d.chain:
            spec = cfg.tree_spec(chain=True)
            return RoundPlan(
                d.width,
                budgets,
                d.predicted,
                slots,
                spec,
                True,
                explore=d.explore,
                predicted_s=secs,
            )
        width = self.width_for(max(budgets))
        cut = None if all(b == width - 1 for b in budgets) else budgets
        spec = cfg.tree_spec(width - 1) if width > 1 else None
        return RoundPlan(
            width, budgets, d.predicted, slots, spec, cut=cut, explore=d.explore, predicted_s=secs
        )

    def _packed(self, reqs: list[Req], slots, caps: list[int], ctx: int, d) -> RoundPlan | None:
        """The batch-wide budget for this round, where it rates above the dense decision `d`:
        R drafted rows for the batch, the R most valuable nodes of all its requests' trees (the
        batch's gain curve from the policy's calibrated per-request curves: every request's
        marginal gains, best first). A round of b + R rows (with graphs: the rows of the packed
        graph that holds them, filled, `_candidates`) is priced on the measured rung table at
        this batch (its tree rungs' rows b x (1 + B) and seconds, linear between them) times the
        served correction. None: the dense decision serves."""
        pol = self.policy
        if d.rows is not None:  # a scripted policy's: its budgets cap the shares
            return self._packed_plan(slots, d.budgets.tolist(), d.rows, None)
        if not isinstance(pol, BudgetPolicy):
            return None
        b, top = len(reqs), max(caps)
        if top < 1:
            return None
        gain = pol.batch_gain(slots, reqs, caps)
        rows_b, secs_b = pol.tree_costs(b, ctx)
        if not len(rows_b):
            return None
        r, rows = _candidates(b, len(gain) - 1, self.packed_rows(b))
        if not len(r):
            return None
        raw = _priced(rows, rows_b, secs_b, pol.ar_seconds(b, ctx))
        scale = self.packed_scale.get(_bucket(b), 1.0)
        rate = (b + gain[r]) / (raw * scale + self.host_s)
        best = int(np.argmax(rate))
        if rate[best] <= d.tokens_per_s * (1 + PACK_MARGIN):
            return None
        return self._packed_plan(slots, list(caps), int(r[best]), float(raw[best]), scale)

    def _packed_plan(
        self, slots, caps: list[int], rows: int, raw_s: float | None, scale: float = 1.0
    ) -> RoundPlan:
        """The packed round of `rows` drafted rows, drafting at the rung that holds the largest
        share a request can get (its cap, and never more than `rows`): a smaller tree's build
        for a small batch budget."""
        width = self.width_for(min(max(caps), rows))
        return RoundPlan(
            width,
            None,
            None,
            slots,
            self.cfg.tree_spec(width - 1) if width > 1 else None,
            rows=rows,
            caps=caps,
            predicted_s=None if raw_s is None else raw_s * scale,
            raw_s=raw_s,
        )

    def tree_specs(self) -> list[tuple]:
        """The draft specs auto's rounds may build: one per tree rung, and the chain."""
        if self.policy is None:
            return []
        cfg = self.cfg
        specs = [cfg.tree_spec(w - 1) for w in self.widths if w > 1]
        return specs + ([cfg.tree_spec(chain=True)] if cfg.chain_rung else [])

    def observe_curves(self, plan: RoundPlan, curves: np.ndarray) -> None:
        """curves: the round's fixed-point gain columns [b, .] (`gain_columns`, read back while
        the verify runs): the tree's gain curve (none for a chain round), then the chain's gain,
        then a packed round's shares (which become `plan.budgets`). The draft's half of the
        policy's observe, off the critical path between rounds."""
        pol = self.policy
        c = np.asarray(curves, dtype=np.float64) / CURVE_SCALE
        if plan.rows is not None:  # a packed round: each request's share rides as the last column
            plan.budgets = np.rint(c[:, -1]).astype(np.int64).tolist()
            c = c[:, :-1]
        if pol is None or plan.width <= 1:
            return
        tree = None
        if not plan.chain:  # columns past the built rung repeat its last value (not read)
            B, k = max(self.cfg.budget, 1), c.shape[1] - 1
            tree = c[:, :-1]
            if k < B:  # by hand: np.pad(mode="edge") is slow for a per-round copy
                tree = np.empty((c.shape[0], B))
                tree[:, :k], tree[:, k:] = c[:, :k], c[:, k - 1 : k]
        budgets = plan.budgets or [plan.width - 1] * c.shape[0]
        self._pending = pol.observe_curves(plan.slots, budgets, tree, c[:, -1], plan.full)
        self._catch_up()
        if self._batch is not None:
            slots, reqs, caps, ctx = self._batch
            # the next round's contexts are at most one block longer
            ctx += self.cfg.block_size
            d = pol.propose(slots, reqs, caps, ctx, self.host_s)
            packed = self._packed(reqs, slots, caps, ctx, d) if self.packing and d else None
            self._next = None if d is None else (_batch_key(reqs, caps), d, packed)

    def _catch_up(self) -> None:
        """Take in what finished rounds left (the last record's host and served seconds, a
        round's realised accepted drafts) before the policy next decides: in `observe_curves`,
        under the device's work, or in `plan` when no round overlapped it."""
        pol, last = self.policy, self.last
        if pol is None:
            return
        if last is not None and last is not self._absorbed:  # host / server times are in now
            self._absorbed = last
            t = last.timing
            self.host_s = 0.9 * self.host_s + 0.1 * (t.host_s + t.server_s)
            cost, served = pol.cost, self._last_served
            if served is not None and t.round_s > 0 and isinstance(cost, ServedCost):
                cost.observe(*served, t.round_s)  # what the last round really took
            if last.raw_s and t.round_s > 0:  # a packed round: its model's correction
                k = _bucket(len(last.budgets))
                old = self.packed_scale.get(k, 1.0)
                # clipped: a round that compiled a kernel variant must not close the bucket
                ratio = min(max(t.round_s / last.raw_s, 0.5), PACKED_CLIP)
                self.packed_scale[k] = old + PACKED_EMA * (ratio - old)
        self._take_accepted()

    def _take_accepted(self) -> None:
        """The policy's calibration from a finished round's realised accept lengths, once."""
        if self._accepted is not None:
            self.policy.observe_accepted(*self._accepted)
            self._accepted = None

    def observe(
        self, plan: RoundPlan, n_reqs: int, emitted: list[int], curves: np.ndarray | None = None
    ) -> None:
        """emitted: tokens per request this round (accepted drafts + the bonus); curves: as
        `observe_curves` (None: already observed there, or none read back)."""
        if curves is not None:
            self.observe_curves(plan, curves)
        budgets = plan.budgets or [max(plan.width - 1, 0)] * n_reqs
        accepted = [max(k - 1, 0) for k in emitted]
        predicted = [] if plan.predicted is None else plan.predicted.tolist()
        pol = self.policy
        if pol is not None and self._pending is not None:  # None: nothing to calibrate
            self._take_accepted()  # a round before with no window to take it in
            # taken in by `_catch_up`: under the next round's verify, or at its `plan` (before
            # any slot changes hands: `choose` claims slots after it)
            self._accepted = (self._pending, accepted)
        self._pending = None
        rung = plan.rung if pol else ""
        self.last = RoundRecord(
            plan.width,
            budgets,
            predicted,
            accepted,
            rung,
            plan.explore,
            predicted_s=plan.predicted_s,
            raw_s=plan.raw_s,
        )
        self._last_served = self._served


def _priced(rows: np.ndarray, at: np.ndarray, secs: np.ndarray, floor: float) -> np.ndarray:
    """Seconds of rounds of `rows` verify rows, linear through the tree rungs' (rows, seconds)
    points, below the first rung along its first segment (the draft's and the forward's fixed
    cost stay, the rows' own shrinks) but never below an AR round's `floor`."""
    out = np.interp(rows, at, secs)
    if len(at) > 1:
        slope = max((secs[1] - secs[0]) / (at[1] - at[0]), 0.0)
        below = np.maximum(secs[0] + slope * (rows - at[0]), floor)
        out = np.where(rows < at[0], below, out)
    return out


def _candidates(b: int, drafted: int, graph_rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(R, the rows a round of R drafted rows runs) for a packed round of b requests with
    `drafted` nodes to give. Eager: every R from 1, b + R rows. Graphed (`graph_rows`, a replay's
    row counts): one R per graph, filling it (its padding rows cost what real ones do, so they
    carry the next most valuable nodes), at most every drafted node."""
    if not graph_rows:
        r = np.arange(1, drafted + 1)
        return r, b + r
    rows = np.array([t for t in graph_rows if t > b], dtype=np.int64)
    return np.minimum(rows - b, drafted), rows


def _bucket(b: int) -> int:
    """The power of two >= b: the batch bucket a packed round's cost correction is kept for."""
    return 1 << max(b - 1, 0).bit_length()


def _batch_key(reqs: list[Req], caps: list[int]) -> tuple:
    """A round's requests (by identity, in order; the planner's `_batch` keeps them alive, so no
    new request reuses an id), their slots (a preempted request comes back in another) and caps."""
    return tuple((id(r), r.slot) for r in reqs), tuple(caps)


def gain_columns(tree, chain: bool, shares: torch.Tensor | None = None) -> torch.Tensor:
    """[b, .] int64 the tree's gain curve (none for a chain round) then the chain's gain
    (`tree.chain_probs` summed), then a packed round's shares [b] (drafted nodes each request
    verifies), fixed point (CURVE_SCALE), on the device: what `observe_curves` reads."""
    parts = [tree.chain_probs.double().sum(1, keepdim=True)]
    if not chain:
        parts.insert(0, tree.path_probs.double().cumsum(1))
    if shares is not None:
        parts.append(shares.double()[:, None])
    return (torch.cat(parts, 1) * CURVE_SCALE).round().to(torch.int64)
