"""The hole heap: slots of one pool that may be holes, nearest the pool's anchor first.

Every hole of the band is in it; stale entries (slots since taken, fenced, outside the band, or
repeated) are dropped when they surface or swept in bulk, so finding ``n`` holes costs about
``n`` entries, not a scan of the band. This is the pure-Python heap of
:class:`gpu_arena.slots.SlotLoops`; the compiled loops keep theirs as a C array, with the same
entries and the same takes (only the order of the array differs: a heap either way).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

# Up to this many entries the heap is kept as a list that is sorted before each take: new
# entries are appended unordered (no per-entry push), and the sort merges them into the sorted
# rest in C. A request's take is then a prefix; beyond it, heap pushes and pops.
SORTED_UP_TO = 512


def first_holes(keys: Iterable[int], sign: int, lo: int, hi: int, n: int, fenced: bool,
                owner: Any, readers: Any, writers: Any) -> tuple[list[int], int]:
    """The first ``n`` slots of ``keys`` (hole-heap keys ``sign * slot``, in order) that are
    holes of ``[lo, hi)``: free in ``owner``, and unfenced when ``fenced``; repeats and stale
    keys are skipped. Returns them and how many keys were read."""
    found: list[int] = []
    last, used, left = None, 0, n
    for key in keys:
        used += 1
        slot = sign * key
        if slot == last:  # a repeated entry: equal entries come one after another
            continue
        last = slot
        if lo <= slot < hi and owner[slot] < 0 and not (
                fenced and (readers[slot] > 0 or writers[slot] > 0)):
            found.append(slot)
            left -= 1
            if not left:
                break
    return found, used


class HoleHeap:
    """Possible holes of one pool as a min-heap of keys: the slot, or ``-slot`` for a pool
    anchored high (``sign`` -1: its holes nearest the top come first). Validity is read from
    the pool's tables (``owner`` < 0 and no fence) when an entry surfaces."""

    def __init__(self, sign: int, owner: np.ndarray, readers: np.ndarray,
                 writers: np.ndarray) -> None:
        self.entries: list[int] = []
        self.sign = sign  # key = sign * slot
        self._owner, self._readers, self._writers = owner, readers, writers
        # Item access as plain ints (~50 ns against ~100 ns through numpy).
        self._owner_mv, self._readers_mv, self._writers_mv = owner.data, readers.data, writers.data
        self.ordered = True  # `entries` is a heap (appends below SORTED_UP_TO may break it)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, slots: Sequence[int]) -> None:
        """Remember ``slots`` as possible holes (validated when they surface)."""
        self.add_keys([-s for s in slots] if self.sign < 0 else slots)

    def add_keys(self, keys: Sequence[int]) -> None:
        """:meth:`add` for slots already given as keys (``sign * slot``)."""
        entries = self.entries
        if len(entries) + len(keys) <= SORTED_UP_TO:
            entries.extend(keys)  # ordered by the next take's sort
            self.ordered = False
        elif not self.ordered or len(entries) <= 4 * len(keys):
            entries.extend(keys)  # one C heapify beats k pushes here
            heapq.heapify(entries)
            self.ordered = True
        else:
            push = heapq.heappush
            for key in keys:
                push(entries, key)

    def take(self, lo: int, hi: int, n: int, fenced: bool) -> tuple[list[int], int]:
        """Up to ``n`` holes of ``[lo, hi)`` nearest the anchor, taken off the heap, and how many
        entries were read to find them. Stale entries read on the way are dropped (and entries
        outside ``[lo, hi)``: the caller re-cuts the band to it or it already is that)."""
        entries = self.entries
        if n <= 0 or not entries:
            return [], 0
        if len(entries) <= SORTED_UP_TO:
            # A sorted list is a heap, and so is what follows a prefix of it.
            entries.sort()
            self.ordered = True
            found, used = first_holes(entries, self.sign, lo, hi, n, fenced, self._owner_mv,
                                      self._readers_mv, self._writers_mv)
            del entries[:used]
            return found, used
        if not self.ordered:
            heapq.heapify(entries)
            self.ordered = True
        return first_holes(_popping(entries), self.sign, lo, hi, n, fenced, self._owner_mv,
                           self._readers_mv, self._writers_mv)

    def sweep(self, lo: int, hi: int, fenced: bool) -> int:
        """Keep only the entries that are holes of ``[lo, hi)`` now, each once; returns the
        entries read (a pass over the heap, which holds every hole: not a scan of the band)."""
        entries = self.entries
        read = len(entries)
        slots = _distinct(np.asarray(entries, dtype=np.int64) * self.sign)
        slots = slots[(slots >= lo) & (slots < hi)]
        busy = self._owner[slots] >= 0
        if fenced:
            busy |= (self._readers[slots] > 0) | (self._writers[slots] > 0)
        slots = slots[~busy]
        entries[:] = (slots * self.sign).tolist()
        if self.sign < 0:
            entries.reverse()  # ascending keys: sorted, so a heap
        self.ordered = True
        return read


def _distinct(values: np.ndarray) -> np.ndarray:
    """``values`` sorted, each once (``np.unique`` without its first call's ~13 ms import of
    ``numpy.ma``, which a benchmark's first sweep would pay)."""
    values = np.sort(values)
    if values.size < 2:
        return values
    keep = np.empty(values.size, dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def _popping(heap: list[int]) -> Iterator[int]:
    """The heap's entries, smallest first, each popped off as it is read."""
    pop = heapq.heappop
    while heap:
        yield pop(heap)
