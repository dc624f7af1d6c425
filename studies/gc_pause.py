"""How long one full garbage collection stops a server process, before and after the start-up
heap is frozen (server/gc_watch.py): builds the server (app and engine, no HTTP) for the given
flags, then times `gc.collect()` a few times, `gc.freeze()`, and again.

    PYTHONPATH=. python3 studies/gc_pause.py --device cpu --speculative-algorithm DDTREE \\
        --speculative-ddtree-budget 16
"""

from __future__ import annotations

import gc
import json
import sys
import time


def full_collections(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        gc.collect()
        out.append(round((time.perf_counter() - t) * 1e3, 2))
    return out


def main(argv=None) -> int:
    from ddtree.config import ServerArgs, make_parser, resolve_server_args
    from ddtree.server.launch import build_app

    ns = make_parser("studies/gc_pause.py").parse_args(sys.argv[1:] if argv is None else argv)
    app, aengine = build_app(resolve_server_args(ServerArgs(**vars(ns))))
    tracked = len(gc.get_objects())
    before = full_collections(3)
    gc.freeze()
    res = {
        "tracked_objects": tracked,
        "full_collection_ms": before,
        "frozen_objects": gc.get_freeze_count(),
        "after_freeze_ms": full_collections(3),
    }
    gc.unfreeze()
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
