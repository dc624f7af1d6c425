"""One decoding round for a batch of running requests (the engine side of speculative decoding):
draft -> build tree -> verify -> sample at every node -> accept walk -> commit.

NONE (plain AR) is the one-node tree; DFLASH is the drafter's top-1 chain; DDTREE the best-first tree.
The host reads back only the emitted tokens and their count, once per round.

With CUDA graphs the draft replay goes from the roots to the finished tree (drafter, LM head, tree build) and the
verify replay from the tree to the greedy accept walk (target, LM head, argmax, walk); the decoder falls back to
the eager tree build for rounds with per-request budgets, and to eager sampling + walk when a request samples
(temperature > 0) or a `target_override` is set.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddtree.engine import logprobs
from ddtree.engine.config import SpecConfig
from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.request import Req
from ddtree.engine.sampler import sample_nodes
from ddtree.speculative.accept import accept_tree
from ddtree.speculative.tree import DraftTree, build_chain, build_tree


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


# (tree, target tokens [b, n]) -> target tokens the accept walk uses instead (benchmarks force accept lengths)
TargetOverride = Callable[[DraftTree, torch.Tensor], torch.Tensor]


class SpecDecoder:
    def __init__(
        self,
        runner: ModelRunner,
        cfg: SpecConfig,
        times=None,
        target_override: TargetOverride | None = None,
    ):
        """`times`: a phase timer with PhaseTimes' `start()` / `add(name, t0)` (default: the host clock)."""
        self.runner, self.cfg = runner, cfg
        self.times = times if times is not None else PhaseTimes()
        self.target_override = target_override
        if cfg.algorithm != "NONE":
            runner.set_tree_spec(cfg.algorithm, cfg.budget, cfg.topk_cap, cfg.shadow_linear)

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
        # one host->device copy with the round's lengths and slots
        roots = runner.round_meta(reqs).roots
        if cfg.algorithm == "NONE":
            return self._ar_round(reqs, roots, t)
        limits = self.depth_limits(reqs, max_context)
        budgets = self._budgets(reqs)
        draft_logits, tree = runner.draft_tree(reqs, roots, cfg.block_size, limits)
        t = self.times.add("draft", t)
        if tree is None or (budgets is not None and cfg.algorithm == "DDTREE"):
            max_depth = (
                None
                if limits is None
                else torch.tensor(limits, dtype=torch.int64, device=runner.device)
            )
            if cfg.algorithm == "DFLASH":
                tree = build_chain(roots, draft_logits, max_depth=max_depth)
            else:
                tree = self._build_trees(reqs, roots, draft_logits, max_depth, budgets)
        t = self.times.add("tree", t)
        vo = runner.verify_nodes(reqs, tree)
        t = self.times.add("verify", t)
        params = [r.params for r in reqs]
        if (
            vo.greedy_accept is not None
            and self.target_override is None
            and all(p.greedy for p in params)
        ):
            res = vo.greedy_accept  # walked inside the verify graph
        else:
            target_tokens = sample_nodes(
                vo.logits, params, [r.generator for r in reqs], vo.greedy_tokens
            )
            if self.target_override is not None:
                target_tokens = self.target_override(tree, target_tokens)
            res = accept_tree(tree, target_tokens)
        t = self.times.add("accept", t)
        # emitted token j was drawn at node path[j]
        lp = logprobs.node_logprobs(reqs, vo.logits, res.path, res.out_tokens)
        runner.commit(reqs, res.path, res.accept_length, vo.taps)
        out = torch.cat([res.num_out[:, None], res.out_tokens], 1)
        host, lp_rows = logprobs.read_back(reqs, out, lp)  # the round's one device->host copy
        self.times.add("commit", t)
        # root + (k - 1) accepted drafts; the bonus is pending
        runner.advance(reqs, [row[0] for row in host])
        emitted = [row[1 : 1 + row[0]] for row in host]
        for r, lp_row, toks in zip(reqs, lp_rows, emitted):
            logprobs.append(r, lp_row, toks)
        return emitted

    def _budgets(self, reqs: list[Req]) -> list[int] | None:
        """Per-request DDTree budgets, or None when every request uses the server's."""
        full = self.cfg.budget
        budgets = [min(r.params.ddtree_budget or full, full) for r in reqs]
        return None if all(b == full for b in budgets) else budgets

    def _build_trees(
        self, reqs, roots, draft_logits, max_depth, budgets: list[int] | None
    ) -> DraftTree:
        """One tree per request; requests asking for a smaller budget get their own build, padded with inert
        nodes to the server's width so the batch verifies in one forward."""
        cfg = self.cfg
        if budgets is None:
            return build_tree(
                roots,
                draft_logits,
                cfg.budget,
                cfg.topk_cap,
                cfg.shadow_linear,
                max_depth=max_depth,
            )
        parts = []
        for budget in sorted(set(budgets)):
            rows = torch.tensor(
                [i for i, b in enumerate(budgets) if b == budget], device=roots.device
            )
            depth = None if max_depth is None else max_depth[rows]
            tree = build_tree(
                roots[rows],
                draft_logits[rows],
                budget,
                min(cfg.topk_cap, budget),
                cfg.shadow_linear,
                max_depth=depth,
            )
            parts.append((rows, pad_tree(tree, cfg.budget + 1)))
        return merge_trees(parts, len(reqs))

    def _ar_round(self, reqs: list[Req], roots: torch.Tensor, t: float) -> list[list[int]]:
        runner = self.runner
        n = 1
        tree = _root_only(roots)
        vo = runner.verify_nodes(reqs, tree)
        t = self.times.add("verify", t)
        params, generators = [r.params for r in reqs], [r.generator for r in reqs]
        tokens = sample_nodes(vo.logits, params, generators, vo.greedy_tokens)[:, :1]
        t = self.times.add("accept", t)
        zeros = torch.zeros(len(reqs), dtype=torch.int64, device=runner.device)
        lp = logprobs.node_logprobs(reqs, vo.logits, zeros[:, None], tokens)
        # no KV moves; commits hybrid state of the root
        runner.commit(reqs, zeros[:, None], zeros, None)
        host, lp_rows = logprobs.read_back(reqs, tokens, lp)
        self.times.add("commit", t)
        runner.advance(reqs, [n] * len(reqs))
        for r, lp_row, toks in zip(reqs, lp_rows, host):
            logprobs.append(r, lp_row, toks)
        return host


def pad_tree(tree: DraftTree, n: int) -> DraftTree:
    """Append inert padding nodes (invalid, parent -1, depth 0, self-only mask) up to n nodes."""
    b, m = tree.tokens.shape
    extra = n - m
    if extra == 0:
        return tree
    dev = tree.tokens.device

    def widen(x, value):
        return torch.cat([x, torch.full((b, extra), value, dtype=x.dtype, device=dev)], 1)

    mask = torch.eye(n, dtype=torch.bool, device=dev).repeat(b, 1, 1)
    mask[:, :m, :m] = tree.tree_mask
    return DraftTree(
        widen(tree.tokens, 0),
        widen(tree.parents, -1),
        widen(tree.depths, 0),
        widen(tree.valid, False),
        mask,
        tree.num_depths,
    )


def merge_trees(parts: list[tuple[torch.Tensor, DraftTree]], b: int) -> DraftTree:
    """Scatter same-width trees of request subsets (rows) back into one batch in request order."""
    first = parts[0][1]
    out = DraftTree(
        *(
            torch.empty(
                (b, *getattr(first, f).shape[1:]),
                dtype=getattr(first, f).dtype,
                device=first.tokens.device,
            )
            for f in ("tokens", "parents", "depths", "valid", "tree_mask")
        ),
        first.num_depths,
    )
    for rows, tree in parts:
        for f in ("tokens", "parents", "depths", "valid", "tree_mask"):
            getattr(out, f)[rows] = getattr(tree, f)
    return out


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
