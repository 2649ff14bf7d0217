"""The hybrid match rule's per-segment scans (tierstore.rule) against a per-page reading of
the same rule, on random residency over random paths (partial last segments included)."""

from __future__ import annotations

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tierstore import rule
from tierstore.eviction import LRU
from tierstore.integrity import check_index
from tierstore.radix import ABSENT, TIERS, RadixIndex, Segment, Tier


def _spec(path: list[Segment], tiers: tuple[int, ...], swa: bool, state: bool, window: int
          ) -> tuple[int, int]:
    """The rule read page by page (the store's reading before the per-segment scans)."""
    def present(kind: str) -> list[bool]:
        return [any(seg.node.ids(t, kind)[j] >= 0 for t in tiers)
                for seg in path for j in range(seg.pages)]

    kv = present("kv")
    found = next((i for i, ok in enumerate(kv) if not ok), len(kv))
    on = present("swa") if swa else []

    def window_ok(end: int) -> bool:
        return not swa or all(on[max(0, end - window):end])

    if state:
        for seg in reversed(path):
            n = seg.node
            if (seg.pages == len(n.keys) and n.end <= found
                    and any(n.checkpoint(t) >= 0 for t in tiers) and window_ok(n.end)):
                return n.end, found
        return 0, found
    end = found
    while end > 0 and not window_ok(end):
        end -= 1
    return end, found


_entry = st.sampled_from([1, ABSENT, 0, ABSENT, 7])  # held or not (any value >= 0 is held)


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5), data=st.data(),
       swa=st.booleans(), state=st.booleans(), window=st.integers(0, 7),
       tiers=st.sampled_from([(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), (2, 3)]))
def test_per_segment_rule_agrees_with_the_per_page_rule(
        sizes: list[int], data: st.DataObject, swa: bool, state: bool, window: int,
        tiers: tuple[int, ...]) -> None:
    path = _random_path(sizes, data, _entry)
    got = rule.usable(path, tiers, swa=swa, state=state, window=window)
    assert got == _spec(path, tiers, swa, state, window)
    pages = got[0]
    for kind in ("kv", "swa"):
        start = data.draw(st.integers(-3, pages + 1))
        want = all(seg.node.ids(Tier.L1, kind)[j] >= 0
                   for pos, seg in zip(_starts(path), path, strict=True)
                   for j in range(seg.pages) if start <= pos + j < pages)
        assert rule.in_l1(path, pages, kind, start) == want
    cut = rule.cut(path, pages)
    assert sum(s.pages for s in cut) == pages
    assert rule.l1_ids(cut, "kv").tolist() == [seg.node.ids(Tier.L1, "kv")[j] for seg in cut
                                                for j in range(seg.pages)]


def _starts(path: list[Segment]) -> list[int]:
    out, pos = [], 0
    for seg in path:
        out.append(pos)
        pos += seg.pages
    return out


def _random_path(sizes: list[int], data: st.DataObject, entry: st.SearchStrategy[int]
                 ) -> list[Segment]:
    """A path through fresh nodes of ``sizes`` pages with ``entry`` residency in every tier
    (the last segment may stop inside its node, as a walk may)."""
    index = RadixIndex(LRU().key)
    parent, path = index.root, []
    for i, n in enumerate(sizes):
        keys = [bytes([i, j]) for j in range(n)]
        node = index.extend(parent, keys)
        for tier in TIERS:
            for kind in ("kv", "swa"):
                index.set_many(node, tier, kind, range(n),
                               data.draw(st.lists(entry, min_size=n, max_size=n)))
            index.set(node, tier, "state", 0, data.draw(entry))
        path.append(Segment(node, n))
        parent = node
    last = data.draw(st.integers(1, sizes[-1]))
    path[-1] = Segment(path[-1].node, last)
    check_index(index)
    return path


# mostly held in L1, so the all-L1 case comes up often
_mostly_held = st.sampled_from([1, 0, 7, 3, 2, 5, 9, 4, 8, 6, 11, 12, 13, ABSENT])


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), max_size=4), data=st.data(), swa=st.booleans(),
       state=st.booleans(), window=st.integers(0, 7))
def test_held_in_l1_is_the_rule_promote_and_ids_of_an_all_l1_path(
        sizes: list[int], data: st.DataObject, swa: bool, state: bool, window: int) -> None:
    """held_in_l1 answers exactly when L1 holds all the rule and a promotion need for the
    whole path (SWA pages outside the window may be tombstones), and then gives the rule's
    answer and l1_ids' ids in one pass."""
    path = _random_path(sizes, data, _mostly_held) if sizes else []
    total = sum(seg.pages for seg in path)
    last = path[-1] if path else None
    all_l1 = bool(path) and rule.in_l1(path, total, "kv") \
        and (not swa or rule.in_l1(path, total, "swa", total - window)) \
        and (not state or (last is not None and last.pages == len(last.node.keys)
                           and last.node.checkpoint(Tier.L1) >= 0))
    held = rule.held_in_l1(path, swa=swa, state=state, window=window)
    assert (held is not None) == all_l1
    event(f"held: {held is not None}")
    if held is None:
        return
    pages, kv, sw = held
    assert pages == total
    for tiers in ((1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), (1, 2, 4)):
        assert rule.usable(path, tiers, swa=swa, state=state, window=window) == (total, total)
    assert rule.in_l1(path, total, "swa", total - window) or not swa
    assert kv.dtype == sw.dtype == torch.long
    assert kv.tolist() == rule.l1_ids(path, "kv").tolist()
    assert sw.tolist() == rule.l1_ids(path, "swa").tolist()
