"""Data parallelism on one host (`--dp-size N`): N engine replicas, each the whole one-engine
server's engine loop in a process of its own (`replica.py`) on its own GPUs
(`memory_plan.placement`; `placement.py` checks them against the visible ones), behind the one
HTTP server. The HTTP process prepares every request (tokenize, template, validate), picks a
replica (`policy.py`: round_robin, shortest_queue, cache_aware over an approximate prefix index,
`prefix_index.py`), and relays its stream (`client.py`, over a multiprocessing pipe,
`messages.py`); `engine.py`'s `DPEngine` is what the routes drive, as they drive `AsyncEngine`
with one engine; `metrics.py` labels every replica's metrics `dp_rank`; `launch.py` starts the
replicas in parallel. `--dp-size 1` never imports this package."""
