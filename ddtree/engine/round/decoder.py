"""One decoding round for a batch of running requests (the engine side of speculative decoding):
plan -> draft the tree -> verify -> sample at every node -> accept walk -> commit -> emit, on the
round's data (engine/round/data.py) whether graphs replay or eager code runs.

NONE (plain AR) is the one-node tree (the width-1 plan); DFLASH is the drafter's top-1 chain; DDTREE
the best-first tree. Prefill's first token is emitted by the same path (`first_tokens`).
The host reads back only the emitted tokens and their count, once per round; with
`--speculative-ddtree-budget auto` also the trees' gain curves, copied on a side stream as soon as the draft is
done (`GainReadBack`), so the policy learns from them while the verify runs.

With CUDA graphs the draft replay goes from the roots to the finished tree (drafter, LM head, tree build, each
request cut to its budget) and the verify replay from the tree to the greedy accept walk (target, LM head, argmax,
walk); the decoder walks eagerly when a request samples (temperature > 0) or is under a grammar (`_accept`; the
round benchmarks' subclass, bench/bench_decoder.py, rewrites the target tokens there). Each round's width and
per-request budgets come from the `BudgetPlanner`
(engine/budget/planner.py): the fixed budget (with per-request caps) or the load-aware policy; width 1 is a plain AR
round that still writes the drafter's context.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddtree.engine.budget.planner import BudgetPlanner, RoundPlan, gain_columns
from ddtree.engine.config import SpecConfig
from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.round import logprobs
from ddtree.engine.round.clock import RoundClock
from ddtree.engine.round.data import Draft, Round, Verify, accept_root, root_tree
from ddtree.engine.round.grammar import GrammarBatch
from ddtree.engine.round.grammar_jobs import MaskWorkers
from ddtree.engine.round.sampler import NodePositions, sample_nodes
from ddtree.engine.scheduling.request import Req
from ddtree.speculative.accept import accept_tree
from ddtree.speculative.batch_budget import allocate, node_probs_from_logits
from ddtree.speculative.tree import DraftTree


@dataclass
class PhaseTimes:
    """Wall time per phase (host clock; on a GPU the phases overlap asynchronously)."""

    seconds: dict[str, float] = field(default_factory=dict)

    def start(self) -> float:
        return time.perf_counter()

    def add(self, name: str, t0: float) -> float:
        t = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + t - t0
        return t


class SpecDecoder:
    def __init__(self, runner: ModelRunner, cfg: SpecConfig):
        self.runner, self.cfg = runner, cfg
        # a phase timer: `start()` / `add(name, t0)` (the host clock; the round benchmarks' own)
        self.times = PhaseTimes()
        self.budgets = BudgetPlanner(cfg, runner.cfg.max_running_requests)
        self.clock = RoundClock(runner.device)  # the round's device and idle time (CUDA events)
        self.gains = GainReadBack(runner.device)
        # set by the server: host work to overlap with each round's device work
        self.while_device_runs: Callable[[], None] | None = None
        # int32 words of a next-token bitmask row (grammar requests, engine/round/grammar.py)
        self.mask_words = (runner.target.config.vocab_size + 31) // 32
        self.grammar_host_s = 0.0  # host seconds the grammar rows' trees and masks took
        # the grammar rows' mask work runs there, bounded per request (engine/round/grammar_jobs.py)
        self.mask_workers = MaskWorkers(runner.cfg.max_running_requests)
        if cfg.algorithm != "NONE":
            runner.set_tree_spec(cfg.algorithm, cfg.budget, cfg.topk_cap, cfg.shadow_linear)
            runner.add_tree_specs(self.budgets.tree_specs())  # auto: every rung's own draft
        if cfg.adaptive:  # after the draft graphs of the spec exist: the profile replays them
            from ddtree.engine.budget.profile import round_cost

            self.budgets.set_cost(round_cost(runner, cfg))
            if runner.state_pool is None:  # a packed verify needs a dense target
                self.budgets.enable_packing(runner.packed_rows)
                runner.enable_packing()

    def depth_limits(self, reqs: list[Req], max_context: int) -> list[int] | None:
        """Per-request depth limit so a tree never runs past the context length or the token budget (None when
        every request may use the full depth)."""
        depth = self.cfg.block_size - 1
        lim = [
            max(
                0,
                min(
                    depth, max_context - r.kv_len - 1, r.params.max_tokens - r.num_output_tokens - 1
                ),
            )
            for r in reqs
        ]
        return None if all(x == depth for x in lim) else lim

    def round(self, reqs: list[Req], max_context: int) -> list[list[int]]:
        """Run one round; returns the tokens each request emits (accepted drafts then the bonus
        token). AR (NONE, or a width-1 plan) is the round of one-node trees."""
        runner, t = self.runner, self.times.start()
        self.clock.start()
        rnd = runner.begin(reqs)
        gb = GrammarBatch.of(reqs, self.mask_words, runner.device, self.mask_workers)
        plan = self.budgets.plan(reqs, rnd.max_kv_len)
        if plan.rows is not None:  # a batch-wide budget
            return self._packed_round(rnd, plan, gb, max_context, t)
        self.clock.mark()  # the host's part before the draft launch ends here
        draft, t = self._draft(rnd, plan, gb, max_context, t)
        self.clock.mark()  # the draft's device work ends here
        self.gains.draft_launched()
        vo = runner.verify(rnd, draft.tree)
        if gb is not None and draft.logits is None:  # the root masks fill while the verify runs
            gb.root_masks()
        gain = None
        if self.budgets.observes and draft.tree.chain_probs is not None:
            # the gain curves need only the draft: read back while the verify runs, so the
            # policy learns from them off the critical path
            gain = self.gains.read_back(draft.tree, plan.chain)
        t = self.times.add("verify", t)
        self.clock.mark()
        res = self._accept(rnd, draft.tree, vo, gb)
        t = self.times.add("accept", t)
        # emitted token j was drawn at node path[j]
        lp = logprobs.node_logprobs(reqs, vo.logits, res.path, res.out_tokens)
        return self._finish(rnd, plan, vo, res, lp, gb, gain, t)

    def _finish(self, rnd: Round, plan: RoundPlan, vo: Verify, res, lp, gb, gain, t):
        """A round's tail, dense or packed: the commit, the policy's observe of the gain
        columns (gain: `GainReadBack.read_back`'s, or None), the round's one blocking read-back
        and emit, the accepted lengths applied."""
        runner, reqs = self.runner, rnd.reqs
        runner.commit(rnd, vo, res.path, res.accept_length)
        out = torch.cat([res.num_out[:, None], res.out_tokens], 1)
        self.clock.mark()  # the last op before the read-back
        if gain is not None:  # the draft's half of the policy's observe, under the verify
            host_gain, ready = gain
            if ready is not None:
                ready.synchronize()  # the draft and the copy, not the verify behind them
            # a packed round's shares ride as the last column: they become plan.budgets
            self.budgets.observe_curves(plan, host_gain.numpy())
        # after the policy's host work, not before: the server's hook hands the previous round's
        # outputs to its event-loop thread, whose SSE work would then compete for the GIL with
        # the policy's numpy behind it (measured in BENCHMARKS.md's history)
        self._while_device_runs()
        counts, emitted = self.emit(reqs, out, lp, gb)  # the round's one blocking copy
        self.times.add("commit", t)
        runner.advance(rnd, counts)  # root + (k - 1) accepted drafts; the bonus is pending
        self.budgets.observe(plan, len(reqs), counts)
        self._read_clock(gb)
        return emitted

    def _packed_round(
        self, rnd: Round, plan: RoundPlan, gb: GrammarBatch | None, max_context: int, t
    ) -> list[list[int]]:
        """A batch-wide budget's round (speculative/batch_budget.py): the tree at the plan's
        spec (grammar rows rebuilt under their grammars), then the batch's `plan.rows` most
        valuable drafted nodes by this round's own node probabilities (`allocate`, each request
        at most its cap), verified in one packed forward of only those rows; the walk and the
        commit run on the compact tree. Greedy rows walk the packed verify's greedy tokens;
        the rows that sample, ask for log-probs or are under a grammar get their nodes' logits
        and draw as a dense round draws (`_special_tokens`). Each request's share is read back
        beside the gain curves, under the verify, and teaches the policy as a per-request
        budget would."""
        runner, reqs = self.runner, rnd.reqs
        self.clock.mark()
        draft, limits = self._drafted(rnd, plan, max_context)  # a packed plan cuts nothing
        t = self.times.add("draft", t)
        self.clock.mark()
        tree = draft.tree
        if gb is not None:
            tree = self._grammar_tree(gb, tree, draft.logits, limits, plan)
        if tree.node_probs is None:  # the draft graphs' and grammar trees: from the logits
            tree = dataclasses.replace(tree, node_probs=node_probs_from_logits(tree, draft.logits))
        caps = torch.tensor(plan.caps, device=runner.device)
        alloc = allocate(tree, caps, plan.rows)
        self.gains.draft_launched()  # the shares too: read back beside the curves
        special = [i for i, r in enumerate(reqs) if _needs_logits(r)]
        sub = torch.tensor(special, device=runner.device) if special else None
        vo = runner.verify_packed(rnd, tree, alloc.keep, len(reqs) + plan.rows, sub)
        gain = self.gains.read_back(tree, False, alloc.cut)
        t = self.times.add("verify", t)
        self.clock.mark()
        if not special:
            res, lp = accept_tree(rnd.packed.tree, vo.greedy_tokens), None
        else:  # every request that asked for log-probs is among them, in batch order
            res = accept_tree(rnd.packed.tree, self._special_tokens(rnd, special, sub, vo, gb))
            path, out_tokens = res.path.index_select(0, sub), res.out_tokens.index_select(0, sub)
            lp = logprobs.node_logprobs([reqs[i] for i in special], vo.logits, path, out_tokens)
        t = self.times.add("accept", t)
        return self._finish(rnd, plan, vo, res, lp, gb, gain, t)

    def _special_tokens(
        self, rnd: Round, special: list[int], sub: torch.Tensor, vo: Verify, gb
    ) -> torch.Tensor:
        """A packed round's target tokens [b, W]: the greedy tokens, the requests `special`
        (sub, on the device) drawn from their nodes' logits vo.logits [s, W, V] as
        `_target_tokens` draws a dense round's (sampled at each node's position, or under
        the grammar's masks at each node's full-tree node)."""
        tree = rnd.packed.tree
        lens, depths = rnd.lens.index_select(0, sub), tree.depths.index_select(0, sub)
        pos = NodePositions.of_tree(lens, depths, tree.depth_bound)
        greedy = vo.greedy_tokens.index_select(0, sub)
        gb_s = None if gb is None else gb.compact(special, rnd.packed.local_node)
        part = [rnd.reqs[i] for i in special]
        drawn = self._draw(part, pos, Verify(vo.logits, None, greedy), gb_s)
        return vo.greedy_tokens.index_copy(0, sub, drawn)

    def first_tokens(self, reqs: list[Req], logits: torch.Tensor) -> list[list[int]]:
        """Prefill's first token of each request whose prompt is now cached, from the logits [b, V]
        at its prompt's last token: the same emit as a round's (a one-node tree whose root is that
        token, at position kv_len - 1)."""
        dev = self.runner.device
        gb = GrammarBatch.of(reqs, self.mask_words, dev, self.mask_workers)
        if gb is not None:  # the first token under the grammar's start state
            gb.root_masks()
        lens = torch.tensor([r.kv_len - 1 for r in reqs], device=dev)
        vo = Verify(logits[:, None], None)
        # only the tree's shape matters here (one node at depth 0): its token is never read
        tokens = self._target_tokens(reqs, lens, root_tree(torch.zeros_like(lens)), vo, gb)
        res = accept_root(tokens)
        lp = logprobs.node_logprobs(reqs, vo.logits, res.path, res.out_tokens)
        out = torch.cat([res.num_out[:, None], res.out_tokens], 1)
        return self.emit(reqs, out, lp, gb)[1]

    def emit(
        self, reqs: list[Req], out: torch.Tensor, lp: torch.Tensor | None, gb: GrammarBatch | None
    ) -> tuple[list[int], list[list[int]]]:
        """The read-back of out [b, 1 + w] (each request's emitted count, then its tokens) and the
        log-probs: (counts, each request's emitted tokens, its grammar advanced over them and its
        log-probs recorded)."""
        host_t, lp_rows = logprobs.read_back_tensor(reqs, out, lp)
        host = host_t.tolist()  # [count, tokens...] per request
        counts = [row[0] for row in host]
        emitted = [row[1 : 1 + row[0]] for row in host]
        if gb is not None:
            emitted = gb.advance(emitted)
            self.grammar_host_s += gb.host_s
        for r, lp_row, toks in zip(reqs, lp_rows, emitted):
            logprobs.append(r, lp_row, toks)
        return counts, emitted

    def _drafted(self, rnd: Round, plan: RoundPlan, max_context: int) -> tuple[Draft, list | None]:
        """The drafter's tree of the plan's spec and cuts, each request depth-limited by its
        context and token budget, and those limits (None: none)."""
        limits = self.depth_limits(rnd.reqs, max_context)
        if limits is not None:  # a depth-limited tree's curve teaches the policy no shape
            plan.full = [x == self.cfg.block_size - 1 for x in limits]
        return self.runner.draft(rnd, limits, plan.cut, plan.spec), limits

    def _draft(self, rnd: Round, plan: RoundPlan, gb: GrammarBatch | None, max_context: int, t):
        """The round's tree at the plan's width (and the phase clock): the root only for a width-1
        plan (AR), else the drafter's (grammar rows rebuilt under their grammars)."""
        if plan.width == 1:
            return Draft(root_tree(rnd.roots)), t
        draft, limits = self._drafted(rnd, plan, max_context)
        t = self.times.add("draft", t)
        tree = draft.tree
        if gb is not None:  # the grammar rows' trees rebuilt under their grammars
            tree = self._grammar_tree(gb, tree, draft.logits, limits, plan)
        return Draft(tree.narrow(plan.width), draft.logits), self.times.add("tree", t)

    def _accept(self, rnd: Round, tree: DraftTree, vo: Verify, gb: GrammarBatch | None):
        """The accept walk: the one walked inside the verify graph where it ran (greedy rows, no
        grammar), else eager over the target tokens drawn at every node."""
        reqs = rnd.reqs
        if vo.greedy_accept is not None and gb is None and all(r.params.greedy for r in reqs):
            return vo.greedy_accept
        tokens = self._target_tokens(reqs, rnd.lens, tree, vo, gb)
        return accept_root(tokens) if tree.num_nodes == 1 else accept_tree(tree, tokens)

    def _target_tokens(self, reqs, lens, tree: DraftTree, vo: Verify, gb):
        """The target's token at every node [b, n] (sampled, or under the grammar rows' masks);
        lens [b]: where each tree's root sits."""
        return self._draw(reqs, NodePositions.of_tree(lens, tree.depths, tree.depth_bound), vo, gb)

    def _draw(self, reqs, pos: NodePositions, vo: Verify, gb) -> torch.Tensor:
        """`_target_tokens` at the nodes' positions `pos`."""
        sample = sample_nodes if gb is None else gb.target_tokens
        params, seeds = [r.params for r in reqs], [r.seed for r in reqs]
        return sample(vo.logits, params, seeds, pos, vo.greedy_tokens)

    def _read_clock(self, gb: GrammarBatch | None = None) -> None:
        """The round's device and idle seconds into its RoundRecord (after the read-back), and
        the host seconds its grammar rows took."""
        rec = self.budgets.last
        self.clock.read(rec.timing)
        rec.timing.grammar_s = None if gb is None else gb.host_s

    def _while_device_runs(self) -> None:
        """The round's device work is launched and the read-back has not waited for it yet: host
        work that needs nothing of this round (the server publishing the previous round's
        outputs) runs here, hidden under the device's work."""
        if self.while_device_runs is not None:
            self.while_device_runs()

    def _grammar_tree(self, gb: GrammarBatch, tree, draft_logits, limits, plan) -> DraftTree:
        algorithm, budget, topk_cap, _ = plan.spec or self.cfg.tree_spec()
        chain = algorithm == "DFLASH"
        if chain:  # the chain's nodes: one per depth
            budget = self.cfg.block_size - 1
        cap = plan.width - 1
        budgets = [
            min(cap, budget if plan.cut is None or chain else plan.cut[i])
            for i in range(len(gb.reqs))
        ]
        return gb.draft(tree, draft_logits, limits, budgets, chain, topk_cap)


class GainReadBack:
    """The round's gain columns (`gain_columns`) to the host beside the verify. On the GPU a side
    stream waits for the draft (an event recorded before the verify is launched), computes the
    columns and copies them while the verify runs: the verify's launch waits for none of it (the
    columns' small launches, queued before the verify on one stream, had sat between the draft
    and the verify with the GPU idle). On the CPU the columns are computed in place."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.draft_done = torch.cuda.Event()

    def draft_launched(self) -> None:
        """After the draft's last launch, before the verify's."""
        if self.cuda:
            self.draft_done.record()

    def read_back(
        self, tree, chain: bool, shares: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """(host columns, the event they are ready at: None on the CPU, where they are).
        shares: a packed round's per-request shares, a last column (ready at `draft_launched`)."""
        if not self.cuda:
            return gain_columns(tree, chain, shares), None
        s = self.stream
        s.wait_event(self.draft_done)
        with torch.cuda.stream(s):
            cols = gain_columns(tree, chain, shares)
            host = torch.empty(cols.shape, dtype=cols.dtype, pin_memory=True)
            host.copy_(cols, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(s)
        for x in (tree.path_probs, tree.chain_probs, shares):  # not freed under the stream
            if x is not None:
                x.record_stream(s)
        return host, ready


def _needs_logits(r: Req) -> bool:
    """A request whose target tokens need its nodes' logits, not only their argmax."""
    return not r.params.greedy or bool(r.params.logprobs) or r.grammar is not None
