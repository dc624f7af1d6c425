"""The grammar requests of one step: their draft trees, masks and masked target tokens.

A request with a grammar (`SamplingParams.grammar`) keeps a matcher (`Req.grammar`) at the state
after every token it has emitted, the pending root included. In a round:

1. draft: the drafter's top-K per depth for the grammar rows comes to the host (the round's one
   extra sync), each grammar row's tree is rebuilt there under its grammar
   (`grammar.tree.build_grammar_tree`: only grammar-valid nodes, forced tokens drafted with
   certainty) and written over that row of the batch's tree; the other rows keep the tree the
   draft graph (or the eager build) made. Every node's next-token bitmask is filled on the way,
   and the masks go to the device as one [grammar rows, nodes, words] int32 copy.
2. verify: unchanged (the graph or eager forward; the in-graph greedy walk is not used).
3. target tokens: the grammar rows' logits are masked at every node (`grammar.masks`) and then
   argmax'd or sampled exactly as without a grammar, so the accept walk emits what AR decoding
   under the same grammar emits at T=0 and samples its distribution at T>0.
4. advance: each matcher accepts the request's emitted tokens.

AR rounds, a width-1 round and the prefill's first token mask the root only. A root whose mask
allows nothing ends its request with finish_reason "grammar" (a dead end: the grammar cannot go
on and is not finished); a matcher that accepted its stop token ends it with "stop". Requests
without a grammar pay nothing: a batch without one never builds this object.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from ddtree.engine.round.grammar_jobs import MaskFailure, MaskWorkers
from ddtree.engine.round.sampler import NodePositions, sample_from
from ddtree.engine.scheduling.request import Req, SamplingParams
from ddtree.grammar.backend import Matcher
from ddtree.grammar.masks import apply_bitmask
from ddtree.grammar.tree import GrammarTree, build_grammar_tree
from ddtree.speculative.tree import DraftTree, topk_logprobs

MIN_TOPK = 8  # candidates per depth a grammar tree draws from (a chain too: the best allowed one)


class GrammarBatch:
    def __init__(self, reqs: list[Req], words: int, device: torch.device, workers: MaskWorkers):
        self.reqs = reqs
        self.rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        for i in self.rows:  # a rolled-back step (engine/faults.py) keeps only emitted tokens
            if reqs[i].grammar_end is None:  # a failed one's matcher may be a worker's still
                reqs[i].grammar.sync(reqs[i].num_output_tokens)
        self.words, self.device = words, torch.device(device)
        self.workers = workers
        self.masks: torch.Tensor | None = None  # [g, n, words] on the device
        self.host_s = 0.0  # host seconds spent building trees and filling masks

    @classmethod
    def of(cls, reqs: list[Req], words: int, device, workers: MaskWorkers) -> GrammarBatch | None:
        if not any(r.grammar is not None for r in reqs):
            return None
        return cls(reqs, words, device, workers)

    def _host(self, shape) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)

    def _live(self) -> list[tuple[int, int]]:
        """(j, i) of the grammar rows still under their grammar (a terminated one is marked)."""
        out = []
        for j, i in enumerate(self.rows):
            r = self.reqs[i]
            if r.grammar_end is None and r.grammar.terminated:
                r.grammar_end = "stop"
            if r.grammar_end is None:
                out.append((j, i))
        return out

    def _run(self, work: dict[int, Callable[[], object]]) -> dict[int, object]:
        """Each row's work on the mask workers (grammar_jobs.py); a row whose work failed ends its
        request (the error set) and is absent from the result."""
        jobs = {}
        for i, w in work.items():
            r = self.reqs[i]
            jobs[i] = (r.grammar, r.params.grammar.param, w)
        out = self.workers.run(jobs)
        for i, res in list(out.items()):
            if isinstance(res, MaskFailure):
                r = self.reqs[i]
                r.grammar_end = "abort"
                r.error, r.error_status, r.error_code = res.message, res.status, res.code
                del out[i]
        return out

    # ---- root-only steps: prefill's first token, AR rounds, width-1 rounds ----------------------------
    def root_masks(self) -> None:
        """Each grammar row's mask at its current state (a dead root is marked on its request)."""
        t0 = time.perf_counter()
        host = self._host((len(self.rows), 1, self.words))
        live = self._live()

        def root(m: Matcher) -> torch.Tensor:
            row = torch.empty((1, self.words), dtype=torch.int32)
            m.fill(row, 0)
            return row

        done = self._run({i: partial(root, self.reqs[i].grammar) for _, i in live})
        for j, i in live:
            if i in done:
                host[j, 0] = done[i][0]
                if not host[j].any():
                    self.reqs[i].grammar_end = "grammar"
                    host[j].fill_(-1)  # any token: it is dropped, the request ends
        self.masks = host.to(self.device, non_blocking=True)
        self.host_s += time.perf_counter() - t0

    # ---- a drafted round ------------------------------------------------------------------------------
    def draft(
        self,
        tree: DraftTree,
        draft_logits: torch.Tensor,
        limits: list[int] | None,
        budgets: list[int],
        chain: bool,
        topk: int,
    ) -> DraftTree:
        """The batch's tree with every grammar row rebuilt under its grammar (see the module
        docstring); budgets[i]: row i's drafted nodes at most (fewer for a slow grammar:
        grammar_jobs.MaskBudget.nodes)."""
        b, n = tree.tokens.shape
        D = tree.depth_bound
        rows = torch.tensor(self.rows, device=draft_logits.device)
        k = min(max(topk, MIN_TOPK), draft_logits.shape[-1])
        logp, ids = topk_logprobs(draft_logits.index_select(0, rows), k)
        logp, ids = logp.cpu().numpy(), ids.cpu().numpy()  # the draft must be done: a sync
        t0 = time.perf_counter()
        g = len(self.rows)
        host = self._host((g, n, self.words))
        tokens = np.zeros((g, n), dtype=np.int64)
        parents = np.full((g, n), -1, dtype=np.int64)
        path = np.zeros((g, tree.path_probs.shape[1] if tree.path_probs is not None else 0))
        chainp = np.zeros((g, D))
        live = self._live()
        work = {}
        for j, i in live:
            r = self.reqs[i]
            work[i] = partial(
                _build,
                r.grammar,
                r.output_ids[-1],
                logp[j],
                ids[j],
                self.workers.budget.nodes(r.grammar, min(budgets[i], n - 1)),
                D if limits is None else limits[i],
                n,
                self.words,
                chain,
            )
        done = self._run(work)
        for j, i in enumerate(self.rows):
            r = self.reqs[i]
            tokens[j, 0] = r.output_ids[-1]
            if i not in done:  # ended (its row: the root, any token; what it emits is dropped)
                continue
            gt, masks = done[i]
            host[j] = masks
            if not host[j, 0].any() and not r.grammar.terminated:
                r.grammar_end = "grammar"
                host[j].fill_(-1)
            tokens[j], parents[j] = gt.tokens, gt.parents
            m = min(len(gt.path_scores), path.shape[1])
            path[j, :m] = np.exp(gt.path_scores[:m])
            c = min(len(gt.chain_scores), D)
            chainp[j, :c] = np.exp(gt.chain_scores[:c])
        sub = DraftTree.from_parents(torch.from_numpy(tokens), torch.from_numpy(parents), D)
        self.masks = host.to(self.device, non_blocking=True)
        self.host_s += time.perf_counter() - t0
        dev = tree.tokens.device

        def put(full: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
            return full.index_copy(0, rows, part.to(device=dev, dtype=full.dtype))

        out = DraftTree(
            put(tree.tokens, sub.tokens),
            put(tree.parents, sub.parents),
            put(tree.depths, sub.depths),
            put(tree.valid, sub.valid),
            put(tree.tree_mask, sub.tree_mask),
            tree.num_depths,
        )
        if tree.path_probs is not None:
            out.path_probs = put(tree.path_probs, torch.from_numpy(path))
        if tree.chain_probs is not None:
            out.chain_probs = put(tree.chain_probs, torch.from_numpy(chainp))
        return out

    # ---- after the verify -----------------------------------------------------------------------------
    def target_tokens(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int | None],
        positions: NodePositions,
        greedy: torch.Tensor | None,
    ) -> torch.Tensor:
        """logits [b, n, V] -> tokens [b, n]: what `sample_nodes` draws, the grammar rows from
        their masked logits (n may be below the masks' width: the tree was narrowed)."""
        b, n, _ = logits.shape
        out = logits.argmax(-1) if greedy is None else greedy.clone()
        gset = set(self.rows)
        for i, p in enumerate(params):
            if i not in gset and not p.greedy:
                out[i] = sample_from(logits[i], p, seeds[i], *positions.of(i))
        rows = torch.tensor(self.rows, device=logits.device)
        masked = logits.index_select(0, rows).float()
        flat = masked.view(-1, masked.shape[-1])
        apply_bitmask(flat, self.masks[:, :n].reshape(-1, self.words))
        picked = masked.argmax(-1)
        for j, i in enumerate(self.rows):
            p = params[i]
            if not p.greedy:
                picked[j] = sample_from(masked[j], p, seeds[i], *positions.of(i))
        return out.index_copy(0, rows, picked)

    def compact(self, sub: list[int], local_node: torch.Tensor) -> GrammarBatch:
        """This batch as `target_tokens` sees a packed round's requests `sub` (every grammar
        row among them, in batch order): its rows renumbered within sub, its masks [g, W,
        words] at each compact tree's local nodes (local_node [b, W]: the full-tree node of
        each; padding reads node 0's, never walked). The same matchers: only `advance`
        moves them, on the whole batch."""
        out = copy.copy(self)
        at = {i: k for k, i in enumerate(sub)}
        out.reqs, out.rows = [self.reqs[i] for i in sub], [at[i] for i in self.rows]
        rows = torch.tensor(self.rows, device=local_node.device)
        node = local_node.index_select(0, rows).clamp(min=0)
        out.masks = self.masks.gather(1, node[..., None].expand(-1, -1, self.words))
        return out

    def advance(self, emitted: list[list[int]]) -> list[list[int]]:
        """Each matcher accepts its request's emitted tokens; a request the grammar ended emits
        nothing more (returns the batch's emitted lists, those cut)."""
        for i in self.rows:
            r = self.reqs[i]
            if r.grammar_end is not None:
                emitted[i] = []
                continue
            toks = emitted[i]
            k = r.grammar.accept_all(toks)
            if r.grammar.terminated:  # its stop token: what follows it is not the grammar's
                emitted[i] = toks[:k]
                r.grammar_end = "stop"
            elif k != len(toks):
                raise RuntimeError(
                    f"request {r.rid}: the grammar refused an emitted token of {toks}"
                )
        return emitted


def _build(
    m: Matcher, root: int, logp, ids, budget: int, limit: int, n: int, words: int, chain
) -> tuple[GrammarTree, torch.Tensor]:
    """One request's grammar tree and its masks [n, words] (a mask worker's job: its own
    buffer, so a job the engine stopped waiting for writes nothing the step reads)."""
    masks = torch.full((n, words), -1, dtype=torch.int32)
    gt = build_grammar_tree(m, root, logp, ids, budget, limit, n, masks, chain=chain)
    return gt, masks
