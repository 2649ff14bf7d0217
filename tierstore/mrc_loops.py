"""The miss-ratio shadow's per-event loops in pure Python (:mod:`tierstore.mrc`): a prompt's
scan, a match's reads and a touch without an L2 overlap. They run when the compiled twins
(``tierstore._c_mrc``: ``scan``, ``reference``, ``touch``) are not built, are switched off
(``TIERSTORE_PURE_PYTHON=1``) or are handed something other than a list, and give the same
curves to the bit (tests/tierstore/test_mrc_native.py plays both side by side).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from typing import Any

from tierstore.mrc_stack import SHIFT

# The functions here take a ``tierstore.mrc.Shadow`` (``s``), typed ``Any``: importing it, even
# for typing only, would close an import circle (tests/test_imports.py).
Shadow = Any

# Sampling thresholds are on 32 bits of the page key itself (SHA-256 output, uniform): pages
# on bytes 0-3, candidate ends on bytes 4-7.
SPACE = 1 << 32


# The end prefilter (``Shadow._end_bits``, read by the compiled ``scan``): one bit per value of
# a key's bytes 8-10 (18 low bits), set for every key in the end set, so that most keys are
# ruled out without hashing them for the set's lookup (the ends found are the same).
END_BITS = 1 << 18


def mark_end(bits: bytearray, key: bytes) -> bool:
    """Set ``key``'s bit in the end prefilter (``_c_mrc.mark_end``'s twin), and say whether
    the key may already be in the end set: its bit was set before (a key under 11 bytes has
    none: True, the compiled scan always looks it up)."""
    if len(key) < 11:
        return True
    b = int.from_bytes(key[8:11], "big") & (END_BITS - 1)
    was = bits[b >> 3] >> (b & 7) & 1
    bits[b >> 3] |= 1 << (b & 7)
    return bool(was)


def end_bits(keys: Iterable[bytes],
             mark: Callable[[bytearray, bytes], bool] = mark_end) -> bytearray:
    """The end prefilter of ``keys`` (``mark``: :func:`mark_end` or its compiled twin)."""
    bits = bytearray(END_BITS // 8)
    for key in keys:
        mark(bits, key)
    return bits


def end_sampled(key: bytes, threshold: int) -> bool:
    """Whether a candidate end's key is under the end threshold (its bytes 4-7, big-endian)."""
    return int.from_bytes(key[4:8], "big") < threshold


def scan(s: Shadow, keys: Sequence[bytes], known: Any = None
         ) -> tuple[list[int] | None, list[int], list[int]]:
    """``Shadow._scan`` without the compiled twin. C-level maps only: no Python step per
    page. ``known``: a match's pending touch (``mrc._Pending``), the same for its pages."""
    n = len(keys)
    limit = s._page_limit
    if known is not None and known[6] == limit:
        k, ends, low = known[0], known[3], known[5]
        if n > k:
            tail = keys[k:]
            low = low + list(compress(range(k, n), map(limit.__gt__, tail)))
            if ends is not None:
                ends = ends + list(compress(range(k, n), map(s._end_set.__contains__, tail)))
    else:
        low = list(compress(range(n), map(limit.__gt__, keys)))  # key < limit
        ends = list(compress(range(n), map(s._end_set.__contains__, keys))) \
            if s.state else None
    if not ends:  # no state (every page a candidate), or no candidate: pages only
        return ends, low, low
    ethr = s.end_threshold
    if ethr < SPACE:
        picked = [i for i in ends if end_sampled(keys[i], ethr)]
    elif not low:  # every end is sampled
        return ends, ends, low
    else:
        picked = ends
    sampled = [i for i in low if i not in ends] + picked if low else picked
    sampled.sort()
    return ends, sampled, low


def reference(s: Shadow, keys: Sequence[bytes], sampled: list[int], ends: list[int] | None,
              last: int, touched: list[int], seen: dict[int, float], thr: list[float],
              top: float, l1_thr: list[float] | None) -> None:
    """A match's reads (``Shadow._reference`` without the compiled twin): each tracked sampled
    page's distance goes into the histograms (and, with an L2, ``thr``/``top``/``l1_thr``
    its tallies); ``touched`` and ``seen`` collect what the match's touch needs. Every sampled
    position counts in the kinds' references; a distance past the last edge reads as
    untracked (``mrc_stack.trim`` drops such pages)."""
    pages, page = s._pages, s.page_size
    tree = s._tree
    clock = s._clock
    edges, hist = s.edges, s._hist
    w_page, w_end = s._w_page, s._w_end
    c1 = s._c1
    overlap = s._overlap
    beyond = len(edges)
    n_page = n_end = 0
    for i in sampled:
        if ends is None:  # every page is a candidate: its own tokens hit at this size
            weight = w_page
            hit = page * weight
            kinds = s._page_kinds
            n_page += 1
        else:
            k = bisect.bisect_left(ends, i)
            if k < len(ends) and ends[k] == i:  # a candidate: the tokens since the one
                weight = w_end  # before it hit at this size
                hit = (i + 1 - (ends[k - 1] + 1 if k else 0)) * page * weight
                kinds = s._end_kinds
                n_end += 1
            else:
                weight = w_page
                hit = 0.0
                kinds = s._page_kinds
                n_page += 1
        code = pages.get(keys[i])
        if code is None:
            continue
        dist = tree.suffix(code >> 1, clock)  # its bytes + newer
        seen[i] = dist
        b = bisect.bisect_left(edges, dist)
        if b == beyond:
            continue
        if i <= last:
            touched.append(i)
        hist[b] += hit
        for h, _ in kinds:
            h[b] += weight
        if overlap:
            if c1 < dist <= top:
                l2_hit, l2_kind = s._l2_hit, s._l2_kind
                for j, t in enumerate(thr):
                    if dist <= t:
                        l2_hit[j] += hit
                        for _, kind in kinds:
                            l2_kind[kind][j] += weight
            if l1_thr is not None:
                for j, t in enumerate(l1_thr):
                    if dist <= t:
                        s._l1_total[j] += hit
    refs = s._kind_refs
    if n_page:
        for _, kind in s._page_kinds:
            refs[kind] += n_page * w_page
    if n_end:
        for _, kind in s._end_kinds:
            refs[kind] += n_end * w_end


def touch(s: Shadow, keys: Sequence[bytes], ends: list[int] | None, sampled: list[int],
          create: bool) -> None:
    """``Shadow._touch`` without an L2 overlap and without the compiled twin (or after it
    gave up: the slots ran out on the way, compacted here)."""
    pages = s._pages
    values, sums = s._tree.values, s._tree.sums
    wb = s._wb
    clock = s._clock
    for i in reversed(sampled):
        key = keys[i]
        code = pages.get(key)
        if code is None:
            if not create:
                continue
            is_end = 1 if ends is not None and i in ends else 0
            s._num_ends += is_end
        else:
            is_end = code & 1
            slot = code >> 1
            if slot >= 0:
                values[slot] -= wb[is_end]
                sums[slot >> SHIFT] -= wb[is_end]
        if clock >= s._slots:
            if code is not None:  # off the stack while the slots are renumbered
                pages[key] = -2 | is_end
            s._clock = clock
            s._compact()
            values, sums, wb = s._tree.values, s._tree.sums, s._wb
            clock = s._clock
        pages[key] = clock << 1 | is_end
        values[clock] = wb[is_end]  # slots at and past the clock are empty
        sums[clock >> SHIFT] += wb[is_end]
        clock += 1
    s._clock = clock
    if len(pages) - s._num_ends > s.max_tracked or s._num_ends > s.max_tracked:
        s._lower_rate()
