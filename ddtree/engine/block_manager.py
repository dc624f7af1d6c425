"""Paged KV bookkeeping: pages of `page_size` token slots, one block-table row per running request.

Slot of logical position p of request r = block_table[r.slot, p // page_size] * page_size + p % page_size.
The target KV pool and the drafter context pool are indexed by the same slots.
"""

from __future__ import annotations

from collections import deque

import torch

from ddtree.engine.request import Req


class BlockManager:
    def __init__(
        self, num_pages: int, page_size: int, max_reqs: int, max_pages_per_req: int, device
    ):
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_pages_per_req = max_pages_per_req
        self.free_pages: deque[int] = deque(range(num_pages))
        self.free_slots: deque[int] = deque(range(max_reqs))
        self.pages: dict[int, list[int]] = {}
        self.block_table = torch.zeros(
            max_reqs, max_pages_per_req, dtype=torch.int64, device=device
        )

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def extra_pages(self, req: Req, num_tokens: int) -> int:
        have = len(self.pages.get(req.slot, ())) if req.slot >= 0 else 0
        return max(0, self.pages_for(num_tokens) - have)

    def can_allocate(self, req: Req, num_tokens: int) -> bool:
        """Room for logical positions [0, num_tokens) of `req` (a request slot too, if it has none)."""
        if self.pages_for(num_tokens) > self.max_pages_per_req:
            return False
        if req.slot < 0 and not self.free_slots:
            return False
        return self.extra_pages(req, num_tokens) <= len(self.free_pages)

    def allocate(self, req: Req, num_tokens: int) -> None:
        if not self.can_allocate(req, num_tokens):
            raise RuntimeError(f"out of KV pages for {req.rid} ({num_tokens} tokens)")
        if req.slot < 0:
            req.slot = self.free_slots.popleft()
            self.pages[req.slot] = []
        owned = self.pages[req.slot]
        new = [self.free_pages.popleft() for _ in range(self.extra_pages(req, num_tokens))]
        if new:
            self.block_table[req.slot, len(owned) : len(owned) + len(new)] = torch.tensor(
                new, dtype=torch.int64
            )
            owned.extend(new)

    def trim(self, req: Req, num_tokens: int) -> None:
        """Free the pages past logical length `num_tokens` (rejected tree slots)."""
        owned = self.pages[req.slot]
        keep = self.pages_for(num_tokens)
        while len(owned) > keep:
            self.free_pages.append(owned.pop())

    def free(self, req: Req) -> None:
        if req.slot < 0:
            return
        self.free_pages.extend(self.pages.pop(req.slot))
        self.free_slots.append(req.slot)
        req.slot = -1

    def check_integrity(self) -> None:
        owned = [p for ps in self.pages.values() for p in ps]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert len(owned) + len(self.free_pages) == self.num_pages, "pages leaked"
        assert len(set(self.free_pages)) == len(self.free_pages)
