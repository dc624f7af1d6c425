"""Tooling above the serving engine: `inflate` (function-preserving widening of a small pair to a
production shape), `train` (the DFlash drafter recipe and small targets) and `studies` (at-scale
orchestration, the paper's-code comparison, op counts, the prefix-cache A/B). Nothing below
`ddtree.bench` / the CLI imports this package; `pip install 'ddtree[tools]'` adds what its
plots need."""
