"""`ddtree bench <acceptance | rounds | serving>`."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "acceptance": "ddtree.bench.acceptance",
    "rounds": "ddtree.bench.rounds",
    "serving": "ddtree.bench.serving",
    "at-scale": "ddtree.bench.at_scale",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: ddtree bench <{' | '.join(BENCHES)}> [flags]", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0)
