"""The dispatcher's approximate picture of each replica's prefix cache (SGLang's cache-aware router
keeps one of the request texts; this one keeps token pages, the unit a replica's radix cache
matches): a trie of full pages of token ids, each node marked with the replicas sent a request
through it and when (a tick). A replica's marks are prefix-closed (a path is marked whole) and
bounded by its KV pool: past it the least recently sent pages are unmarked, as the replica's own
LRU eviction would drop them. Approximate by design: the replica may have evicted sooner (other
requests' pages), or kept a prefix it was sent as a prompt that then failed; a wrong guess costs a
prefill, never a wrong token.
"""

from __future__ import annotations

from collections.abc import Sequence

EVICT_TO = 0.9  # after an eviction a replica's marked pages are this share of its capacity


class _Node:
    __slots__ = ("children", "parent", "key", "owners", "depth")

    def __init__(self, parent: _Node | None, key: tuple, depth: int):
        self.children: dict[tuple, _Node] = {}
        self.parent, self.key, self.depth = parent, key, depth
        self.owners: dict[int, int] = {}  # replica -> tick of the latest request through here


class PrefixIndex:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = _Node(None, (), 0)
        self.pages: dict[int, int] = {}  # replica -> pages marked
        self.capacity: dict[int, int] = {}  # replica -> pages its KV pool holds
        self.tick = 0

    def _keys(self, ids: Sequence[int]):
        p = self.page_size
        for start in range(0, len(ids) - p + 1, p):
            yield tuple(ids[start : start + p])

    def match(self, ids: Sequence[int]) -> dict[int, int]:
        """Tokens of `ids` each replica is believed to hold cached (whole pages from the start)."""
        best: dict[int, int] = {}
        node = self.root
        for key in self._keys(ids):
            node = node.children.get(key)
            if node is None:
                break
            for r in node.owners:
                best[r] = node.depth * self.page_size
        return best

    def insert(self, replica: int, ids: Sequence[int]) -> None:
        """`ids` went to `replica`: mark its full pages there, then keep within its capacity."""
        self.tick += 1
        node, added = self.root, 0
        for key in self._keys(ids):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(node, key, node.depth + 1)
            if replica not in child.owners:
                added += 1
            child.owners[replica] = self.tick
            node = child
        self.pages[replica] = self.pages.get(replica, 0) + added
        cap = self.capacity.get(replica)
        if cap is not None and self.pages[replica] > cap:
            self._evict(replica, int(cap * EVICT_TO))

    def forget(self, replica: int) -> None:
        """The replica is gone (its cache with it)."""
        self._evict(replica, 0)
        self.capacity.pop(replica, None)

    def _evict(self, replica: int, keep: int) -> None:
        """Unmark the replica's least recently sent pages until `keep` remain. Ticks never grow
        down a path (every insert through a node also passes its parent), so oldest-first with
        deeper first on ties removes leaves before their parents: the marks stay prefix-closed."""
        mine, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if replica in node.owners:
                mine.append(node)
                stack.extend(node.children.values())
        mine.sort(key=lambda n: (n.owners[replica], -n.depth))
        excess = len(mine) - keep
        for node in mine[: max(excess, 0)]:
            del node.owners[replica]
            if not node.owners:  # no replica below it either (prefix-closed marks)
                del node.parent.children[node.key]
        self.pages[replica] = min(len(mine), keep)
