"""The hole heap: slots of one pool that may be holes, nearest the pool's anchor first.

Every hole of the band is in it; stale entries (slots since taken, fenced, outside the band, or
repeated) are dropped when they surface or swept in bulk, so finding ``n`` holes costs about
``n`` entries, not a scan of the band.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import numpy as np

from gpu_arena.slots import SlotLoops, first_holes, packed

# Up to this many entries the heap is kept as a list that is sorted before each take: new
# entries are appended unordered (no per-entry push), and the sort merges them into the sorted
# rest in C. A request's take is then a prefix; beyond it, heap pushes and pops.
SORTED_UP_TO = 512


class HoleHeap:
    """Possible holes of one pool as a min-heap of keys: the slot, or ``-slot`` for a pool
    anchored high (its holes nearest the top come first). Validity is read from the pool's
    tables (``owner`` < 0 and no fence) when an entry surfaces."""

    def __init__(self, high: bool, owner: np.ndarray, readers: np.ndarray,
                 writers: np.ndarray, loops: SlotLoops) -> None:
        self.entries: list[int] = []
        self.sign = -1 if high else 1  # key = sign * slot
        self._owner, self._readers, self._writers = owner, readers, writers
        # Item access as plain ints (~50 ns against ~100 ns through numpy).
        self._owner_mv, self._readers_mv, self._writers_mv = owner.data, readers.data, writers.data
        # `entries` is a heap (appends below SORTED_UP_TO may break it). Public: the pool's hot
        # paths run the sorted-list cases of take_bind and add_keys themselves, and set it.
        self.ordered = True
        self._loops = loops  # the sorted-list take's loop (compiled where built)

    def __len__(self) -> int:
        return len(self.entries)

    def slots(self) -> set[int]:
        """Every slot with an entry (stale ones too)."""
        return {self.sign * e for e in self.entries}

    def add(self, slots: Sequence[int] | np.ndarray) -> None:
        """Remember ``slots`` as possible holes (validated when they surface)."""
        keys: Sequence[int]
        if isinstance(slots, np.ndarray):
            keys = (slots * self.sign).tolist()
        else:
            keys = [-s for s in slots] if self.sign < 0 else slots
        self.add_keys(keys)

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
            self.ordered = True
            return self._loops.take(entries, self.sign, lo, hi, n, fenced)
        if not self.ordered:
            heapq.heapify(entries)
            self.ordered = True
        return first_holes(_popping(entries), self.sign, lo, hi, n, fenced, self._owner_mv,
                           self._readers_mv, self._writers_mv)

    def take_bind(self, lo: int, hi: int, n: int, fenced: bool,
                  top: int) -> tuple[list[int] | None, int, bytearray | None]:
        """:meth:`take` ``n`` holes and bind ids to them, popped off the free-id stack at
        ``top`` (:meth:`SlotLoops.take_bind`); the ids (None, nothing bound, when fewer than
        ``n`` were found), the entries read and the ids packed (None with the ids)."""
        entries = self.entries
        if n > 0 and entries and len(entries) <= SORTED_UP_TO:
            self.ordered = True  # sorted by the take: a heap
            return self._loops.take_bind(entries, self.sign, lo, hi, n, fenced, top)
        slots, used = self.take(lo, hi, n, fenced)
        if len(slots) < n:
            return None, used, None
        ids = self._loops.bind(slots, top)
        return ids, used, packed(ids)

    def sweep(self, lo: int, hi: int, fenced: bool) -> int:
        """Keep only the entries that are holes of ``[lo, hi)`` now; returns the entries read
        (a pass over the heap, which holds every hole: not a scan of the band)."""
        entries = self.entries
        read = len(entries)
        slots = _distinct(np.asarray(entries, dtype=np.int64) * self.sign)
        slots = slots[(slots >= lo) & (slots < hi)]
        busy = self._owner[slots] >= 0
        if fenced:
            busy |= (self._readers[slots] > 0) | (self._writers[slots] > 0)
        slots = slots[~busy]
        # In place: a caller holding the list must not add to one the heap no longer reads.
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
