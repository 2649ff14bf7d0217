"""Block ownership: the ledger records the ids handed out; the cached ids are what the index
names. ``check_integrity`` must still catch every way the three can disagree."""

from __future__ import annotations

import pytest

from gpu_arena import IntegrityError
from tierstore.radix import Tier

from .conftest import SWA_ONLY, store
from .test_store import put, toks


def _named_l1(s, kind: str) -> set[int]:  # type: ignore[no-untyped-def]
    return {v for n in s.index.nodes() for v in n.ids(Tier.L1, kind) if v >= 0}


def test_cached_ids_follow_the_index_through_inserts_and_evictions() -> None:
    s = store(SWA_ONLY, capacity=40 * 2 * 1024)  # a few dozen pages: inserts evict
    for i in range(30):
        put(s, toks(24, 1000 * i))
        for kind in s.kinds:
            assert s.ledger.cached(kind) == _named_l1(s, kind)
    assert s.stats().evictions > 0
    held = s.allocate({"kv": 2, "swa": 2})
    assert held is not None
    assert s.ledger.handed["kv"] == set(held["kv"].tolist())
    assert s.ledger.cached("kv").isdisjoint(s.ledger.handed["kv"])
    s.check_integrity()


def test_a_handed_out_block_freed_behind_the_store_is_caught() -> None:
    s = store(SWA_ONLY)
    put(s, toks(16))
    held = s.allocate({"kv": 2})
    assert held is not None
    s.check_integrity()
    s.arena.free_owned("kv", held["kv"].tolist()[:1])  # not through the store
    with pytest.raises(IntegrityError, match="live blocks"):
        s.check_integrity()


def test_an_id_both_cached_and_handed_out_is_caught() -> None:
    s = store(SWA_ONLY)
    put(s, toks(16))
    cached = next(iter(s.ledger.cached("kv")))
    s.ledger.handed["kv"].add(cached)
    with pytest.raises(IntegrityError, match="both cached and handed out"):
        s.check_integrity()


def test_an_id_named_twice_by_the_index_is_caught() -> None:
    s = store(SWA_ONLY)
    put(s, toks(16))
    node = next(iter(s.index.nodes()))
    first = node.ids(Tier.L1, "kv")[0]
    s.index.set(node, Tier.L1, "kv", 1, first)  # two pages name one block
    with pytest.raises(IntegrityError, match="twice"):
        s.check_integrity()
