"""Eviction: which leaf goes first (a policy), the per-tier queue of candidates in that order,
and when to stop (a stopping rule).

Policies order unlocked leaves; each tier's :class:`EvictionQueue` keeps its candidates in that
order as they change, and the store evicts them one at a time. The stopping rule decides
when enough is free:

- ``unified``: stop as soon as the arena can place the whole joint demand, counting every byte
  the evictions reclaimed (KV, SWA and state alike, compaction included).
- ``per_kind``: the baseline. While evicting it counts only blocks *of the kinds being
  allocated*: it stops once, for each kind, what was allocatable before plus the blocks of that
  kind freed since covers the demand. Bytes freed from other kinds are ignored, so it evicts more.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

if TYPE_CHECKING:
    from typing_extensions import Self

StopRule = Literal["unified", "per_kind"]
PolicyName = Literal["lru", "lfu", "priority"]


class Candidate(Protocol):
    """What eviction reads of an index node (:class:`tierstore.radix.Node` is one): declared
    here, below the index, so that this module imports nothing of it."""

    @property
    def serial(self) -> int: ...
    @property
    def last_use(self) -> float: ...
    @property
    def hits(self) -> int: ...
    @property
    def priority(self) -> float: ...
    @property
    def queued(self) -> list[int]: ...  # the queue's stamp per tier, written by the queue
    @property
    def parent(self) -> Self | None: ...
    def evictable(self, tier: int) -> bool: ...


N = TypeVar("N", bound=Candidate)


class CandidateIndex(Protocol[N]):
    """What :func:`victims` reads of the index (:class:`tierstore.radix.RadixIndex`)."""

    @property
    def root(self) -> object: ...
    @property
    def key(self) -> Callable[[N], tuple[float, ...]]: ...
    @property
    def queues(self) -> Mapping[Any, EvictionQueue[N]]: ...


class EvictionPolicy(Protocol):
    """Orders eviction candidates: the smallest key is evicted first."""

    name: str

    def key(self, node: Candidate) -> tuple[float, ...]: ...


class LRU:
    """Least recently used first."""

    name = "lru"

    def key(self, node: Candidate) -> tuple[float, ...]:
        return (node.last_use, node.serial)


class LFU:
    """Fewest hits first; least recently used among equals."""

    name = "lfu"

    def key(self, node: Candidate) -> tuple[float, ...]:
        return (node.hits, node.last_use, node.serial)


class Priority:
    """Lowest request priority first (the priority of the last request that used the node);
    least recently used among equals."""

    name = "priority"

    def key(self, node: Candidate) -> tuple[float, ...]:
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


class EvictionQueue(Generic[N]):
    """One tier's eviction candidates in policy order (smallest ``key`` first).

    A heap with lazy deletion: each node records the stamp of its live entry in
    ``node.queued[tier - 1]`` (0: not queued); re-keying pushes a new entry and the old one goes
    stale. Stale entries are dropped when they reach the top, and the heap is rebuilt when
    they outnumber live ones, so push, discard and peek are O(log n) amortised.

    An entry is the policy's key spliced flat with ``(serial, stamp, node)``: every key of one
    policy has the same length, so the order is that of ``(key, serial, stamp)``, and a heap
    step compares floats and ints instead of nested tuples."""

    def __init__(self, tier: int, key: Callable[[N], tuple[float, ...]]) -> None:
        self.tier = tier
        self.key = key
        self.size = 0  # live entries
        self._t = tier - 1
        self._heap: list[tuple[Any, ...]] = []  # (*key, serial, stamp, node)
        self._stamps = itertools.count(1)

    def push(self, node: N) -> None:
        """Queue ``node``, or move it to the place its current key says."""
        if not node.queued[self._t]:
            self.size += 1
        stamp = next(self._stamps)
        node.queued[self._t] = stamp
        heapq.heappush(self._heap, self.key(node) + (node.serial, stamp, node))
        if len(self._heap) > 2 * self.size + 64:
            self._heap = self._live()
            heapq.heapify(self._heap)

    def discard(self, node: N) -> None:
        """Take ``node`` off the queue (no-op when it is not on it)."""
        if node.queued[self._t]:
            node.queued[self._t] = 0
            self.size -= 1
            heap = self._heap  # (holds the node's live entry: not empty)
            if heap[0][-1] is node:  # the victim just evicted: its entry goes while it is hot
                heapq.heappop(heap)

    def peek(self) -> N | None:
        """The first candidate, or None."""
        heap, t = self._heap, self._t
        while heap:
            entry = heap[0]
            node = entry[-1]
            if node.queued[t] == entry[-2]:
                return node
            heapq.heappop(heap)
        return None

    def members(self) -> list[N]:
        """Every queued node, in no particular order."""
        return [entry[-1] for entry in self._live()]

    def _live(self) -> list[tuple[Any, ...]]:
        t = self._t
        return [e for e in self._heap if e[-1].queued[t] == e[-2]]


def victims(index: CandidateIndex[N], tier: int, accept: Callable[[N], bool]) -> Iterator[N]:
    """Candidates of ``tier`` that ``accept`` admits, in policy order, for sweeps that skip
    some candidates (idle demotion). Seeded from the tier's queue; a parent joins once its
    last holding child is gone. Each candidate is checked again when its turn comes; the
    caller evicts each yielded node before asking for the next. The hot path uses
    :meth:`RadixIndex.next_victim` instead."""
    def candidate(n: N) -> bool:
        return n.evictable(tier) and accept(n)

    key = index.key
    heap = [(key(n), n.serial, n) for n in index.queues[tier].members() if accept(n)]
    heapq.heapify(heap)
    while heap:
        _, _, node = heapq.heappop(heap)
        if not candidate(node):
            continue
        parent = node.parent
        yield node
        if parent is not None and parent is not index.root and candidate(parent):
            heapq.heappush(heap, (key(parent), parent.serial, parent))


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
