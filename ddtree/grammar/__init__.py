"""Grammars for structured outputs and tool calls: specs, compiled grammars and matchers
(`backend.py`, xgrammar), the draft tree under a grammar (`tree.py`), bitmasks on the device
(`masks.py`). Host-side math beside `speculative/`: imports nothing of the engine."""

from ddtree.grammar.backend import (
    GrammarError,
    Grammars,
    GrammarSpec,
    GrammarUnavailable,
    Matcher,
)

__all__ = ["GrammarError", "GrammarSpec", "GrammarUnavailable", "Grammars", "Matcher"]
