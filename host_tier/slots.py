"""Variable-size byte ranges of one buffer: first-fit allocation with coalescing free ranges.

The arena (``gpu_arena``) packs fixed-size blocks of up to three kinds; engine-keyed values are
opaque bytes of any size, so they get this simpler allocator over a shared segment. It keeps no
policy: the caller decides what to free when an allocation does not fit.
"""

from __future__ import annotations

import bisect

from tierstore.errors import UsageError

ALIGN = 256  # every range starts on this boundary (vector-wide copies, any dtype view)


class SlotError(UsageError):
    """A free of a range that is not allocated, or a bad size."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN` (at least one unit)."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


class ByteSlots:
    """Ranges of ``[0, capacity)``: :meth:`alloc` returns an aligned offset or None, :meth:`free`
    returns a range (merged with free neighbours). Exact-size holes are reused first; otherwise
    the lowest range that fits is split. Not thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise SlotError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity // ALIGN * ALIGN  # under one unit: nothing ever fits
        self._used: dict[int, int] = {}  # start -> size
        self._free: dict[int, int] = {}  # start -> size
        self._free_end: dict[int, int] = {}  # end -> start
        self._starts: list[int] = []  # sorted starts of free ranges
        self._bins: dict[int, set[int]] = {}  # size -> starts
        self.used_bytes = 0
        if self.capacity:
            self._put(0, self.capacity)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def num_used(self) -> int:
        return len(self._used)

    def starts(self) -> set[int]:
        """Starts of the allocated ranges."""
        return set(self._used)

    def size(self, start: int) -> int:
        """The aligned size of the allocated range at ``start``."""
        return self._used[start]

    def alloc(self, nbytes: int) -> int | None:
        """An aligned range of at least ``nbytes``; None when no free range is large enough
        (nothing changes then)."""
        if nbytes <= 0:
            raise SlotError(f"nbytes must be positive, got {nbytes}")
        need = aligned(nbytes)
        exact = self._bins.get(need)
        if exact:
            start = min(exact)
        else:
            start = next((s for s in self._starts if self._free[s] >= need), -1)
            if start < 0:
                return None
        size = self._take(start)
        if size > need:
            self._put(start + need, size - need)
        self._used[start] = need
        self.used_bytes += need
        return start

    def free(self, start: int) -> None:
        """Return the range at ``start``; SlotError when no range starts there."""
        size = self._used.pop(start, None)
        if size is None:
            raise SlotError(f"no allocated range starts at {start}")
        self.used_bytes -= size
        end = start + size
        before = self._free_end.get(start)
        if before is not None:
            size += self._take(before)
            start = before
        if end in self._free:
            size += self._take(end)
        self._put(start, size)

    def _take(self, start: int) -> int:
        size = self._free.pop(start)
        del self._free_end[start + size]
        self._starts.pop(bisect.bisect_left(self._starts, start))
        same = self._bins[size]
        same.discard(start)
        if not same:
            del self._bins[size]
        return size

    def _put(self, start: int, size: int) -> None:
        self._free[start] = size
        self._free_end[start + size] = start
        bisect.insort(self._starts, start)
        self._bins.setdefault(size, set()).add(start)

    def check_integrity(self) -> None:
        """AssertionError unless used and free ranges tile ``[0, capacity)`` exactly, free
        neighbours are merged and the indexes agree."""
        ranges = sorted([(s, n, True) for s, n in self._used.items()]
                        + [(s, n, False) for s, n in self._free.items()])
        at, prev_free = 0, False
        for start, size, used in ranges:
            assert start == at, f"gap or overlap at {at} (next range at {start})"
            assert used or not prev_free, f"unmerged free ranges at {start}"
            assert start % ALIGN == 0 and size % ALIGN == 0 and size > 0, (start, size)
            at, prev_free = start + size, not used
        assert at == self.capacity, f"ranges end at {at}, capacity {self.capacity}"
        assert self._starts == sorted(self._free), "free starts out of order"
        assert {e: s for s, n in self._free.items() for e in [s + n]} == self._free_end
        assert sum(len(v) for v in self._bins.values()) == len(self._free)
        assert self.used_bytes == sum(self._used.values())
