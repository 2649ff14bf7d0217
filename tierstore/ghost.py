"""The ghost index: a bounded memory of page keys that left the cache from every tier.

Telling ``evicted`` from ``cold`` needs to know what was once cached. Two generations of
``{fingerprint: tier}`` (ARC's ghost list, kept as generations so forgetting is O(1)): a
dropped page goes into the young generation; when it holds ``capacity / 2`` entries the old
generation is forgotten whole and the young one takes its place. So the index remembers at
least the last ``capacity / 2`` drops and never more than ``capacity`` (plus one node's pages).

The fingerprint is Python's ``hash`` of the 32-byte page key: bytes cache their hash, so a
lookup costs no hashing pass, and at 64 bits two keys share a fingerprint with probability
~n/2^64 (a false ``evicted`` once in ~10^13 lookups at a million entries). Cost: 75-100
bytes per remembered page (a dict entry, its int key and the index slot; tracemalloc measured
75 at 200,000 entries), so 20-26 MB at the default 2^18 entries.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

DEFAULT_CAPACITY = 1 << 18  # pages remembered at most (at least half of it)


class GhostIndex:
    """Page keys dropped from every tier, each with the tier that dropped it last (1, 2, 3)."""

    __slots__ = ("_half", "_old", "_young", "capacity", "forgotten")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 2:
            raise ValueError(f"ghost capacity must be >= 2 pages, got {capacity}")
        self.capacity = capacity
        self._half = capacity // 2
        self._young: dict[int, int] = {}
        self._old: dict[int, int] = {}
        self.forgotten = 0  # entries dropped with a generation

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def add(self, keys: Iterable[bytes], tier: int) -> None:
        """Remember ``keys`` (a dropped node's pages) as dropped, last from ``tier``: one
        C-level update per call, no Python step per page. The young generation may overrun
        its half by one call's keys before it ages."""
        young = self._young
        young.update(zip(map(hash, keys), repeat(tier)))
        if len(young) >= self._half:
            self.forgotten += len(self._old)
            self._old, self._young = young, {}

    def tier(self, key: bytes) -> int:
        """The tier that dropped ``key`` last, or 0 if the index does not remember it."""
        h = hash(key)
        return self._young.get(h) or self._old.get(h, 0)
