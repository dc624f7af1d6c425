"""A request's draft tree under a grammar, built on the host from the drafter's per-depth top-K.

Best-first, as `speculative.tree.build_tree` builds without a grammar (score = the path's summed
drafter log-probs, a prefix always scores >= its extensions), with two differences:

- A node's children are only the tokens its grammar state allows: when a node is selected the
  matcher walks to it (roll back to the common prefix with the previous node, accept the rest)
  and fills the node's next-token bitmask; candidates the mask forbids are never pushed, so the
  budget is spent on grammar-valid nodes only. The same bitmask row is the node's verify mask
  (the target's logits at the node are masked with it before the accept walk), so each node
  costs one mask fill.
- `forced` (on by default): a child's log-prob is the drafter's renormalised over the allowed
  candidates, and a node whose mask allows exactly one token gets that token as its only child
  with log-prob 0 whether or not the drafter ranked it: the target, masked the same way, must
  emit it, so a forced stretch (a JSON key, a closing bracket) is accepted whole. Off, children
  keep the drafter's raw log-probs and forced tokens the drafter missed are not drafted (what
  forcing gains: studies/grammar_rounds.py's json-raw; the engine always forces).

A selected node whose mask allows nothing (a dead end that is not the grammar's end) is dropped
before it counts. Nodes come out root first, by depth then selection order (parents precede
children, as `DraftTree` requires); padding after them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ddtree.grammar.backend import Matcher, allowed, only_token


@dataclass
class GrammarTree:
    tokens: np.ndarray  # [n] int64: root, nodes, padding 0
    parents: np.ndarray  # [n] int64: -1 for root and padding
    nodes: int  # valid nodes incl. the root
    path_scores: list[float]  # selected nodes' scores in selection order (best first)
    chain_scores: list[float]  # score of the best-child chain's node per depth 1..


def _logsumexp(x: np.ndarray) -> float:
    m = float(x.max())
    return m + float(np.log(np.exp(x - m).sum()))


def build_grammar_tree(
    matcher: Matcher,
    root: int,
    logp: np.ndarray,
    ids: np.ndarray,
    budget: int,
    limit: int,
    n: int,
    masks,
    chain: bool = False,
    forced: bool = True,
) -> GrammarTree:
    """matcher: the request's state after every emitted token (the root included); logp / ids
    [D, K]: the drafter's top-K per depth (row d drafts depth d + 1); budget: drafted nodes at
    most (n - 1 at most); limit: depth limit; masks: int32 CPU tensor [n, words] whose rows get
    the nodes' bitmasks (in output order; padding rows are left as they are). chain: DFLASH, one
    child per node. The matcher is back at its state on return."""
    words = masks.numpy()
    rows: list[np.ndarray] = []  # scratch bitmask per selected node, selection order
    scratch = masks.new_empty((1, masks.shape[1]))
    paths: list[tuple[int, ...]] = [()]
    parent_of, depth_of, score_of = [-1], [0], [0.0]
    best_child: dict[int, int] = {}
    cur: list[int] = []  # tokens the matcher has accepted past the root state

    def fill() -> np.ndarray:
        matcher.fill(scratch, 0)
        return scratch.numpy()[0].copy()

    heap: list[tuple[float, int, int, int]] = []
    counter = 0
    if matcher.terminated:  # past its stop token: the root alone, unconstrained
        words[0] = -1
        tokens = np.zeros(n, dtype=np.int64)
        tokens[0] = root
        return GrammarTree(tokens, np.full(n, -1, dtype=np.int64), 1, [], [])

    def expand(node: int, row: np.ndarray) -> None:
        nonlocal counter
        d = depth_of[node]
        if d >= limit or matcher.terminated:
            return
        toks, lps = ids[d], logp[d]
        kids: list[tuple[int, float]] = []
        if forced:
            only = only_token(row)
            if only >= 0:
                kids = [(only, 0.0)]
        if not kids:
            ok = allowed(row, toks)
            if ok.any():
                sel_t, sel_l = toks[ok], lps[ok]
                if forced:
                    sel_l = sel_l - _logsumexp(sel_l)
                kids = list(zip(sel_t.tolist(), sel_l.tolist()))
        if chain:
            kids = kids[:1]  # candidates come best first
        base = score_of[node]
        for tok, lp in kids:
            heapq.heappush(heap, (-(base + lp), counter, node, tok))
            counter += 1

    rows.append(fill())
    expand(0, rows[0])
    while heap and len(paths) - 1 < budget:
        neg, _, parent, tok = heapq.heappop(heap)
        path = paths[parent] + (tok,)
        c = 0
        while c < len(cur) and c < len(path) - 1 and cur[c] == path[c]:
            c += 1
        matcher.rollback(len(cur) - c)
        del cur[c:]
        for t in path[c:]:
            if not matcher.accept(t):
                raise RuntimeError(f"grammar refused token {t} its own mask allowed")
            cur.append(t)
        if matcher.terminated:  # a stop token: the request ends here, nothing to mask after it
            row = np.full(words.shape[1], -1, dtype=np.int32)
        else:
            row = fill()
            if not row.any():  # a dead end: never a node
                continue
        node = len(paths)
        paths.append(path)
        parent_of.append(parent)
        depth_of.append(len(path))
        score_of.append(-neg)
        rows.append(row)
        best_child.setdefault(parent, node)
        expand(node, row)
    matcher.rollback(len(cur))

    # output order: root, then by depth, selection order within a depth (a stable sort)
    sel = len(paths)
    order = sorted(range(sel), key=lambda i: (depth_of[i], i))
    pos = {old: new for new, old in enumerate(order)}
    tokens = np.zeros(n, dtype=np.int64)
    parents = np.full(n, -1, dtype=np.int64)
    for new, old in enumerate(order):
        tokens[new] = root if old == 0 else paths[old][-1]
        parents[new] = -1 if old == 0 else pos[parent_of[old]]
        words[new] = rows[old]
    chain_scores, node = [], best_child.get(0)
    while node is not None:
        chain_scores.append(score_of[node])
        node = best_child.get(node)
    return GrammarTree(tokens, parents, sel, score_of[1:], chain_scores)
