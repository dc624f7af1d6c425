"""How a `--dp-size` server picks a replica for a request (`--load-balance-method`, SGLang's names):

- `round_robin`: replicas in turn (the live ones).
- `shortest_queue`: the fewest requests in flight (dispatched, not finished), ties in turn. The
  dispatcher counts them itself, so a burst of arrivals is spread at once, without waiting for a
  replica to report its queue.
- `cache_aware` (sgl-router's policy, on token pages): the replica whose prefix cache is believed
  to hold the longest prefix of the prompt (`PrefixIndex`), when that covers at least
  CACHE_THRESHOLD of it; otherwise the shortest queue, of equal queues the replica with the least
  cached (new prefixes spread the cache, as the router's smallest tree does); and whenever the
  load is out of balance (the busiest replica has more than BALANCE_ABS more requests in flight
  than the idlest, and BALANCE_REL times as many) the shortest queue, whatever the cache.
  Finished requests mark their prompt and output, which the replica caches (a conversation's
  next turn then finds its history).

A policy sees only live replicas (`loads`: replica -> requests in flight); the dispatcher drops a
dead one from the picture (`forget`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ddtree.server.dp.prefix_index import PrefixIndex

CACHE_THRESHOLD = 0.3  # sgl-router's --cache-threshold default
BALANCE_ABS = 16  # in flight; sgl-router's 64 is for a fleet, a replica batches ~48
BALANCE_REL = 1.5  # sgl-router's --balance-rel-threshold default


class Policy(Protocol):
    wants_outputs: bool  # on_finish needs the output tokens (the dispatcher keeps them only then)

    def pick(self, ids: Sequence[int], loads: dict[int, int]) -> int: ...

    def on_finish(self, replica: int, ids: Sequence[int]) -> None: ...

    def set_capacity(self, replica: int, pages: int) -> None: ...

    def forget(self, replica: int) -> None: ...


class RoundRobin:
    wants_outputs = False

    def __init__(self, n: int):
        self.n, self.next = n, 0

    def _after(self, candidates) -> int:
        """The first of `candidates` at or after the cursor, cyclically; the cursor moves past it."""
        order = sorted(candidates, key=lambda r: (r - self.next) % self.n)
        self.next = (order[0] + 1) % self.n
        return order[0]

    def pick(self, ids: Sequence[int], loads: dict[int, int]) -> int:
        return self._after(loads)

    def on_finish(self, replica: int, ids: Sequence[int]) -> None:
        pass

    def set_capacity(self, replica: int, pages: int) -> None:
        pass

    def forget(self, replica: int) -> None:
        pass


class ShortestQueue(RoundRobin):
    def pick(self, ids: Sequence[int], loads: dict[int, int]) -> int:
        low = min(loads.values())
        return self._after(r for r, n in loads.items() if n == low)


class CacheAware(ShortestQueue):
    wants_outputs = True

    def __init__(self, n: int, page_size: int):
        super().__init__(n)
        self.index = PrefixIndex(page_size)
        self.hit_tokens = 0  # tokens of the picked replica's believed match, summed (metrics)

    def pick(self, ids: Sequence[int], loads: dict[int, int]) -> int:
        r = self._choose(ids, loads)
        self.index.insert(r, ids)
        return r

    def _choose(self, ids: Sequence[int], loads: dict[int, int]) -> int:
        high, low = max(loads.values()), min(loads.values())
        if high - low > BALANCE_ABS and high > BALANCE_REL * low:
            return super().pick(ids, loads)
        matched = {r: n for r, n in self.index.match(ids).items() if r in loads}
        if matched:
            best = max(matched.values())
            if best >= CACHE_THRESHOLD * len(ids):
                self.hit_tokens += best
                return super().pick(ids, {r: loads[r] for r, n in matched.items() if n == best})
        low, pages = min(loads.values()), self.index.pages
        idle = [r for r, n in loads.items() if n == low]
        least = min(pages.get(r, 0) for r in idle)
        return super().pick(ids, {r: low for r in idle if pages.get(r, 0) == least})

    def on_finish(self, replica: int, ids: Sequence[int]) -> None:
        self.index.insert(replica, ids)

    def set_capacity(self, replica: int, pages: int) -> None:
        self.index.capacity[replica] = pages

    def forget(self, replica: int) -> None:
        self.index.forget(replica)


def make_policy(method: str, n: int, page_size: int) -> Policy:
    if method == "round_robin":
        return RoundRobin(n)
    if method == "shortest_queue":
        return ShortestQueue(n)
    if method == "cache_aware":
        return CacheAware(n, page_size)
    raise ValueError(f"unknown --load-balance-method {method!r}")
