"""Prefix cache: a radix tree over full KV pages, with reference counts and LRU eviction.

Why a radix tree and not vLLM's hash chain: both find the longest cached run of full pages, but the
tree also answers "which cached page starts like my next, partial page?" (the children of the last
matched node), which is what copy-on-write at the last shared page needs; evicting only unreferenced
leaves keeps every cached prefix reachable from the root without a second index. SGLang's RadixCache
compresses runs of pages into one edge; here one node is one page (`key` = its `page_size` tokens),
so a node never splits and the page list of a match is the node path.

Invariants (checked by `BlockManager.check_integrity`):
- a node's page holds the KV (target and drafter context: the same slots) of tokens
  [(depth - 1) * page_size, depth * page_size) of every sequence whose tokens spell the path to it;
  it is written once, by the request that inserted it, before insertion, and never again;
- `lock` of a node = running requests whose cached prefix ends at it or below it (SGLang's
  lock_ref), so a node with lock 0 has an unlocked subtree and leaves-first eviction can free it;
- `checkpoint` (hybrid targets) = a recurrent-state row holding the state after exactly the node's
  tokens, or None.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class Node:
    __slots__ = ("key", "page", "parent", "children", "lock", "last_used", "checkpoint", "depth")

    def __init__(self, key: tuple[int, ...], page: int, parent: Node | None):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.lock = 0
        self.last_used = 0
        self.checkpoint: int | None = None
        self.depth = parent.depth + 1 if parent is not None else 0

    def path(self) -> list[Node]:
        """Nodes from the root's child down to this one (empty for the root)."""
        out, n = [], self
        while n.parent is not None:
            out.append(n)
            n = n.parent
        return out[::-1]


@dataclass
class PrefixMatch:
    """The cached part of a token sequence: `nodes` (full shared pages, root's child first) and, for
    copy-on-write, `cow` = (node, n): a cached page whose first n tokens continue the match."""

    nodes: list[Node] = field(default_factory=list)
    cow: tuple[Node, int] | None = None

    def length(self, page_size: int) -> int:
        return len(self.nodes) * page_size + (self.cow[1] if self.cow else 0)


@dataclass
class CacheStats:
    queried_tokens: int = 0  # prefill tokens looked up at admission
    hit_tokens: int = 0  # of which were cached
    evicted_pages: int = 0
    # hybrid targets: tokens past a hit whose KV pages were cached but whose recurrent state was
    # not (no checkpoint at their end: none kept, or dropped for a newer one), so they were
    # recomputed; with `checkpoint_drops` this says why a hybrid hit rate is low
    state_miss_tokens: int = 0
    checkpoint_drops: int = 0  # checkpoints taken from their node for a newer one (LRU)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class RadixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = Node((), -1, None)
        self.page_owner: dict[int, Node] = {}  # cached page -> its node
        self.num_evictable = 0  # nodes with lock 0
        self.stats = CacheStats()
        self._tick = itertools.count(1)
        # lazy LRU of evictable leaves: (last_used, seq, node); stale entries are skipped on pop
        self._heap: list[tuple[int, int, Node]] = []
        self._seq = itertools.count()
        self.checkpoints: dict[int, Node] = {}  # checkpoint row -> node

    @property
    def num_pages(self) -> int:
        return len(self.page_owner)

    def _key(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        p = self.page_size
        return tuple(tokens[i * p : (i + 1) * p])

    # ---- lookup ----------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of `tokens` (read-only: nothing is locked or touched)."""
        node, nodes, p = self.root, [], self.page_size
        for i in range(len(tokens) // p):
            child = node.children.get(self._key(tokens, i))
            if child is None:
                break
            nodes.append(child)
            node = child
        rest = tokens[len(nodes) * p : (len(nodes) + 1) * p]
        best, best_n = None, 0
        for key, child in node.children.items():  # a page that starts like the rest: copy-on-write
            n = 0
            while n < len(rest) and key[n] == rest[n]:
                n += 1
            if n > best_n:
                best, best_n = child, n
        return PrefixMatch(nodes, (best, best_n) if best is not None else None)

    def touch(self, node: Node) -> None:
        t = next(self._tick)
        while node.parent is not None:
            node.last_used = t
            node = node.parent

    # ---- reference counts ------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        self.touch(node)
        while node.parent is not None:
            if node.lock == 0:
                self.num_evictable -= 1
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        leaf = node
        while node.parent is not None:
            assert node.lock > 0, "unlock of an unlocked prefix"
            node.lock -= 1
            if node.lock == 0:
                self.num_evictable += 1
            node = node.parent
        self.touch(leaf)
        self._push_if_leaf(leaf)

    def unlocked_among(self, nodes: Sequence[Node]) -> int:
        return sum(1 for n in nodes if n.lock == 0)

    # ---- insertion and eviction ------------------------------------------------------------------
    def insert_run(
        self, parent: Node, keys: Sequence[tuple[int, ...]], pages: Sequence[int]
    ) -> Node:
        """A path of new pages below `parent`, `keys[i]` on `pages[i]` (the caller checked
        `keys[0]` is not cached under `parent`); unlocked; returns the deepest. Only the run's
        last node (its one leaf) enters the LRU heap: the nodes above it have a child, so their
        heap entries would only go stale."""
        assert keys and len(keys) == len(pages) and keys[0] not in parent.children
        assert len(keys[-1]) == self.page_size
        tick, owner = self._tick, self.page_owner
        for key, page in zip(keys, pages):
            node = Node(key, page, parent)
            node.last_used = next(tick)
            parent.children[key] = node
            owner[page] = node
            parent = node
        self.num_evictable += len(keys)
        self._push_if_leaf(parent)
        return parent

    def _push_if_leaf(self, node: Node) -> None:
        if node.parent is not None and node.lock == 0 and not node.children:
            heapq.heappush(self._heap, (node.last_used, next(self._seq), node))
            if len(self._heap) > 2 * len(self.page_owner) + 64:  # mostly stale: rebuild
                self._heap = [
                    (n.last_used, next(self._seq), n)
                    for n in self.page_owner.values()
                    if n.lock == 0 and not n.children
                ]
                heapq.heapify(self._heap)

    def _live(self, entry: tuple[int, int, Node]) -> bool:
        """A heap entry still names an evictable leaf as of its push (stale is for good: ticks
        only grow, and an evicted node is never re-inserted)."""
        used, _, node = entry
        return (
            self.page_owner.get(node.page) is node
            and not node.lock
            and not node.children
            and used == node.last_used
        )

    def _next_live_used(self) -> float:
        """`last_used` of the next live heap entry (stale ones on top are dropped on the way, as
        `evict` would skip them); inf for none."""
        heap = self._heap
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else float("inf")

    def evict(self, num_pages: int, drop_checkpoint: Callable[[int], None]) -> list[int]:
        """Free up to `num_pages` unlocked pages, least recently used leaves first.

        The order is the one a push of every parent left a leaf, then a pop, would give; but a
        parent older than every live heap entry is evicted at once (no push, no pop): a cached
        prompt is a chain of pages touched together, so a chain costs O(1) heap operations, not
        O(pages). Live leaves never tie on `last_used` (a tick touches one path), so the order
        is exact."""
        freed: list[int] = []
        heap, owner, ckpts = self._heap, self.page_owner, self.checkpoints
        while len(freed) < num_pages and heap:
            entry = heapq.heappop(heap)
            if not self._live(entry):
                continue  # stale entry: re-used, re-locked or already evicted since it was pushed
            node = entry[2]
            bound = self._next_live_used()  # the heap is not touched during the walk below
            while True:
                parent = node.parent
                del parent.children[node.key]
                del owner[node.page]
                if node.checkpoint is not None:
                    row, node.checkpoint = node.checkpoint, None
                    del ckpts[row]
                    drop_checkpoint(row)
                freed.append(node.page)
                if parent.parent is None or parent.lock or parent.children:
                    break  # not a leaf now (or the root)
                if parent.last_used < bound and len(freed) < num_pages:
                    node = parent  # the next LRU leaf: evict it without a heap round trip
                    continue
                self._push_if_leaf(parent)
                break
        self.num_evictable -= len(freed)
        self.stats.evicted_pages += len(freed)
        return freed

    # ---- hybrid checkpoints ----------------------------------------------------------------------
    def set_checkpoint(self, node: Node, row: int) -> None:
        node.checkpoint = row
        self.checkpoints[row] = node

    def take_lru_checkpoint(self) -> int | None:
        """Detach the least recently used checkpoint from its node and return its row."""
        if not self.checkpoints:
            return None
        row = min(self.checkpoints, key=lambda r: self.checkpoints[r].last_used)
        self.checkpoints.pop(row).checkpoint = None
        self.stats.checkpoint_drops += 1
        return row

    def nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
