"""Linking an insert's blocks into the index: which given ids the cache keeps, which it
frees as duplicates, and which SWA pages it drops outside the window.

The store checks ownership first (:func:`tierstore.checks.owned_ids`); this module only
records residency through the index and says what changed hands. Pages before the first
given id are skipped whole (an engine gives only the pages its request computed), and a new
leaf's entries are set as whole columns once it has been touched, so it joins the eviction
queue once, at its final place.
"""

from __future__ import annotations

from typing import NamedTuple

from tierstore.radix import ABSENT, CHECKPOINT, Node, RadixIndex, Segment, Tier

_L1 = int(Tier.L1)  # a plain int: reading an enum member costs ~0.2-0.5 us (more when cold)
_linked = tuple.__new__


class Linked(NamedTuple):
    """What an insert's linking did: the node ending at the prefix, the given ids the cache
    kept and those it did not (to free) per kind, SWA pages dropped outside the window, and
    whether the checkpoint was kept."""

    end: Node
    kept: dict[str, list[int]]
    spare: dict[str, list[int]]
    dropped: int
    checkpoint: bool


def link(index: RadixIndex, keys: list[bytes], path: list[Segment],
         given: dict[str, list[int] | None], n_pages: int, cached: int, *,
         window: int | None, now: float, priority: int, wall: float) -> Linked:
    """Hang the given L1 ids (per kind; ``kv``/``swa`` cover the trailing pages, ``state``
    is one checkpoint) into the tree along ``path`` (the walk of ``keys``, ``cached`` pages
    long), and touch the node ending at the prefix (:meth:`RadixIndex.touch` with ``now``,
    ``priority``, ``wall``; not a hit). ``window``: SWA pages kept before a checkpoint (None:
    all of them)."""
    l1 = _L1
    kv_given, swa_given, state_ids = given["kv"], given["swa"], given["state"]
    end = index.node_ending_at(path)
    # A hybrid match can only end at a checkpoint: SWA pages outside the window before one
    # are never read, so (with window retention) they are not kept.
    keep_from = 0
    if window is not None:
        has_checkpoint = state_ids is not None or (cached == n_pages
                                                   and end.checkpoint(l1) >= 0)
        keep_from = n_pages - window if has_checkpoint else n_pages
    kept: dict[str, list[int]] = {"kv": [], "swa": [], CHECKPOINT: []}
    spare: dict[str, list[int]] = {"kv": [], "swa": [], CHECKPOINT: []}
    dropped = 0
    first = n_pages - max(len(kv_given or ()), len(swa_given or ()))  # first given page
    # Pages already cached keep the cache's ids; SWA tombstones refill. (An engine gives only
    # the pages past its match: then no given id falls on a cached page.)
    if first < cached:
        if path[-1].node is not end:  # split: the path's last node is the upper part
            path = [*path[:-1], Segment(end, path[-1].pages)]
        _relink(index, path, _padded(kv_given, n_pages), _padded(swa_given, n_pages), first,
                keep_from, kept, spare)
    touched = False
    if cached < n_pages:
        new_kv, new_swa = _tail(kv_given, n_pages, cached), _tail(swa_given, n_pages, cached)
        if keep_from > cached:
            for i in range(min(len(new_swa), keep_from - cached)):
                if new_swa[i] >= 0:
                    spare["swa"].append(new_swa[i])
                    new_swa[i] = ABSENT
                    dropped += 1
        # the kept ids first: the lists become the leaf's columns (and count its entries)
        kv_kept = new_kv if ABSENT not in new_kv else [i for i in new_kv if i >= 0]
        swa_kept = new_swa if ABSENT not in new_swa else [i for i in new_swa if i >= 0]
        kept["kv"] += kv_kept
        kept["swa"] += swa_kept
        end = index.grow(end, keys[cached:], l1, {"kv": new_kv, "swa": new_swa},
                         len(kv_kept) + len(swa_kept), now, priority, wall)
        touched = True
    checkpoint = False
    if state_ids is not None:
        sid = state_ids[0]
        if end.checkpoint(l1) < 0:
            index.set(end, l1, CHECKPOINT, 0, sid)
            kept[CHECKPOINT].append(sid)
            checkpoint = True
        elif end.checkpoint(l1) != sid:
            spare[CHECKPOINT].append(sid)
    if not touched:
        index.touch(end, now, priority, hit=False, wall=wall)
    return _linked(Linked, (end, kept, spare, dropped, checkpoint))  # (no __new__ frame)


def _relink(index: RadixIndex, path: list[Segment], kv_ids: list[int], swa_ids: list[int],
            first: int, keep_from: int, kept: dict[str, list[int]],
            spare: dict[str, list[int]]) -> None:
    """The given ids (per page, from page ``first`` on) that fall on cached pages of
    ``path``: each fills an absent entry (kept) or is a duplicate (spare)."""
    l1 = _L1
    pos = 0
    for seg in path:
        n = seg.node
        if pos + seg.pages <= first:
            pos += seg.pages
            continue
        kv_col, swa_col = n.ids(l1, "kv"), n.ids(l1, "swa")
        for j in range(max(0, first - pos), seg.pages):
            p = pos + j
            kid, sid = kv_ids[p], swa_ids[p]
            if kid >= 0:
                if kv_col[j] < 0:  # cached elsewhere or lost: take it
                    index.set(n, l1, "kv", j, kid)
                    kept["kv"].append(kid)
                elif kid != kv_col[j]:
                    spare["kv"].append(kid)
            if sid >= 0 and sid != swa_col[j]:
                if swa_col[j] < 0 and p >= keep_from:
                    index.set(n, l1, "swa", j, sid)
                    kept["swa"].append(sid)
                else:
                    spare["swa"].append(sid)
        pos += seg.pages


def _tail(ids: list[int] | None, n_pages: int, start: int) -> list[int]:
    """``_padded(ids, n_pages)[start:]`` (a new list), without padding the pages before."""
    if ids is None:
        return [ABSENT] * (n_pages - start)
    skip = len(ids) - (n_pages - start)
    return ids[skip:] if skip >= 0 else [ABSENT] * -skip + ids


def _padded(ids: list[int] | None, n_pages: int) -> list[int]:
    """Per-page ids for pages ``[0, n_pages)``; given ids cover the trailing pages."""
    if ids is None:
        return [ABSENT] * n_pages
    return [ABSENT] * (n_pages - len(ids)) + ids
