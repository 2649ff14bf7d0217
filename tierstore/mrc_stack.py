"""The miss-ratio shadow's stack (:mod:`tierstore.mrc`): slot bytes with a sum per block, and
L1's window over them with its L2 copy bits.

L2 keeps a copy of what it promotes into L1 (``Mover._load``), so an L2 of ``m*C2`` bytes
holds the most recent ``m*C2`` bytes among L1's pages it has copies of and every page below
L1. The window is the stack's top ``C1`` bytes (slots ``[_lo, clock)``, ``_win`` bytes); each
slot there carries a bit per multiple ``m`` (``_fl``): whether its page came into L1 from within
that L2's reach ``C1 + m*C2 - D_m``, ``D_m`` (``_d``) being the bytes in the window with that
bit. The compiled twin of :func:`touch` is ``tierstore._c_mrc.touch_overlap``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from functools import partial
from typing import Any

from tierstore.native import load

# The functions here take a ``tierstore.mrc.Shadow`` (``s``), typed ``Any``: importing it, even
# for typing only, would close an import circle (tests/test_imports.py).
Shadow = Any

SHIFT = 8
BLOCK = 1 << SHIFT
# The depth bound's drop compiled (None: the pure loop, :func:`drop`; the same tables, tested).
_C = load("tierstore._c_shadow")
# Pages past the curves' depth are dropped (:func:`trim`) once this many are tracked, then
# each time the tracked pages double: amortized O(1) a new page.
TRIM_MIN = 1024


class Slots:
    """Weighted bytes per time slot, with a sum per block of ``2**SHIFT`` slots: an update is
    two list writes, the bytes at or after a slot two C-level ``sum``s over at most a block
    each. Updates (two per touched page) outnumber distance reads about 5:1 per request,
    so this beats a Fenwick tree's ~17-step Python loops."""

    __slots__ = ("sums", "values")

    def __init__(self, values: list[float]) -> None:
        self.values = values
        self.sums = [sum(values[i:i + BLOCK]) for i in range(0, len(values), BLOCK)]

    def add(self, i: int, delta: float) -> None:
        self.values[i] += delta
        self.sums[i >> SHIFT] += delta

    def suffix(self, i: int, end: int) -> float:
        """Sum of slots ``[i, end)`` (``end``: past the last slot used; a recent page's
        distance reads a few slots, not the whole list)."""
        b = i >> SHIFT
        stop = (b + 1) << SHIFT
        if end <= stop:
            return sum(self.values[i:end])
        return sum(self.values[i:stop]) + sum(self.sums[b + 1:((end - 1) >> SHIFT) + 1])


def touch(s: Shadow, keys: Sequence[bytes], ends: list[int] | None, sampled: list[int],
          create: bool, seen: dict[int, float] | None, start: int) -> None:
    """``Shadow._touch`` with an L2: move the sampled pages to the top, keeping L1's window
    and its L2 copy bits (a page from below L1 gets the bits its distance earns; one in L1
    keeps its own; a new one has none; under write-through an insert's pages have them all).
    ``seen``: distances before the request, by position, of every tracked one before
    ``start``."""
    pages = s._pages
    tree = s._tree
    values, sums = tree.values, tree.sums
    wb = s._wb
    clock = s._clock
    fl, d, bits, carry = s._fl, s._d, s._bits, s._carry
    lo, win, c1 = s._lo, s._win, s._c1
    thr = s._thresholds()
    force = (1 << len(d)) - 1 if create and s.write_through else 0  # every page copied
    # As in the store, the request's pages come in together (its path is locked while
    # they do): whether a page was in L1, and its distance, are read before any of them
    # moves, and L1's window moves past its oldest pages once they all did.
    if seen is None or start < len(keys):
        start = start if seen is not None else 0
        seen = dict(seen) if seen else {}
        for i in sampled[bisect.bisect_left(sampled, start):]:
            at = pages.get(keys[i], -1) >> 1
            if 0 <= at < lo:
                seen[i] = tree.suffix(at, clock)
    c = s._c
    if c is not None and type(keys) is list:
        done = c.touch_overlap(pages, values, sums, fl, d, carry, wb[0], wb[1], keys,
                               sampled, ends, create, clock, lo, win, c1, thr, seen, force)
        if done is not None:  # (None: the slots run out on the way; compacted below)
            s._clock, added, s._lo, s._win = done
            s._num_ends += added
            if len(pages) - s._num_ends > s.max_tracked \
                    or s._num_ends > s.max_tracked:
                s._lower_rate()
            return
    for i in reversed(sampled):
        key = keys[i]
        code = pages.get(key)
        if code is None:
            if not create:
                continue
            is_end = 1 if ends is not None and i in ends else 0
            s._num_ends += is_end
            f = carry.get(key, 0) if carry else 0
        else:
            is_end = code & 1
            slot = code >> 1
            f = 0
            if slot >= 0:
                v = wb[is_end]
                if slot >= lo:  # a hit in L1: its copy stays as it was
                    f = fl[slot]
                    win -= v
                    for j in bits[f]:
                        d[j] -= v
                elif i in seen:
                    dist = seen[i]
                    for j, t in enumerate(thr):
                        if dist <= t:
                            f |= 1 << j
                else:  # in L1 when the request came: a compaction on the way (its window
                    f = fl[slot]  # found afresh) left it below; its copy stays as it was
                fl[slot] = 0
                values[slot] -= v
                sums[slot >> SHIFT] -= v
        if clock >= s._slots:
            if code is not None:  # off the stack while the slots are renumbered
                pages[key] = -2 | is_end
            s._clock, s._lo, s._win = clock, lo, win
            s._compact()
            tree = s._tree
            values, sums, wb, fl = tree.values, tree.sums, s._wb, s._fl
            clock, lo, win = s._clock, s._lo, s._win
        pages[key] = clock << 1 | is_end
        f |= force
        v = wb[is_end]
        values[clock] = v  # slots at and past the clock are empty
        sums[clock >> SHIFT] += v
        fl[clock] = f
        win += v
        for j in bits[f]:
            d[j] += v
        clock += 1
    while win > c1 and lo < clock:  # the oldest of L1's window leave it
        v = values[lo]
        if v:
            win -= v
            for j in bits[fl[lo]]:
                d[j] -= v
        lo += 1
    s._clock, s._lo, s._win = clock, lo, win
    if len(pages) - s._num_ends > s.max_tracked or s._num_ends > s.max_tracked:
        s._lower_rate()


def untrack(s: Shadow, code: int, key: bytes) -> None:
    """Take a tracked page off the stack (it becomes a checkpoint end, tracked anew by the
    touch that follows, with the L2 copy bits it had)."""
    if code >= 0:
        slot = code >> 1
        v = s._wb[code & 1]
        if s._overlap:
            f = 0
            if slot >= s._lo:
                f = s._fl[slot]
                s._win -= v
                for j in s._bits[f]:
                    s._d[j] -= v
            else:
                dist = s._tree.suffix(slot, s._clock)
                for j, t in enumerate(s._thresholds()):
                    if dist <= t:
                        f |= 1 << j
            s._fl[slot] = 0
            s._carry[key] = f
        s._tree.add(slot, -v)
    s._num_ends -= code & 1


def window(s: Shadow) -> None:
    """Find L1's window and its copy bytes afresh (slots renumbered or reweighed)."""
    if not s._overlap:
        return
    values, fl, bits = s._tree.values, s._fl, s._bits
    d = [0.0] * len(s._d)
    win, lo = 0.0, s._clock
    while lo > 0 and win + values[lo - 1] <= s._c1:
        lo -= 1
        v = values[lo]
        win += v
        for j in bits[fl[lo]]:
            d[j] += v
    s._lo, s._win, s._d = lo, win, d


def compact(s: Shadow) -> None:
    """Renumber the live slots 0..n-1 in recency order, at the current weights (slots ran
    out, or a rate changed)."""
    s._set_weights()
    wb, pages = s._wb, s._pages
    live = sorted((code, key) for key, code in pages.items() if code >= 0)  # slot order
    values = [0.0] * s._slots
    old, fl = s._fl, [0] * s._slots
    for slot, (code, key) in enumerate(live):
        pages[key] = slot << 1 | code & 1
        values[slot] = wb[code & 1]
        fl[slot] = old[code >> 1]
    s._tree = Slots(values)
    s._fl = fl
    s._clock = len(live)
    window(s)


def reweigh(s: Shadow) -> None:
    """Rebuild the slots at the current weights, keeping every page's slot: a rate changed
    (no sort and no renumbering, unlike :func:`compact`: at 500k cached pages the compaction
    it used to run cost ~55 ms, 30-70 us a request over a thousand)."""
    s._set_weights()
    wb = s._wb
    values = [0.0] * s._slots
    old, fl = s._fl, [0] * s._slots  # dropped pages' bits go with them
    for code in s._pages.values():
        if code >= 0:
            values[code >> 1] = wb[code & 1]
            fl[code >> 1] = old[code >> 1]
    s._tree = Slots(values)
    s._fl = fl
    window(s)


def trim(s: Shadow) -> None:
    """Drop the tracked pages deeper than the last edge: no curve reads that far, so such a page
    counts as untracked (a miss at every size, moved to the top only by an insert, which creates
    an untracked one there too; the match's reads skip it). At a fixed rate a distance only
    grows until the page is used, so when a page is dropped changes no curve (tested). The stack
    is recency-ordered: its bottom slots go, up to the first whose distance is within."""
    bound = s.edges[-1]
    if bound == math.inf:
        return
    tree, clock, c = s._tree, s._clock, s._c
    bound *= 1 + 1e-9  # (sums of non-integral weights may round: keep what is at the edge)
    sums, b, acc = tree.sums, (clock - 1) >> SHIFT, 0.0
    while b >= 0:  # whole blocks from the top (a slot's distance: the bytes at and past it)
        acc += sums[b]
        if acc > bound:
            break
        b -= 1
    if b >= 0:  # the cut lies in block b (one either side: the sums' order of additions)
        suffix = tree.suffix if c is None else partial(c.suffix_of, tree.values, sums)
        lo, hi = max(0, (b - 1) << SHIFT), min(clock, (b + 2) << SHIFT)
        while lo < hi:  # the lowest slot within: distances fall as slots rise
            mid = (lo + hi) // 2
            if suffix(mid, clock) > bound:
                lo = mid + 1
            else:
                hi = mid
        drop_below = drop if _C is None or c is None else _C.drop
        s._num_ends -= drop_below(s._pages, tree.values, sums, s._fl, lo)
    s._trim_at = max(2 * len(s._pages), TRIM_MIN)


def drop(pages: dict[bytes, int], values: list[float], sums: list[float],
         fl: list[int] | None, cut: int) -> int:
    """Drop the tracked pages whose slot lies below ``cut`` (``_c_shadow.drop``'s twin): their
    slot bytes zeroed, their block sums lowered (in slot order), their L2 copy bits cleared. The
    checkpoint ends among them."""
    ends = 0  # (in slot order: the block sums' subtractions as the compiled core makes them)
    for code, key in sorted((code, key) for key, code in pages.items() if 0 <= code < cut << 1):
        del pages[key]
        slot = code >> 1
        v = values[slot]
        values[slot] = 0.0
        sums[slot >> SHIFT] -= v
        if fl is not None:
            fl[slot] = 0
        ends += code & 1
    return ends
