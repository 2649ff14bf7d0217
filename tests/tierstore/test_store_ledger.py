"""Block ownership: the ledger records the ids handed out; the cached ids are what the index
names. ``check_integrity`` must still catch every way the three can disagree."""

from __future__ import annotations

import pytest
import torch

from gpu_arena import IntegrityError
from tierstore.errors import ShapeError
from tierstore.radix import Tier

from .conftest import HYBRID, SWA_ONLY, store
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


# An insert passes the caller's ids to the cache before linking them (one set operation checks
# they are the caller's and distinct); every way it can stop first must give them back.
def test_ids_stay_the_callers_when_an_insert_is_refused() -> None:
    s = store(HYBRID)
    put(s, toks(8))
    alloc = s.allocate({"kv": 2, "swa": 2, "state": 1})
    assert alloc is not None
    before = {k: set(v) for k, v in s.ledger.handed.items()}
    kv, swa = alloc["kv"], alloc["swa"]
    for kw in ({"kv": kv, "swa": torch.stack([swa[0], swa[0]])},  # kv fine, swa repeated
               {"kv": torch.stack([kv[0], kv[0]])},  # all held, one repeated
               {"kv": kv, "swa": swa, "state": 10_000}):  # kv, swa fine, state nobody's
        with pytest.raises(ShapeError):
            s.insert(toks(8, 100), **kw)  # type: ignore[arg-type]
        assert s.ledger.handed == before
        s.check_integrity()
    r = s.insert(toks(8, 100), kv=kv, swa=swa, state=alloc["state"])  # still the caller's
    assert r.stored and r.new_pages == 2
    assert all(not v for v in s.ledger.handed.values())
    s.check_integrity()


def test_ids_stay_the_callers_when_the_bytes_beside_them_do_not_fit() -> None:
    s = store(HYBRID)
    put(s, toks(8))
    lease = s.match(toks(8)).lease  # the cached prefix cannot be evicted
    alloc = s.allocate({"kv": 1, "swa": 1})
    assert alloc is not None
    hog = []  # take every other block: nothing is left to evict
    while (more := s.allocate({"state": 1})) is not None:
        hog.append(more)
    before = {k: set(v) for k, v in s.ledger.handed.items()}
    state = torch.zeros(s.arena.spec("state").unit_bytes, dtype=torch.uint8)
    r = s.insert(toks(12), kv=alloc["kv"], swa=alloc["swa"], state=state)
    assert not r.stored
    assert s.ledger.handed == before
    s.check_integrity()
    for kind in ("kv", "swa"):
        s.free(kind, alloc[kind])  # the caller's to free
    s.release(lease)  # type: ignore[arg-type]
    s.check_integrity()


def _adopt_held_by_sets(led: object, kind: str, ids: list[int]) -> bool:
    """What an insert did before Ledger.adopt_held: test the set, remove, restore a repeat."""
    held = led.handed[kind]  # type: ignore[attr-defined]
    if not held.issuperset(ids):
        return False
    before = len(held)
    led.adopt(kind, ids)  # type: ignore[attr-defined]
    if before - len(held) == len(ids):
        return True
    led.hand_out(kind, ids)  # type: ignore[attr-defined]
    return False


def test_fresh_allocations_kept_as_lists_read_as_the_sets_would() -> None:
    """The ledger's shortcut (one allocation held is kept as its list; adopting exactly it
    builds no set) gives what the sets give, whatever else is held, freed, repeated or
    handed out in between, and every read of ``handed`` sees the same set."""
    from tierstore.ledger import Ledger

    steps: list[tuple[str, list[int]]] = [
        ("fresh", [1, 2, 3]), ("held", [1, 2, 3]),  # the shortcut
        ("fresh", [4, 5]), ("fresh", [6, 7]), ("held", [6, 7]),  # 4, 5 still held
        ("held", [4, 5]), ("fresh", [8, 9]), ("take_back", [8]), ("hand_out", [10]),
        ("held", [9, 10]), ("fresh", [11, 12]), ("held", [11, 11]), ("held", [12, 11]),
        ("fresh", [13]), ("spare", [13]), ("held", [13]), ("fresh", [14, 15]),
        ("held", [14]), ("adopt", [15]), ("fresh", [16, 17]), ("read", []),
        ("held", [16, 17]), ("fresh", [18, 19]), ("held", [18, 19, 20]), ("held", [19]),
        ("held", [18]), ("fresh", [21]), ("held", []), ("adopt", [21]), ("fresh", [22]),
        ("held", [22, 22]), ("held", [22]),
    ]

    def run(shortcut: bool) -> list[object]:
        led = Ledger(("kv", "swa"), lambda kind: set())
        out: list[object] = []
        for op, ids in steps:
            if op == "fresh":
                (led.hand_out_fresh if shortcut else led.hand_out)("kv", list(ids))
            elif op == "held":
                out.append(led.adopt_held("kv", list(ids)) if shortcut
                           else _adopt_held_by_sets(led, "kv", list(ids)))
            elif op != "read":  # (adopt, take_back, spare, hand_out: the state below shows it)
                getattr(led, op)("kv", list(ids))
            if op == "read" or not shortcut:  # (reading folds the lists: not after every step)
                out.append(sorted(led.handed["kv"]))
            else:  # (a private look, so as not to fold them)
                out.append(sorted(led._handed["kv"] | set(led._fresh.get("kv", []))))
        return out

    assert run(True) == run(False)
    assert run(True)[1] is True
    led = Ledger(("kv",), lambda kind: set())
    led.hand_out_fresh("kv", [1, 2])
    assert led._fresh == {"kv": [1, 2]} and not led._handed["kv"]
    assert led.handed == {"kv": {1, 2}} and not led._fresh
    with pytest.raises(KeyError):
        led.hand_out_fresh("swa", [3])
