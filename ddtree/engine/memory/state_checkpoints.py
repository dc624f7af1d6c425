"""Recurrent-state checkpoints of hybrid targets for the prefix cache.

A checkpoint row holds one request's committed GDN state (conv window + SSM state of every GDN
layer) after exactly a cached node's tokens. It is taken from the request's committed rows in the
state pool when a prefill chunk ends on a page boundary (`HybridStatePool.conv` / `.ssm` are the
same under extra_buffer and no_buffer: both strategies stash per-node data beside them, never in
them; a one-node round steps them in place at its verify, but checkpoints are taken and restored
only between rounds, where the rows hold exactly the committed tokens either way), and restored into
a new request's row when its prefix hit ends at that node. Rows are preallocated
(`--mamba-full-memory-ratio` sizes them with the state pool, at least one per running request:
`plan_pools`); when all are taken the least recently used checkpoint is dropped (its pages stay
cached; hits there are truncated to an earlier checkpoint, `CacheStats.state_miss_tokens`).
"""

from __future__ import annotations

from collections import deque

import torch

from ddtree.engine.memory.state_pool import HybridStatePool


class StateCheckpoints:
    def __init__(self, pool: HybridStatePool, num_rows: int):
        self.pool = pool
        L = pool.conv.shape[0]
        self.conv = torch.zeros(
            (L, num_rows, *pool.conv.shape[2:]), dtype=pool.conv.dtype, device=pool.device
        )
        self.ssm = torch.zeros(
            (L, num_rows, *pool.ssm.shape[2:]), dtype=pool.ssm.dtype, device=pool.device
        )
        self.free_rows: deque[int] = deque(range(num_rows))
        self.num_rows = num_rows

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))

    def save(self, slot: int, row: int) -> None:
        """The committed state of request slot `slot` -> checkpoint `row`."""
        self.conv[:, row] = self.pool.conv[:, slot]
        self.ssm[:, row] = self.pool.ssm[:, slot]

    def restore(self, row: int, slot: int) -> None:
        self.pool.conv[:, slot] = self.conv[:, row]
        self.pool.ssm[:, slot] = self.ssm[:, row]

    def keep(self, cache, node, slot: int) -> None:
        """Checkpoint request `slot`'s committed state at cache `node` (its tokens are exactly the
        request's cached ones), in a free row or else the least recently used checkpoint's."""
        if node.checkpoint is not None:
            return
        row = self.free_rows.popleft() if self.free_rows else cache.take_lru_checkpoint()
        if row is not None:
            self.save(slot, row)
            cache.set_checkpoint(node, row)

    def give_back(self, row: int) -> None:
        self.free_rows.append(row)

    def check_integrity(self, cache) -> None:
        """Every row is either free or held by exactly one cached node whose `checkpoint` names it
        (the radix cache's `checkpoints` index); a held row's node is still cached. Host only:
        O(rows + cached nodes)."""
        free, held = list(self.free_rows), cache.checkpoints
        assert len(free) == len(set(free)), "a checkpoint row is free twice"
        assert all(0 <= r < self.num_rows for r in free + list(held)), (
            "a checkpoint row out of range"
        )
        assert not set(free) & held.keys(), "a checkpoint row is both free and held"
        assert len(free) + len(held) == self.num_rows, "checkpoint rows leaked"
        for row, node in held.items():
            assert node.checkpoint == row, "a checkpoint row's node names another row"
            assert cache.page_owner.get(node.page) is node, "a checkpoint held by an evicted node"
        marked = sum(1 for n in cache.nodes() if n.checkpoint is not None)
        assert marked == len(held), "a cached node's checkpoint is missing from the index"
