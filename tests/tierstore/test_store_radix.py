"""The index's residency columns: nodes share read-only empty columns until their first write
to a tier, so a write must never show through another node (or another tier)."""

from __future__ import annotations

import random

from tierstore.eviction import LRU
from tierstore.integrity import check_index
from tierstore.radix import ABSENT, CHECKPOINT, TIERS, RadixIndex, Tier


def _keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) for i in range(n)]


def test_a_write_shows_only_in_its_node_and_tier() -> None:
    index = RadixIndex(LRU().key)
    a = index.extend(index.root, _keys(1, 4))
    b = index.extend(index.root, _keys(2, 4))  # same length: same shared empty columns
    index.set(a, Tier.L1, "kv", 2, 7)
    index.set_many(b, Tier.L2, "swa", [0, 3], [5, 6])
    assert list(a.ids(Tier.L1, "kv")) == [ABSENT, ABSENT, 7, ABSENT]
    assert list(b.ids(Tier.L1, "kv")) == [ABSENT] * 4
    assert list(b.ids(Tier.L2, "swa")) == [5, ABSENT, ABSENT, 6]
    assert list(a.ids(Tier.L2, "swa")) == [ABSENT] * 4
    for tier in (Tier.L3, Tier.DISK):
        assert list(a.ids(tier, "kv")) == list(b.ids(tier, "swa")) == [ABSENT] * 4
    c = index.extend(index.root, _keys(3, 4))  # a node made after the writes starts empty
    assert all(list(c.ids(t, k)) == [ABSENT] * 4 for t in TIERS for k in ("kv", "swa"))
    assert a.holds(Tier.L1) and not a.holds(Tier.L2) and b.holds(Tier.L2)
    check_index(index)


def test_clear_fill_and_split_keep_columns_apart() -> None:
    index = RadixIndex(LRU().key)
    a = index.extend(index.root, _keys(1, 6), {"kv": [0, 1, 2, 3, 4, 5],
                                                "swa": [ABSENT, ABSENT, 8, 9, 10, 11]})
    index.set(a, Tier.L1, CHECKPOINT, 0, 40)
    index.set(a, Tier.L3, "kv", 1, 1)
    upper = index.split(a, 2)  # L1 and L3 written, L2 and disk still shared
    assert list(upper.ids(Tier.L1, "kv")) == [0, 1] and list(a.ids(Tier.L1, "kv")) == [2, 3, 4, 5]
    assert list(upper.ids(Tier.L3, "kv")) == [ABSENT, 1]
    assert list(a.ids(Tier.L2, "kv")) == [ABSENT] * 4 and a.checkpoint(Tier.L1) == 40
    check_index(index)
    removed = index.clear(a, Tier.L1)
    assert removed == {"kv": [2, 3, 4, 5], "swa": [8, 9, 10, 11], CHECKPOINT: [40]}
    assert list(a.ids(Tier.L1, "swa")) == [ABSENT] * 4 and not a.holds(Tier.L1)
    assert index.clear(a, Tier.L2) == {"kv": [], "swa": [], CHECKPOINT: []}  # never written
    index.fill(a, Tier.L1, {"kv": [20, 21, ABSENT, 23]})  # the emptied columns fill again
    assert list(a.ids(Tier.L1, "kv")) == [20, 21, ABSENT, 23]
    assert list(a.ids(Tier.L1, "swa")) == [ABSENT] * 4
    assert list(upper.ids(Tier.L1, "kv")) == [0, 1]
    check_index(index)


def _walk_by_key(index: RadixIndex, keys: list[bytes]) -> list[tuple[int, int]]:
    """The walk's definition, one key at a time: (node serial, pages matched) per node."""
    out: list[tuple[int, int]] = []
    node, j = index.root, 0
    for key in keys:
        if j == len(node.keys):  # at the node's end: step into the child for this key
            child = node.children.get(key)
            if child is None:
                break
            node, j = child, 0
            out.append((node.serial, 0))
        elif node.keys[j] != key:
            break
        out[-1] = (node.serial, out[-1][1] + 1)
        j += 1
    return out


def test_walk_is_the_longest_present_run_key_by_key() -> None:
    rng = random.Random(5)
    for _ in range(100):
        index = RadixIndex(LRU().key)
        runs: list[list[bytes]] = []
        for _ in range(rng.randint(1, 10)):  # branches off earlier runs, splitting nodes
            base = rng.choice(runs)[: rng.randint(0, 8)] if runs and rng.random() < 0.7 else []
            run = base + [bytes([rng.randrange(3), rng.randrange(256)])
                          for _ in range(rng.randint(1, 6))]
            runs.append(run)
            path = index.walk(run)
            end = index.node_ending_at(path)
            pos = sum(seg.pages for seg in path)
            if pos < len(run):
                index.extend(end, run[pos:])
        check_index(index)
        for _ in range(30):
            query = rng.choice(runs)[: rng.randint(0, 12)] + [
                bytes([rng.randrange(3), rng.randrange(256)]) for _ in range(rng.randint(0, 2))]
            want = _walk_by_key(index, query)
            for keys in (query, tuple(query)):  # a whole node compares in one step for lists
                got = [(seg.node.serial, seg.pages) for seg in index.walk(keys)]
                assert got == want, (query, got, want)
