"""The engine's pools: paged KV and its block tables (`kv_cache.py`, `block_manager.py`), the prefix
cache, and the hybrid targets' recurrent-state pool, its views and checkpoints."""
