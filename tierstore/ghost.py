"""The ghost index: a bounded memory of page keys that left the cache from every tier.

Telling ``evicted`` from ``cold`` needs to know what was once cached. Two generations of
``{page key: tier}`` (ARC's ghost list, kept as generations so forgetting is O(1)): a
dropped page goes into the young generation; when it holds ``capacity / 2`` entries the old
generation is forgotten whole and the young one takes its place. So the index remembers at
least the last ``capacity / 2`` drops and never more than ``capacity`` (plus one node's pages).

The entries are keyed by the page keys themselves (the bytes objects the index held): an add
creates no object per page (bytes cache their hash, computed when the index used them), where
a fingerprint per page (``hash(key)``, a new 64-bit int each) cost 1.8x the time of an add
(``bench ops``: the ghost's add was the largest single part of the accounting). Cost: the
key stays alive (65 bytes with its header, 72 as allocated), plus the dict entry and index
slot: 105-140 bytes per remembered page (sys.getsizeof: 105 at 32k entries), 28-37 MB at the
default 2^18 entries (fingerprints: 75-100 bytes, 20-26 MB). Lookups compare whole keys: no
false ``evicted``.
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
        self._young: dict[bytes, int] = {}
        self._old: dict[bytes, int] = {}
        self.forgotten = 0  # entries dropped with a generation

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def add(self, keys: Iterable[bytes], tier: int) -> None:
        """Remember ``keys`` (a dropped node's pages) as dropped, last from ``tier``: one
        C-level update per call, no Python step per page. The young generation may overrun
        its half by one call's keys before it ages."""
        young = self._young
        young.update(zip(keys, repeat(tier)))
        if len(young) >= self._half:
            self.forgotten += len(self._old)
            self._old, self._young = young, {}

    def tier(self, key: bytes) -> int:
        """The tier that dropped ``key`` last, or 0 if the index does not remember it."""
        return self._young.get(key) or self._old.get(key, 0)
