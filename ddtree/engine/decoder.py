"""One decoding round for a batch of running requests (the engine side of speculative decoding):
draft -> build tree -> verify -> sample at every node -> accept walk -> commit.

NONE (plain AR) is the one-node tree; DFLASH is the drafter's top-1 chain; DDTREE the best-first tree.
The host reads back only the emitted tokens and their count, once per round; with
`--speculative-ddtree-budget auto` also the trees' gain curves, copied on a side stream as soon as the draft is
done (`GainReadBack`), so the policy learns from them while the verify runs.

With CUDA graphs the draft replay goes from the roots to the finished tree (drafter, LM head, tree build, each
request cut to its budget) and the verify replay from the tree to the greedy accept walk (target, LM head, argmax,
walk); the decoder falls back to eager sampling + walk when a request samples (temperature > 0) or is
under a grammar (`_accept`; the round benchmarks' subclass, bench/bench_decoder.py, rewrites the target tokens
there). Each round's width and per-request budgets come from the `BudgetPlanner`
(engine/budget.py): the fixed budget (with per-request caps) or the load-aware policy; width 1 is a plain AR
round that still writes the drafter's context.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddtree.engine import logprobs
from ddtree.engine.budget import BudgetPlanner, RoundPlan, gain_columns
from ddtree.engine.config import SpecConfig
from ddtree.engine.grammar_jobs import MaskWorkers
from ddtree.engine.grammar_round import GrammarBatch
from ddtree.engine.model_runner import ModelRunner, RoundMeta
from ddtree.engine.request import Req
from ddtree.engine.round_clock import RoundClock
from ddtree.engine.sampler import NodePositions, sample_nodes
from ddtree.speculative.accept import accept_tree
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
        # int32 words of a next-token bitmask row (grammar requests, engine/grammar_round.py)
        self.mask_words = (runner.target.config.vocab_size + 31) // 32
        self.grammar_host_s = 0.0  # host seconds the grammar rows' trees and masks took
        # the grammar rows' mask work runs there, bounded per request (engine/grammar_jobs.py)
        self.mask_workers = MaskWorkers(runner.cfg.max_running_requests)
        if cfg.algorithm != "NONE":
            runner.set_tree_spec(cfg.algorithm, cfg.budget, cfg.topk_cap, cfg.shadow_linear)
            runner.add_tree_specs(self.budgets.tree_specs())  # auto: every rung's own draft
        if cfg.adaptive:  # after the draft graphs of the spec exist: the profile replays them
            from ddtree.engine.budget_profile import round_cost

            self.budgets.set_cost(round_cost(runner, cfg))

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
        """Run one round; returns the tokens each request emits (accepted drafts then the bonus token)."""
        runner, cfg, t = self.runner, self.cfg, self.times.start()
        self.clock.start()
        # one host->device copy with the round's lengths and slots
        meta = runner.round_meta(reqs)
        roots = meta.roots
        gb = GrammarBatch.of(reqs, self.mask_words, runner.device, self.mask_workers)
        if cfg.algorithm == "NONE":
            emitted = self._ar_round(reqs, meta, t, gb)
            self.budgets.observe(RoundPlan(1, None), len(reqs), [1] * len(reqs), None)
            self._read_clock(gb)
            return emitted
        plan = self.budgets.plan(reqs, max(meta.kv_lens))
        self.clock.mark()  # the host's part before the draft launch ends here
        if plan.width == 1:  # the policy chose AR for the batch: no draft
            tree = _root_only(roots)
            if gb is not None:
                gb.root_masks()
        else:
            limits = self.depth_limits(reqs, max_context)
            if limits is not None:  # a depth-limited tree's curve teaches the policy no shape
                plan.full = [x == cfg.block_size - 1 for x in limits]
            # auto: the rung's own tree spec (None: the decoder's)
            proposal, tree = runner.draft_tree(
                reqs, roots, cfg.block_size, limits, budgets=plan.cut, spec=plan.spec
            )
            t = self.times.add("draft", t)
            if tree is None:  # eager: the same build
                tree = self._build(roots, proposal, limits, plan)
                draft_logits = runner.drafter.proposal_logits(proposal)
            else:  # the draft graph hands back its static logits beside the tree
                draft_logits = proposal
            if gb is not None:  # the grammar rows' trees rebuilt under their grammars
                tree = self._grammar_tree(gb, tree, draft_logits, limits, plan)
            tree = tree.narrow(plan.width)
            t = self.times.add("tree", t)
        self.clock.mark()  # the draft's device work ends here
        self.gains.draft_launched()
        vo = runner.verify_nodes(reqs, tree)
        gain = None
        if self.budgets.observes and tree.chain_probs is not None:
            # the gain curves need only the draft: read back while the verify runs, so the
            # policy learns from them off the critical path
            gain = self.gains.read_back(tree, plan.chain)
        t = self.times.add("verify", t)
        self.clock.mark()
        res = self._accept(reqs, tree, vo, meta, gb)
        t = self.times.add("accept", t)
        # emitted token j was drawn at node path[j]
        lp = logprobs.node_logprobs(reqs, vo.logits, res.path, res.out_tokens)
        runner.commit(reqs, res.path, res.accept_length, vo.taps)
        out = torch.cat([res.num_out[:, None], res.out_tokens], 1)
        self.clock.mark()  # the last op before the read-back
        if gain is not None:  # the draft's half of the policy's observe, under the verify
            host_gain, ready = gain
            if ready is not None:
                ready.synchronize()  # the draft and the copy, not the verify behind them
            self.budgets.observe_curves(plan, host_gain.numpy())
        # after the policy's host work, not before: the server's hook hands the previous round's
        # outputs to its event-loop thread, whose SSE work would then compete for the GIL with
        # the policy's numpy behind it (measured in BENCHMARKS.md's history)
        self._while_device_runs()
        host_t, lp_rows = logprobs.read_back_tensor(reqs, out, lp)  # the round's blocking copy
        self.times.add("commit", t)
        w = res.out_tokens.shape[1] + 1
        host = host_t[:, :w].tolist()  # only the token columns as Python lists
        # root + (k - 1) accepted drafts; the bonus is pending
        runner.advance(reqs, [row[0] for row in host])
        emitted = [row[1 : 1 + row[0]] for row in host]
        if gb is not None:
            emitted = gb.advance(emitted)
            self.grammar_host_s += gb.host_s
        for r, lp_row, toks in zip(reqs, lp_rows, emitted):
            logprobs.append(r, lp_row, toks)
        self.budgets.observe(plan, len(reqs), [row[0] for row in host])
        self._read_clock(gb)
        return emitted

    def _accept(self, reqs: list[Req], tree: DraftTree, vo, meta: RoundMeta, gb):
        """The accept walk: the one walked inside the verify graph where it ran (greedy rows, no
        grammar), else eager over the target tokens drawn at every node."""
        if vo.greedy_accept is not None and gb is None and all(r.params.greedy for r in reqs):
            return vo.greedy_accept
        return accept_tree(tree, self._target_tokens(reqs, tree, vo, meta, gb))

    def _target_tokens(self, reqs: list[Req], tree: DraftTree, vo, meta: RoundMeta, gb):
        """The target's token at every node [b, n] (sampled, or under the grammar rows' masks)."""
        sample = sample_nodes if gb is None else gb.target_tokens
        pos = NodePositions.of_tree(meta.lens, tree.depths, tree.depth_bound)
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

    def _build(self, roots, proposal, limits, plan: RoundPlan) -> DraftTree:
        """The eager tree (no draft graph): what the draft graph of the plan's spec builds."""
        dev = self.runner.device
        max_depth = None if limits is None else torch.tensor(limits, device=dev)
        spec = plan.spec or self.cfg.tree_spec()
        cut = (
            None if plan.cut is None or spec[0] == "DFLASH" else torch.tensor(plan.cut, device=dev)
        )
        return self.runner.drafter.build_tree(roots, proposal, spec, max_depth, cut)

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

    def _ar_round(
        self, reqs: list[Req], meta: RoundMeta, t: float, gb: GrammarBatch | None = None
    ) -> list[list[int]]:
        runner = self.runner
        n = 1
        tree = _root_only(meta.roots)
        vo = runner.verify_nodes(reqs, tree)
        if gb is not None:  # the grammar rows' masks, filled while the verify runs on a GPU
            gb.root_masks()
        t = self.times.add("verify", t)
        params, seeds = [r.params for r in reqs], [r.seed for r in reqs]
        pos = NodePositions.of_tree(meta.lens, tree.depths, 0)
        sample = sample_nodes if gb is None else gb.target_tokens
        tokens = sample(vo.logits, params, seeds, pos, vo.greedy_tokens)[:, :1]
        t = self.times.add("accept", t)
        zeros = torch.zeros(len(reqs), dtype=torch.int64, device=runner.device)
        lp = logprobs.node_logprobs(reqs, vo.logits, zeros[:, None], tokens)
        # no KV moves; hybrid: the verify already stepped the GDN state
        runner.commit(reqs, zeros[:, None], zeros, None)
        self.clock.mark()
        self._while_device_runs()
        host, lp_rows = logprobs.read_back(reqs, tokens, lp)
        self.times.add("commit", t)
        runner.advance(reqs, [n] * len(reqs))
        if gb is not None:
            host = gb.advance(host)
            self.grammar_host_s += gb.host_s
        for r, lp_row, toks in zip(reqs, lp_rows, host):
            logprobs.append(r, lp_row, toks)
        return host


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

    def read_back(self, tree, chain: bool) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """(host columns, the event they are ready at: None on the CPU, where they are)."""
        if not self.cuda:
            return gain_columns(tree, chain), None
        s = self.stream
        s.wait_event(self.draft_done)
        with torch.cuda.stream(s):
            cols = gain_columns(tree, chain)
            host = torch.empty(cols.shape, dtype=cols.dtype, pin_memory=True)
            host.copy_(cols, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(s)
        for x in (tree.path_probs, tree.chain_probs):  # eager trees: not freed under the stream
            if x is not None:
                x.record_stream(s)
        return host, ready


def _root_only(roots: torch.Tensor) -> DraftTree:
    b = roots.shape[0]
    dev = roots.device
    return DraftTree(
        tokens=roots[:, None],
        parents=torch.full((b, 1), -1, dtype=torch.int64, device=dev),
        depths=torch.zeros(b, 1, dtype=torch.int64, device=dev),
        valid=torch.ones(b, 1, dtype=torch.bool, device=dev),
        tree_mask=torch.ones(b, 1, 1, dtype=torch.bool, device=dev),
        num_depths=0,
    )
