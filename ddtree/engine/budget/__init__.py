"""Tree budgets: the per-round plan (`planner.py`), the load-aware policy of
`--speculative-ddtree-budget auto` (`policy.py`), its round costs (`cost.py`, `profile.py`,
`rows.py`), the gain-curve shape (`shape.py`) and its trace."""
