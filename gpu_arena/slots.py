"""One pool's hot paths: its hole heap, and the per-id loops of taking holes, binding ids to
slots, freeing them and trimming the band.

A request allocates and frees a few dozen blocks per pool; these loops are most of what that
costs. :class:`SlotLoops` is the pure-Python version; ``gpu_arena._c_slots.SlotLoops`` (built
from ``_c_slots.c``) is its compiled twin with the same results for every input the pool
gives it (a test runs both side by side). :func:`slot_loops` picks one per pool.
"""

from __future__ import annotations

from array import array
from types import ModuleType

import numpy as np

from gpu_arena.holes import HoleHeap
from tierstore.native import load

native: ModuleType | None = load("gpu_arena._c_slots")  # None: pure Python (or not built)

# Trim modes: the pool's anchor (its index in spec.ANCHORS), which fixes the ends that shrink.
LOW, FLOAT, HIGH = 0, 1, 2


class SlotLoops:
    """One pool's hole heap (:class:`HoleHeap`: every hole of the band, nearest the anchor
    first; ``len()`` counts its entries) and the loops over the pool's tables (``loc``,
    ``owner``, fence counts, the free-id stack), read and written in place through
    memoryviews (plain ints, ~50 ns an item). ``visited`` counts the heap entries and band
    slots they read (a cost stat: tests bound it per allocation)."""

    def __init__(self, loc: np.ndarray, owner: np.ndarray, readers: np.ndarray,
                 writers: np.ndarray, free_ids: np.ndarray, sign: int = 1) -> None:
        self._loc, self._owner = loc.data, owner.data
        self._readers, self._writers, self._free = readers.data, writers.data, free_ids.data
        self._owner_np, self._readers_np, self._writers_np = owner, readers, writers
        self._holes = HoleHeap(sign, owner, readers, writers)
        self.visited = 0

    def __len__(self) -> int:
        return len(self._holes)

    def entries(self) -> list[int]:
        """The hole heap's entries (``sign * slot``)."""
        return list(self._holes.entries)

    def add(self, slots: list[int]) -> None:
        """Remember free ``slots`` as possible holes (validated when they surface)."""
        self._holes.add(slots)

    def take(self, lo: int, hi: int, n: int, fenced: bool) -> list[int]:
        """Take off the hole heap the first ``n`` holes of ``[lo, hi)`` (free, and unfenced
        when ``fenced``) nearest the anchor, dropping stale and repeated entries read on the
        way."""
        found, used = self._holes.take(lo, hi, n, fenced)
        self.visited += used
        return found

    def take_bind(self, lo: int, hi: int, n: int, fenced: bool,
                  top: int) -> tuple[list[int], bytearray] | None:
        """:meth:`take` then :meth:`bind` to what it found (a steady-state alloc in one call):
        the ids, and packed (:func:`packed`); None (nothing bound) when fewer than ``n`` holes
        were found."""
        if n == 0:
            return [], bytearray()
        if not self._holes.entries:
            return None
        slots = self.take(lo, hi, n, fenced)
        if len(slots) < n:
            return None
        ids = self.bind(slots, top)
        return ids, packed(ids)

    def bind(self, slots: list[int], top: int) -> list[int]:
        """Pop ``len(slots)`` ids off the free stack (its ``top`` first) and bind them to
        ``slots``; returns the ids."""
        ids = self._free[top - len(slots) : top].tolist()
        ids.reverse()  # the stack's top first: 0, 1, 2, ... from a fresh pool
        loc, owner = self._loc, self._owner
        for i, slot in zip(ids, slots, strict=True):
            loc[i] = slot
            owner[slot] = i
        return ids

    def free(self, ids: list[int], top: int, fenced: bool, lo: int, hi: int, occupied: int,
             slack: int, trim: int) -> tuple[int, int, int] | None:
        """Unbind live ``ids`` of the band ``[lo, hi)`` (which holds ``occupied`` live or
        pending slots) and push them on the free stack at ``top`` (the next pops hand them out
        in this order); sweep the hole heap when its stale entries pass twice the holes (these
        included) plus ``slack``; add their slots to it; and when an end of the band was freed,
        :meth:`trim` it (``trim``: the anchor, -1 for none). Returns None, or when a fence
        holds some of the slots (counted only when ``fenced``) or the band changed, how many
        and the band."""
        if not ids:
            return None
        loc, owner = self._loc, self._owner
        slots = [loc[i] for i in ids]
        for i, slot in zip(ids, slots, strict=True):
            loc[i] = -1
            owner[slot] = -1
        n = len(ids)
        self._free[top : top + n] = array(self._free.format, reversed(ids))
        pending = 0
        if fenced:
            readers, writers = self._readers, self._writers
            pending = sum(1 for s in slots if readers[s] > 0 or writers[s] > 0)
        holes = self._holes
        if len(holes) > 2 * ((hi - lo) - (occupied - n + pending) + n) + slack:
            self.sweep(lo, hi, fenced)
        holes.add(slots)
        band = lo, hi
        if trim >= 0 and (max(slots) == hi - 1 or min(slots) == lo):
            lo, hi = self.trim(lo, hi, fenced, trim)
        return None if pending == 0 and (lo, hi) == band else (pending, lo, hi)

    def sweep(self, lo: int, hi: int, fenced: bool) -> None:
        """Keep only the heap's entries that are holes of ``[lo, hi)`` now, each once."""
        self.visited += self._holes.sweep(lo, hi, fenced)

    def trim(self, lo: int, hi: int, fenced: bool, anchor: int) -> tuple[int, int]:
        """Shrink the band from its inner edge(s) (:data:`LOW`: the top, :data:`HIGH`: the
        bottom, :data:`FLOAT`: both) past free unfenced slots, scanning outward from each edge
        in chunks growing 8x, so the usual case costs one small op; the band."""
        visited = 0
        if anchor != HIGH:  # one past the highest occupied slot, or lo
            top, h, chunk = lo - 1, hi, 8
            while h > lo:
                start = max(lo, h - chunk)
                visited += h - start
                idx = np.flatnonzero(self._occupied(start, h, fenced))
                if idx.size:
                    top = start + int(idx[-1])
                    break
                h, chunk = start, chunk * 8
            hi = top + 1
        if anchor != LOW:  # the lowest occupied slot, or hi
            bottom, low, chunk = hi, lo, 8
            while low < hi:
                stop = min(hi, low + chunk)
                visited += stop - low
                idx = np.flatnonzero(self._occupied(low, stop, fenced))
                if idx.size:
                    bottom = low + int(idx[0])
                    break
                low, chunk = stop, chunk * 8
            lo = bottom
        self.visited += visited
        return lo, hi

    def _occupied(self, lo: int, hi: int, fenced: bool) -> np.ndarray:
        live = self._owner_np[lo:hi] >= 0
        if fenced:
            live |= (self._readers_np[lo:hi] > 0) | (self._writers_np[lo:hi] > 0)
        return live


def packed(ids: list[int]) -> bytearray:
    """``ids`` as native int64 bytes: ``torch.frombuffer`` makes a long tensor of them
    without reading the ints again (the store's allocate hands out tensors)."""
    return bytearray(array("q", ids))


def slot_loops(loc: np.ndarray, owner: np.ndarray, readers: np.ndarray, writers: np.ndarray,
               free_ids: np.ndarray, *, sign: int = 1, compiled: bool | None = None
               ) -> SlotLoops:
    """The loops for one pool's tables (``sign``: -1 for a pool anchored high): compiled when
    built (``compiled=None``), or as ``compiled`` asks (True raises ImportError when the module
    is not available)."""
    if compiled is None:
        compiled = native is not None
    if not compiled:
        return SlotLoops(loc, owner, readers, writers, free_ids, sign)
    if native is None:
        raise ImportError("gpu_arena._c_slots is not built (or TIERSTORE_PURE_PYTHON=1)")
    loops: SlotLoops = native.SlotLoops(loc, owner, readers, writers, free_ids, sign)
    return loops
