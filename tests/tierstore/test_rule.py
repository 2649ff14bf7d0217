"""The hybrid match rule's per-segment scans (tierstore.rule) against a per-page reading of
the same rule, on random residency over random paths (partial last segments included)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import rule
from tierstore.eviction import LRU
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
    index = RadixIndex(LRU().key)
    parent, path = index.root, []
    for i, n in enumerate(sizes):
        keys = [bytes([i, j]) for j in range(n)]
        node = index.extend(parent, keys)
        for tier in TIERS:
            for kind in ("kv", "swa"):
                index.set_many(node, tier, kind, range(n),
                               data.draw(st.lists(_entry, min_size=n, max_size=n)))
            index.set(node, tier, "state", 0, data.draw(_entry))
        path.append(Segment(node, n))
        parent = node
    last = data.draw(st.integers(1, sizes[-1]))  # a walk may stop inside the last node
    path[-1] = Segment(path[-1].node, last)
    index.check_integrity()
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
