"""Eviction: which leaf goes first (a policy) and when to stop (a stopping rule).

Policies order unlocked leaves; the store evicts them one at a time. The stopping rule decides
when enough is free:

- ``unified``: stop as soon as the arena can place the whole joint demand, counting every byte
  the evictions reclaimed (KV, SWA and state alike, compaction included).
- ``per_kind``: the baseline. While evicting it counts only blocks *of the kinds being
  allocated*: it stops once, for each kind, what was allocatable before plus the blocks of that
  kind freed since covers the demand. Bytes freed from other kinds are ignored, so it evicts more.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from typing import Literal, Protocol

from tierstore.radix import Node, RadixIndex

StopRule = Literal["unified", "per_kind"]
PolicyName = Literal["lru", "lfu", "priority"]


class EvictionPolicy(Protocol):
    """Orders eviction candidates: the smallest key is evicted first."""

    name: str

    def key(self, node: Node) -> tuple[float, ...]: ...


class LRU:
    """Least recently used first."""

    name = "lru"

    def key(self, node: Node) -> tuple[float, ...]:
        return (node.last_use, node.serial)


class LFU:
    """Fewest hits first; least recently used among equals."""

    name = "lfu"

    def key(self, node: Node) -> tuple[float, ...]:
        return (node.hits, node.last_use, node.serial)


class Priority:
    """Lowest request priority first (the priority of the last request that used the node);
    least recently used among equals."""

    name = "priority"

    def key(self, node: Node) -> tuple[float, ...]:
        return (node.priority, node.last_use, node.serial)


POLICIES: dict[str, type[LRU] | type[LFU] | type[Priority]] = {
    "lru": LRU, "lfu": LFU, "priority": Priority,
}


def make_policy(name: PolicyName) -> EvictionPolicy:
    """The policy object for ``name``."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction policy must be one of {sorted(POLICIES)}, got {name!r}") \
            from None


def victims(
    index: RadixIndex, policy: EvictionPolicy, holds: Callable[[Node], bool]
) -> Iterator[Node]:
    """Nodes to evict from one tier, in policy order: unlocked nodes that hold something in
    the tier (``holds``) while none of their children do — the tier's leaves. A parent joins
    once its last holding child is gone. Each candidate is checked again when its turn comes
    (evictions in between may have changed it); the caller evicts each yielded node before
    asking for the next."""
    def candidate(n: Node) -> bool:
        return (n.lock == 0 and n.parent is not None and holds(n)
                and not any(holds(c) for c in n.children.values()))

    heap = [(policy.key(n), n.serial, n) for n in index.nodes() if candidate(n)]
    heapq.heapify(heap)
    while heap:
        _, _, node = heapq.heappop(heap)
        if not candidate(node):
            continue
        parent = node.parent
        yield node
        if parent is not None and parent is not index.root and candidate(parent):
            heapq.heappush(heap, (policy.key(parent), parent.serial, parent))


class StopCondition:
    """Tracks freed blocks during one eviction round and says when to stop."""

    def __init__(
        self, rule: StopRule, demand: Mapping[str, int], fits: Callable[[], bool],
        available: Callable[[str], int],
    ) -> None:
        if rule not in ("unified", "per_kind"):
            raise ValueError(f"stop rule must be 'unified' or 'per_kind', got {rule!r}")
        self.rule = rule
        self.demand = {k: n for k, n in demand.items() if n > 0}
        self._fits = fits
        self._credit = {k: available(k) for k in self.demand} if rule == "per_kind" else {}

    def freed(self, blocks: Mapping[str, int]) -> None:
        """Record blocks freed by one eviction, per kind."""
        for kind, n in blocks.items():
            if kind in self._credit:
                self._credit[kind] += n

    def satisfied(self) -> bool:
        """Whether eviction may stop now."""
        if self.rule == "per_kind" and any(self._credit[k] < n for k, n in self.demand.items()):
            return False
        return self._fits()
