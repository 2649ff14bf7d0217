"""The per-id loops of a pool's hot paths: taking holes, binding ids to slots, releasing them.

A request allocates and frees a few dozen blocks per pool; these loops are most of what that
costs. :class:`SlotLoops` is the pure-Python version; ``gpu_arena._c_slots.SlotLoops`` (built
from ``_c_slots.c``) is its compiled twin with the same results for every input the pool
gives it (a test runs both side by side). :func:`slot_loops` picks one per pool.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import numpy as np

from tierstore.native import load

native: ModuleType | None = load("gpu_arena._c_slots")  # None: pure Python (or not built)


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


class SlotLoops:
    """Loops over one pool's tables (``loc``, ``owner``, fence counts, the free-id stack),
    read and written in place through memoryviews (plain ints, ~50 ns an item)."""

    def __init__(self, loc: np.ndarray, owner: np.ndarray, readers: np.ndarray,
                 writers: np.ndarray, free_ids: np.ndarray) -> None:
        self._loc, self._owner = loc.data, owner.data
        self._readers, self._writers, self._free = readers.data, writers.data, free_ids.data

    def take(self, entries: list[int], sign: int, lo: int, hi: int, n: int,
             fenced: bool) -> tuple[list[int], int]:
        """Sort ``entries`` (hole-heap keys ``sign * slot``) and take off its front the first
        ``n`` that are holes of ``[lo, hi)`` (free, and unfenced when ``fenced``), skipping
        repeats and stale keys; returns those slots and how many entries were read (and
        deleted)."""
        if n <= 0 or not entries:
            return [], 0
        entries.sort()
        found, used = first_holes(entries, sign, lo, hi, n, fenced, self._owner,
                                  self._readers, self._writers)
        del entries[:used]
        return found, used

    def take_bind(self, entries: list[int], sign: int, lo: int, hi: int, n: int, fenced: bool,
                  top: int) -> tuple[list[int] | None, int, bytearray | None]:
        """:meth:`take` then :meth:`bind` to what it found (a steady-state alloc in one call);
        the ids (None, nothing bound, when fewer than ``n`` holes were found), the entries read,
        and the ids packed (:func:`packed`; None with the ids)."""
        if n == 0:
            return [], 0, bytearray()
        if not entries:
            return None, 0, None
        slots, used = self.take(entries, sign, lo, hi, n, fenced)
        if len(slots) < n:
            return None, used, None
        ids = self.bind(slots, top)
        return ids, used, packed(ids)

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

    def release(self, ids: list[int], top: int, fenced: bool,
                sign: int) -> tuple[list[int], int, int, int]:
        """Unbind live ``ids`` and push them on the free stack at ``top`` (so the next pops
        hand them out in this order); returns their slots as hole-heap keys (``sign * slot``),
        how many of them a fence holds (counted only when ``fenced``), and the lowest and
        highest slot (-1 for no ids)."""
        loc, owner = self._loc, self._owner
        slots = [loc[i] for i in ids]
        for i, slot in zip(ids, slots, strict=True):
            loc[i] = -1
            owner[slot] = -1
        self._free[top : top + len(ids)] = array(self._free.format, reversed(ids))
        pending = 0
        if fenced:
            readers, writers = self._readers, self._writers
            pending = sum(1 for s in slots if readers[s] > 0 or writers[s] > 0)
        if not slots:
            return slots, pending, -1, -1
        low, high = min(slots), max(slots)
        return (slots if sign > 0 else [-s for s in slots]), pending, low, high


def packed(ids: list[int]) -> bytearray:
    """``ids`` as native int64 bytes: ``torch.frombuffer`` makes a long tensor of them
    without reading the ints again (the store's allocate hands out tensors)."""
    return bytearray(array("q", ids))


def slot_loops(loc: np.ndarray, owner: np.ndarray, readers: np.ndarray, writers: np.ndarray,
               free_ids: np.ndarray, *, compiled: bool | None = None) -> SlotLoops:
    """The loops for one pool's tables: compiled when built (``compiled=None``), or as
    ``compiled`` asks (True raises ImportError when the module is not available)."""
    if compiled is None:
        compiled = native is not None
    if not compiled:
        return SlotLoops(loc, owner, readers, writers, free_ids)
    if native is None:
        raise ImportError("gpu_arena._c_slots is not built (or TIERSTORE_PURE_PYTHON=1)")
    loops: SlotLoops = native.SlotLoops(loc, owner, readers, writers, free_ids)
    return loops
