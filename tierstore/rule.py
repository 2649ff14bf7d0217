"""The hybrid match rule over an index walk, as plain functions of the path.

A prefix of P pages is usable when every ``kv`` page of it is present in some allowed tier,
a state checkpoint sits at exactly P (layouts with recurrent layers), and the ``swa`` pages
of the window before P are present (layouts with sliding-window layers).

Presence is read per segment with C-level list operations (``ABSENT in column``): when L1
holds a segment whole, which is the common case, the segment costs a slice and a scan, not
a Python step per page. Entries are ``>= 0`` or exactly ``ABSENT`` (the index keeps them so;
:func:`tierstore.integrity.check_index` checks it).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Sequence

import torch

from tierstore.native import load
from tierstore.radix import ABSENT, Segment, Tier

# held / walk (tierstore/_c_radix.c), or None: the Python paths here and in radix.py
_c = load("tierstore._c_radix")
_EMPTY = torch.empty(0, dtype=torch.long)
_L1 = int(Tier.L1)  # a plain int: reading an enum member costs ~0.2-0.5 us, several a match


def usable(path: Sequence[Segment], tiers: Sequence[int], *, swa: bool, state: bool,
           window: int) -> tuple[int, int]:
    """Deepest prefix length (pages) the hybrid rule accepts on ``path``, and the consecutive
    KV pages present; an entry counts as present when one of ``tiers`` holds it. Changes
    nothing."""
    found = first_absent(path, tiers, "kv")
    gaps = absent_before(path, tiers, "swa", found) if swa else []

    def window_ok(end: int) -> bool:  # no SWA gap in [end - window, end)
        i = bisect_left(gaps, end - window)
        return i == len(gaps) or gaps[i] >= end

    if state:
        for seg in reversed(path):
            n = seg.node
            if (seg.pages == len(n.keys) and n.end <= found
                    and any(n.checkpoint(t) >= 0 for t in tiers) and window_ok(n.end)):
                return n.end, found
        return 0, found
    # The deepest end <= found whose window holds no gap: every end in (gap, end] has the
    # largest gap below it in its window, so the next candidate is that gap itself.
    end, i = found, len(gaps)
    while end > 0 and i and gaps[i - 1] >= end - window:
        end = gaps[i - 1]
        i -= 1
    return end, found


def first_absent(path: Sequence[Segment], tiers: Sequence[int], kind: str) -> int:
    """Position of the first page on ``path`` whose ``kind`` entry no tier of ``tiers``
    holds (the path's length when every page is held)."""
    pos = 0
    l1 = _L1 in tiers
    for seg in path:
        n, p = seg.node, seg.pages
        if l1:
            col = n.ids(_L1, kind)
            if ABSENT not in (col if p == len(col) else col[:p]):
                pos += p
                continue
        cols = [n.ids(t, kind) for t in tiers]
        for j in range(p):
            if not any(c[j] >= 0 for c in cols):
                return pos + j
        pos += p
    return pos


def absent_before(path: Sequence[Segment], tiers: Sequence[int], kind: str, limit: int
                  ) -> list[int]:
    """Ascending positions below ``limit`` on ``path`` whose ``kind`` entry no tier of
    ``tiers`` holds."""
    out: list[int] = []
    pos = 0
    l1 = _L1 in tiers
    for seg in path:
        if pos >= limit:
            break
        n, p = seg.node, min(seg.pages, limit - pos)
        if l1:
            col = n.ids(_L1, kind)
            if ABSENT not in (col if p == len(col) else col[:p]):
                pos += p
                continue
        cols = [n.ids(t, kind) for t in tiers]
        out += [pos + j for j in range(p) if not any(c[j] >= 0 for c in cols)]
        pos += p
    return out


def in_l1(path: Sequence[Segment], pages: int, kind: str, start: int = 0) -> bool:
    """Whether L1 holds the ``kind`` entry of every page in ``[start, pages)`` of ``path``."""
    pos = 0
    for seg in path:
        if pos >= pages:
            break
        lo, hi = max(0, start - pos), min(seg.pages, pages - pos)
        if lo < hi:
            col = seg.node.ids(_L1, kind)
            if ABSENT in (col if lo == 0 and hi == len(col) else col[lo:hi]):
                return False
        pos += seg.pages
    return True


def cut(path: Sequence[Segment], pages: int) -> list[Segment]:
    """The first ``pages`` pages of ``path``."""
    out, left = [], pages
    for seg in path:
        if left <= 0:
            break
        out.append(Segment(seg.node, min(seg.pages, left)))
        left -= seg.pages
    return out


def held_in_l1(path: Sequence[Segment], *, swa: bool, state: bool, window: int
               ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """The common hit in one pass: when L1 holds every ``kv`` entry of a non-empty ``path``
    (with ``swa``, the ``swa`` entries of its last ``window`` pages too; with ``state``, the
    path ends a node whose checkpoint L1 holds), its length in pages and its :func:`l1_ids` of
    ``kv`` and ``swa``; else None.

    Then :func:`usable` accepts the whole path for any tiers that include L1, and L1 holds all
    a promotion would bring up (:meth:`~tierstore.movement.Mover.promote` has nothing to do).
    Changes nothing."""
    if not path:
        return None
    if state:
        last = path[-1]
        if last.pages != len(last.node.keys) or last.node.checkpoint(_L1) < 0:
            return None
    if _c is not None and type(path) is list:  # (a walk's)
        got = _c.held(path, window if swa else -1)
        if got is None:
            return None
        return got[0], torch.frombuffer(got[1], dtype=torch.long), \
            torch.frombuffer(got[2], dtype=torch.long)
    return _held(path, swa=swa, window=window)


def _held(path: Sequence[Segment], *, swa: bool, window: int
          ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """:func:`held_in_l1` past its checkpoint test, in Python (``_c_radix.held``'s twin)."""
    kv = sw = None
    for seg in path:
        p = seg.pages
        cols = seg.node._pages[0]  # (Node.ids(L1, ...) without two calls a segment)
        col = cols["kv"]
        if p != len(col):
            col = col[:p]
        if ABSENT in col:
            return None
        scol = cols["swa"]
        if p != len(scol):
            scol = scol[:p]
        if kv is None or sw is None:  # (building from the first column costs less)
            kv, sw = array("q", col), array("q", scol)
        else:
            kv.extend(col)
            sw.extend(scol)
    assert kv is not None and sw is not None, "a path has segments"
    # (outside the window SWA pages may be tombstones: the rule and a promotion skip them)
    if swa and ABSENT in (sw if window >= len(sw) else sw[len(sw) - window:]):
        return None
    return len(kv), torch.frombuffer(kv, dtype=torch.long), torch.frombuffer(sw, dtype=torch.long)


def l1_ids(path: Sequence[Segment], kind: str) -> torch.Tensor:
    """The L1 entries of ``kind`` along ``path`` as a long tensor (built from a C array: a
    ``torch.tensor`` of a list costs several times more)."""
    ids = array("q")
    for seg in path:
        col = seg.node.ids(_L1, kind)
        ids.extend(col if seg.pages == len(col) else col[: seg.pages])
    return torch.frombuffer(ids, dtype=torch.long) if ids else _EMPTY
