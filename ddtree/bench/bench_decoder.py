"""`SpecDecoder` for the round benchmarks (`bench rounds`, studies): the phases timed by the bench's
clock, and the target tokens rewritten before the accept walk (`override`: forced_accept.py), so
random weights accept a chosen number of tokens. The product decoder takes neither."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ddtree.engine.round.decoder import SpecDecoder
from ddtree.speculative.accept import accept_tree
from ddtree.speculative.tree import DraftTree

# (tree, target tokens [b, n]) -> the target tokens the accept walk uses instead
TargetOverride = Callable[[DraftTree, torch.Tensor], torch.Tensor]


class BenchDecoder(SpecDecoder):
    def __init__(self, runner, cfg, times=None, override: TargetOverride | None = None):
        """`times`: a phase timer with PhaseTimes' `start()` / `add(name, t0)` (round_timing.py's
        PhaseMarks; default: the host clock). `override`: with one, every round walks eagerly
        (the verify graph's greedy walk would skip it)."""
        super().__init__(runner, cfg)
        if times is not None:
            self.times = times
        self.override = override

    def _accept(self, rnd, tree, vo, gb):
        if self.override is None:
            return super()._accept(rnd, tree, vo, gb)
        tokens = self._target_tokens(rnd.reqs, rnd.lens, tree, vo, gb)
        return accept_tree(tree, self.override(tree, tokens))
