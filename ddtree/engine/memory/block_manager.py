"""Paged KV bookkeeping: pages of `page_size` token slots, one block-table row per running request.

Slot of logical position p of request r = block_table[r.slot, p // page_size] * page_size + p % page_size.
The target KV pool and the drafter context pool are indexed by the same slots.

With a prefix cache (`ddtree/engine/memory/prefix_cache.py`) a request's pages are `shared` cached pages
(the node path of `node[slot]`, read-only) followed by private ones. Every KV write of a request
lands at logical positions >= its kv_len (prefill extends, tree verify, the commit move), and
`shared * page_size <= kv_len` always holds, so no write can reach a shared page; `check_writes`
asserts it for a batch of slots. A page is in exactly one of: the free list, a request's private
pages, the cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ddtree.engine.faults import PoolCorrupted
from ddtree.engine.memory.prefix_cache import CacheStats, Node, PrefixMatch, RadixCache
from ddtree.engine.scheduling.request import Req

# copy_page(src_page, dst_page, num_tokens): the first num_tokens slots of src into dst (all pools)
CopyPage = Callable[[int, int, int], None]


@dataclass
class PrefixHit:
    """What admission found in the cache for a request: `length` tokens whose KV it reuses."""

    length: int = 0
    nodes: tuple[Node, ...] = ()  # full shared pages
    cow: tuple[Node, int] | None = None  # a cached page whose first n tokens are copied
    state_miss: int = 0  # hybrid: cached tokens past `length` with no state checkpoint to reuse


NO_HIT = PrefixHit()


class BlockManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_reqs: int,
        max_pages_per_req: int,
        device,
        prefix_cache: bool = False,
    ):
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_pages_per_req = max_pages_per_req
        self.free_pages: deque[int] = deque(range(num_pages))
        self.free_slots: deque[int] = deque(range(max_reqs))
        self.pages: dict[int, list[int]] = {}
        self.shared: dict[int, int] = {}  # slot -> leading pages owned by the cache
        self.node: dict[int, Node] = {}  # slot -> the deepest cached node the request locks
        self.block_table = torch.zeros(
            max_reqs, max_pages_per_req, dtype=torch.int64, device=device
        )
        self.cache = RadixCache(page_size) if prefix_cache else None
        # called with a checkpoint row when its node is evicted (set by the runner, hybrid only)
        self.drop_checkpoint: Callable[[int], None] = lambda row: None

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_cached_pages(self) -> int:
        return self.cache.num_pages if self.cache is not None else 0

    @property
    def num_available_pages(self) -> int:
        """Free pages plus cached pages no running request uses (evicted on demand)."""
        return len(self.free_pages) + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def extra_pages(self, req: Req, num_tokens: int) -> int:
        have = len(self.pages.get(req.slot, ())) if req.slot >= 0 else 0
        return max(0, self.pages_for(num_tokens) - have)

    # ---- prefix cache ----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_len: int, checkpointed: bool = False) -> PrefixHit:
        """The cached prefix of `tokens` a new request may reuse: at most `max_len` tokens (the
        last prompt token is always recomputed: its logits give the first output token), at least
        one full page (then a copy-on-write page may continue it). With
        `checkpointed` (hybrid targets) only a page-aligned length whose node has a recurrent-state
        checkpoint counts, and nothing is copied."""
        if self.cache is None or max_len <= 0:
            return NO_HIT
        m: PrefixMatch = self.cache.match(tokens[:max_len])
        p = self.page_size
        if checkpointed:
            nodes = list(m.nodes)
            while nodes and nodes[-1].checkpoint is None:
                nodes.pop()
            miss = (len(m.nodes) - len(nodes)) * p
            return PrefixHit(len(nodes) * p, tuple(nodes), state_miss=miss)
        if not m.nodes:
            # a copy-on-write page alone is no shared prefix: a few tokens that start like some
            # cached page (a common first word, a template's opening tokens) would save < one page
            # of prefill for a page copy, and shift every chunk of a request that shares nothing
            # (its passes, its extend graphs) away from the cache-off server's
            return NO_HIT
        return PrefixHit(m.length(p), tuple(m.nodes), m.cow)

    def can_admit(self, req: Req, num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Room for positions [0, num_tokens) of a waiting request that reuses `hit`."""
        if self.pages_for(num_tokens) > self.max_pages_per_req or not self.free_slots:
            return False
        need = self.pages_for(num_tokens) - len(hit.nodes)
        # the hit's unlocked pages stop being evictable once it is locked
        taken = self.cache.unlocked_among(hit.nodes) if self.cache is not None else 0
        room = self.num_available_pages - taken
        if hit.cow is not None and hit.cow[0].lock == 0:
            # the copied page is locked only while its copy's page is taken (then evictable
            # again): that one page must come from elsewhere. Counting it as taken for the whole
            # prompt refused a prompt that needs the whole pool whenever a cached page started
            # like its next one (and `_starved` finished it with no tokens).
            return need <= room and room - 1 >= 1
        return need <= room

    def attach(self, req: Req, hit: PrefixHit, copy_page: CopyPage) -> None:
        """Give a waiting request a slot whose block-table row starts with the hit's pages (locked);
        a copy-on-write page is copied from the cached one into a private page."""
        assert req.slot < 0
        req.slot = self.free_slots.popleft()
        pages = [n.page for n in hit.nodes]
        self.pages[req.slot], self.shared[req.slot] = pages, len(pages)
        self.node[req.slot] = hit.nodes[-1] if hit.nodes else None
        if hit.nodes:
            self.cache.lock(hit.nodes[-1])
            self.block_table[req.slot, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
        if hit.cow is not None:
            src, n = hit.cow
            self.cache.lock(src)  # not evicted by the allocation below
            self._grow(req.slot, 1)
            copy_page(src.page, pages[-1], n)
            self.cache.unlock(src)

    def cache_prefix(self, req: Req, tokens: Sequence[int], num_tokens: int) -> Node | None:
        """Insert the request's full pages below `num_tokens` (cached tokens, `tokens` their ids)
        into the cache; a page already cached under the same prefix replaces the request's copy
        (same tokens, same positions: the same KV). Returns the deepest cached node."""
        if self.cache is None or req.slot < 0:
            return None
        assert len(tokens) >= num_tokens, (
            f"{req.rid}: {num_tokens} cached tokens, {len(tokens)} ids"
        )
        slot, p = req.slot, self.page_size
        pages, done, node = self.pages[slot], self.shared[slot], self.node[slot]
        full = min(num_tokens // p, len(pages))
        if full <= done:
            return node
        parent, i = node or self.cache.root, done
        # pages another request cached under the same prefix since: take theirs, free ours
        while i < full:
            child = parent.children.get(tuple(tokens[i * p : (i + 1) * p]))
            if child is None:
                break
            self.free_pages.append(pages[i])
            pages[i] = child.page
            parent, i = child, i + 1
        if i > done:  # one block-table write for the run (no per-page tensor op)
            self.block_table[slot, done:i] = torch.tensor(pages[done:i], dtype=torch.int64)
        if i < full:  # below a miss every page is new: one run
            keys = [tuple(tokens[j * p : (j + 1) * p]) for j in range(i, full)]
            parent = self.cache.insert_run(parent, keys, pages[i:full])
        self.cache.lock(parent)
        if node is not None:
            self.cache.unlock(node)
        self.node[slot], self.shared[slot] = parent, full
        return parent

    def clear_cache(self) -> None:
        """Evict every unreferenced cached page and zero the cache's counters (after the warm-up,
        whose synthetic prompts are no one's prefix)."""
        if self.cache is not None:
            self._reclaim(self.cache.num_pages)
            self.cache.stats = CacheStats()

    def _evict_for(self, n: int) -> None:
        short = n - len(self.free_pages)
        if short > 0 and self.cache is not None:
            self._reclaim(short)

    def _reclaim(self, n: int) -> None:
        """Up to n unreferenced cached pages evicted onto the free list, ascending, as a fresh
        free list hands them out: eviction walks a cached chain from its leaf up, which would
        give the next request its pages in reverse order."""
        self.free_pages.extend(sorted(self.cache.evict(n, self.drop_checkpoint)))

    # ---- allocation ------------------------------------------------------------------------------
    def can_allocate(self, req: Req, num_tokens: int) -> bool:
        """Room for logical positions [0, num_tokens) of `req` (a request slot too, if it has none)."""
        if self.pages_for(num_tokens) > self.max_pages_per_req:
            return False
        if req.slot < 0 and not self.free_slots:
            return False
        return self.extra_pages(req, num_tokens) <= self.num_available_pages

    def allocate(self, req: Req, num_tokens: int) -> None:
        if not self.can_allocate(req, num_tokens):
            raise RuntimeError(f"out of KV pages for {req.rid} ({num_tokens} tokens)")
        if req.slot < 0:
            req.slot = self.free_slots.popleft()
            self.pages[req.slot], self.shared[req.slot], self.node[req.slot] = [], 0, None
        self._grow(req.slot, self.extra_pages(req, num_tokens))

    def _grow(self, slot: int, n: int) -> None:
        if n <= 0:
            return
        self._evict_for(n)
        owned = self.pages[slot]
        new = [self.free_pages.popleft() for _ in range(n)]
        self.block_table[slot, len(owned) : len(owned) + n] = torch.tensor(new, dtype=torch.int64)
        owned.extend(new)

    def trim(self, req: Req, num_tokens: int) -> None:
        """Free the pages past logical length `num_tokens` (rejected tree slots)."""
        owned = self.pages[req.slot]
        keep = self.pages_for(num_tokens)
        assert keep >= self.shared[req.slot], "trim into the shared prefix"
        while len(owned) > keep:
            self.free_pages.append(owned.pop())

    def free(self, req: Req, tokens: Sequence[int] | None = None, num_tokens: int = 0) -> None:
        """Release the request's pages; with the cache on, its full pages below `num_tokens` cached
        tokens (ids `tokens`) stay cached, unreferenced, for later requests."""
        if req.slot < 0:
            return
        slot = req.slot
        try:
            if self.cache is not None and tokens is not None:
                self.cache_prefix(req, tokens, num_tokens)
        finally:  # a failed insertion still frees the slot and the private pages
            node, shared = self.node.pop(slot), self.shared.pop(slot)
            if node is not None:
                self.cache.unlock(node)
            self.free_pages.extend(self.pages.pop(slot)[shared:])
            self.free_slots.append(slot)
            req.slot = -1

    # ---- checks ----------------------------------------------------------------------------------
    def check_writes(self, slots: torch.Tensor) -> None:
        """Debug: no slot of this write batch lies in a cached (shared) page (a host read)."""
        if self.cache is None or not self.cache.page_owner:
            return
        pages = set((slots.flatten() // self.page_size).unique().tolist())
        bad = pages & self.cache.page_owner.keys()
        if bad:
            raise PoolCorrupted(f"a KV write reaches shared cached pages {sorted(bad)[:8]}")

    def check_slots(self, running: Sequence[Req]) -> None:
        """Every request slot is free or held by exactly one running request (cheap: O(slots))."""
        held = [r.slot for r in running if r.slot >= 0]
        every = held + list(self.free_slots)
        assert len(every) == len(set(every)), "a request slot is owned twice"
        assert len(every) == self.block_table.shape[0], "request slots leaked"
        assert set(held) == self.pages.keys(), "pages held by a slot no running request has"

    def check_integrity(self) -> None:
        private = [p for s, ps in self.pages.items() for p in ps[self.shared[s] :]]
        cached = list(self.cache.page_owner) if self.cache is not None else []
        every = private + cached + list(self.free_pages)
        assert len(every) == len(set(every)), "a page is owned twice"
        assert len(every) == self.num_pages, "pages leaked"
        if self.cache is None:
            return
        locks: dict[int, int] = {}
        for s, ps in self.pages.items():
            node = self.node[s]
            path = node.path() if node is not None else []
            assert ps[: self.shared[s]] == [n.page for n in path], "shared pages != cached path"
            for n in path:
                locks[id(n)] = locks.get(id(n), 0) + 1
        nodes = self.cache.nodes()
        assert len(nodes) == len(cached), "cache index out of step with its tree"
        for n in nodes:
            assert self.cache.page_owner[n.page] is n
            assert n.lock == locks.get(id(n), 0), "a cached page's ref count is wrong"
        assert self.cache.num_evictable == sum(1 for n in nodes if n.lock == 0)
