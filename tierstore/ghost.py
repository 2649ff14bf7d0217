"""The ghost index: a bounded memory of page keys that left the cache from every tier.

Telling ``evicted`` from ``cold`` needs to know what was once cached. Two generations of
``{page key: tier}`` (ARC's ghost list, kept as generations so forgetting is O(1)): a
dropped page goes into the young generation; when it holds ``capacity / 2`` entries the old
generation is forgotten whole and the young one takes its place. So the index remembers at
least the last ``capacity / 2`` drops and never more than ``capacity`` (plus one node's pages).

:data:`GhostIndex` is the compiled one (``tierstore/_c_ghost.c``) where it is built: each
generation an open-addressing table of 64-bit words, a 61-bit fingerprint of the page key's
bytes and the tier in 3 bits, no Python object per page: 16-32 bytes per remembered page, 4 MB
at the default 2^18 pages, both generations allocated (and faulted in) when it is built. In
the store's loop it is what made the ghost cheap: the dicts kept every dropped key object
alive (105-140 bytes a page, 28-37 MB), and their inserts, cold slots and cold keys, cost
~20 µs a request there (~5 compiled, the keys and slots prefetched so their misses overlap).
Two keys with one fingerprint are one entry, so a cold page reads as ``evicted`` with
probability at most ``n / 2^61`` per lookup (< 1.2e-13 at 2^18 pages); it only moves the page
between ``cold`` and ``evicted``, never out of the prompt's sum.
:class:`PyGhostIndex` is the pure-Python path (``TIERSTORE_PURE_PYTHON=1``, or no compiler):
dicts keyed by the keys themselves, exact, with the same answers but for that collision case.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import not_
from typing import Protocol

from tierstore.native import load

DEFAULT_CAPACITY = 1 << 18  # pages remembered at most (at least half of it)
MAX_TIER = 4  # tier numbers 1-4 (tierstore.radix.Tier: L1, L2, L3, disk)


class Ghost(Protocol):
    """What attribution asks of a ghost index (both paths give it)."""

    capacity: int
    forgotten: int

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def add(self, keys: Iterable[bytes], tier: int) -> None: ...
    def tier(self, key: bytes) -> int: ...
    def counts(self, keys: Sequence[bytes], start: int = 0) -> list[int]: ...
    @property
    def nbytes(self) -> int: ...


class PyGhostIndex:
    """Page keys dropped from every tier, each with the tier that dropped it last (1-4)."""

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

    def __contains__(self, key: object) -> bool:
        return key in self._young or key in self._old

    @property
    def nbytes(self) -> int:
        """Bytes of the two dicts (the keys they keep alive are not counted)."""
        return sys.getsizeof(self._young) + sys.getsizeof(self._old)

    def add(self, keys: Iterable[bytes], tier: int) -> None:
        """Remember ``keys`` (a dropped node's pages) as dropped, last from ``tier``: one
        C-level update per call, no Python step per page. The young generation may overrun
        its half by one call's keys before it ages."""
        if not 1 <= tier <= MAX_TIER:
            raise ValueError(f"tier must be in [1, {MAX_TIER}], got {tier}")
        young = self._young
        young.update(zip(keys, repeat(tier)))
        if len(young) >= self._half:
            self.forgotten += len(self._old)
            self._old, self._young = young, {}

    def tier(self, key: bytes) -> int:
        """The tier that dropped ``key`` last, or 0 if the index does not remember it."""
        return self._young.get(key) or self._old.get(key, 0)

    def counts(self, keys: Sequence[bytes], start: int = 0) -> list[int]:
        """Of ``keys[start:]``: how many are not remembered, and how many each tier (1-4)
        dropped last; C-level maps count them."""
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        young, old = self._young, self._old
        hs = keys[start:]
        tiers = list(map(young.get, hs, repeat(0)))
        counts = [tiers.count(t) for t in range(MAX_TIER + 1)]
        if counts[0] and old:
            older = list(map(old.get, compress(hs, map(not_, tiers)), repeat(0)))
            counts = [older.count(0)] + [c + older.count(t) for t, c in enumerate(counts) if t]
        return counts


_c = load("tierstore._c_ghost")
GhostIndex: type[Ghost] = _c.GhostIndex if _c is not None else PyGhostIndex
