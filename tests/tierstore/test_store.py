"""TierStore on L1: hybrid match rules, eviction order and stopping rules, leases, bad input."""

from __future__ import annotations

import pytest
import torch

from tierstore.errors import LeaseError, NamespaceError, ShapeError, TokenError
from tierstore.store import TierStore

from .conftest import FULL_ONLY, HYBRID, PAGE, SWA_ONLY, store


def put(s: TierStore, tokens: list[int], ns: str = "default", *, checkpoint: bool = True,
        swa_pages: int | None = None, priority: int = 0) -> None:
    """Insert ``tokens`` with fresh blocks (state checkpoint when the layout has one)."""
    n = len(tokens) // PAGE
    swa = n if swa_pages is None else swa_pages
    demand = {"kv": n}
    if "swa" in s.kinds:
        demand["swa"] = swa
    if "state" in s.kinds and checkpoint:
        demand["state"] = 1
    alloc = s.allocate(demand)
    assert alloc is not None
    s.insert(tokens, ns, kv=alloc["kv"], swa=alloc["swa"] if "swa" in s.kinds else None,
             state=alloc["state"] if "state" in demand else None, priority=priority)
    s.check_integrity()


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# ------------------------------------------------------------------ hybrid match rule
def test_match_ends_at_the_deepest_checkpoint(hybrid: TierStore) -> None:
    put(hybrid, toks(8))
    put(hybrid, toks(16))
    m = hybrid.match(toks(20))
    assert (m.tokens, m.pages, m.kv_pages_found) == (16, 4, 4)
    assert m.state is not None and m.lease is not None
    hybrid.release(m.lease)
    # A request diverging after 12 tokens: no checkpoint at 12, the one at 8 is usable.
    m = hybrid.match(toks(12) + [999] * 8)
    assert (m.tokens, m.kv_pages_found) == (8, 3)
    hybrid.release(m.lease)
    hybrid.check_integrity()


def test_no_checkpoint_means_no_hybrid_hit(hybrid: TierStore) -> None:
    put(hybrid, toks(16), checkpoint=False)
    m = hybrid.match(toks(16))
    assert m.tokens == 0 and m.lease is None and m.kv_pages_found == 4


def test_window_swa_pages_kept_and_older_ones_tombstoned(hybrid: TierStore) -> None:
    put(hybrid, toks(16))  # window 8 tokens = 2 pages: pages 2, 3 keep SWA
    m = hybrid.match(toks(16))
    assert (m.swa >= 0).tolist() == [False, False, True, True]
    hybrid.release(m.lease)
    assert hybrid.arena.num_live("swa") == 2


def test_missing_swa_window_falls_back_to_an_earlier_checkpoint() -> None:
    s = store(HYBRID)
    put(s, toks(8))
    put(s, toks(16), swa_pages=1)  # only page 3's SWA: page 2 of the window is missing
    m = s.match(toks(16))
    assert m.tokens == 8
    s.release(m.lease)


def test_swa_only_model_matches_at_any_page_with_its_window() -> None:
    s = store(SWA_ONLY)
    put(s, toks(16))
    m = s.match(toks(14))  # three full pages of the query
    assert m.tokens == 12 and m.state is None and (m.swa >= 0).all()
    s.release(m.lease)
    s2 = store(SWA_ONLY)
    put(s2, toks(16), swa_pages=1)  # pages 0-2 have no SWA
    m = s2.match(toks(16))
    assert m.tokens == 0 and m.kv_pages_found == 4  # no end has its 2-page window
    assert s2.match(toks(14)).tokens == 0


def test_full_attention_model_needs_no_state() -> None:
    s = store(FULL_ONLY)
    put(s, toks(12))
    m = s.match(toks(10))
    assert m.tokens == 8 and m.state is None
    s.release(m.lease)


def test_namespaces_never_share_pages(hybrid: TierStore) -> None:
    put(hybrid, toks(16), "tenant-a")
    assert hybrid.match(toks(16), "tenant-b").tokens == 0
    m = hybrid.match(toks(16), "tenant-a")
    assert m.tokens == 16
    hybrid.release(m.lease)


# ------------------------------------------------------------------ eviction
def _capacity_for(s: TierStore, prefixes: int) -> int:
    units = {k: s.arena.spec(k).unit_bytes for k in s.kinds}
    return prefixes * (2 * units["kv"] + units["state"]) + 256


def fill(rule: str = "unified", policy: str = "lru", prefixes: int = 4) -> TierStore:
    """A full-attention + state store that holds exactly ``prefixes`` prefixes of two pages."""
    cfg = {**HYBRID, "layer_types": ["full_attention", "linear_attention"],
           "linear_key_head_dim": 16, "linear_value_head_dim": 16}  # state > 2 KV pages
    probe = store(cfg)
    s = store(cfg, capacity=_capacity_for(probe, prefixes), stop_rule=rule, eviction=policy)
    for i in range(prefixes):
        put(s, toks(8, 1000 * i), priority=i % 2)
    return s


def cached(s: TierStore, prefixes: int = 4) -> list[int]:
    return [i for i in range(prefixes) if s.peek(toks(8, 1000 * i))]


def test_lru_evicts_in_last_use_order() -> None:
    s = fill()
    for i in (2, 0):  # use 2 then 0: LRU order is now 1, 3, 2, 0
        s.release(s.match(toks(8, 1000 * i)).lease)  # type: ignore[arg-type]
    assert s.allocate({"kv": 2, "state": 1}) is not None
    assert cached(s) == [0, 2, 3]  # only prefix 1 went
    assert s.allocate({"kv": 4, "state": 2}) is not None
    assert cached(s) == [0]  # then 3 and 2, in that order
    s.check_integrity()


def test_lfu_evicts_fewest_hits_first() -> None:
    s = fill(policy="lfu")
    for i, hits in ((0, 3), (1, 1), (3, 2)):
        for _ in range(hits):
            s.release(s.match(toks(8, 1000 * i)).lease)  # type: ignore[arg-type]
    assert s.allocate({"kv": 2, "state": 1}) is not None
    assert cached(s) == [0, 1, 3]  # prefix 2 had no hits


def test_priority_evicts_low_priority_first() -> None:
    s = fill(policy="priority")  # priorities 0, 1, 0, 1
    assert s.allocate({"kv": 4, "state": 2}) is not None
    assert cached(s) == [1, 3]


def test_locked_prefixes_survive_pressure() -> None:
    s = fill()
    lease = s.match(toks(8, 0)).lease
    assert s.allocate({"kv": 6, "state": 3}) is not None  # everything else must go
    m = s.match(toks(8, 0))
    assert m.tokens == 8
    assert s.allocate({"kv": 2, "state": 1}) is None  # only locked blocks remain
    s.release(m.lease)  # type: ignore[arg-type]
    s.release(lease)  # type: ignore[arg-type]
    s.check_integrity()


def test_unified_stops_earlier_than_per_kind() -> None:
    """Each prefix frees 2 KV pages and a state block worth several pages. Asking for 4 KV
    pages: unified stops after the first eviction (its state bytes make room); per-kind counts
    only KV pages and evicts two prefixes."""
    unified, per_kind = fill("unified"), fill("per_kind")
    assert unified.arena.spec("state").unit_bytes >= 2 * unified.arena.spec("kv").unit_bytes
    assert unified.allocate({"kv": 4}) is not None
    assert per_kind.allocate({"kv": 4}) is not None
    assert unified.stats().evictions == 1 and cached(unified) == [1, 2, 3]
    assert per_kind.stats().evictions == 2 and cached(per_kind) == [2, 3]


def test_allocate_none_when_nothing_can_be_evicted() -> None:
    s = fill()
    before = s.arena.stats().pools["kv"].live_blocks
    assert s.allocate({"kv": 10_000}) is None
    assert s.arena.num_live("kv") <= before
    s.check_integrity()


# ------------------------------------------------------------------ bytes, leases, errors
def random_envelopes(s: TierStore, seed: int) -> tuple[torch.Tensor, ...]:
    """Random bytes for 4 KV pages, the 2-page SWA window and one checkpoint."""
    units = {k: s.arena.spec(k).unit_bytes for k in s.kinds}
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (4, units["kv"]), dtype=torch.uint8, generator=g),
            torch.randint(0, 256, (2, units["swa"]), dtype=torch.uint8, generator=g),
            torch.randint(0, 256, (units["state"],), dtype=torch.uint8, generator=g))


def test_insert_bytes_round_trip_and_dedupe(hybrid: TierStore) -> None:
    kv, swa, state = random_envelopes(hybrid, seed=0)
    r = hybrid.insert(toks(16), kv=kv, swa=swa, state=state)
    assert r.stored and r.new_pages == 4 and r.checkpoint
    m = hybrid.match(toks(16))
    assert torch.equal(hybrid.arena.read("kv", m.kv), kv)
    assert torch.equal(hybrid.arena.read("swa", m.swa[2:]), swa)
    assert torch.equal(hybrid.arena.read("state", [m.state])[0], state)
    again = hybrid.insert(toks(16), kv=kv, swa=swa, state=state)
    assert again.new_pages == 0 and again.cached_pages == 4
    hybrid.release(m.lease)  # type: ignore[arg-type]
    hybrid.check_integrity()


def test_lease_misuse_raises(hybrid: TierStore) -> None:
    put(hybrid, toks(8))
    m = hybrid.match(toks(8))
    hybrid.release(m.lease)  # type: ignore[arg-type]
    with pytest.raises(LeaseError):
        hybrid.release(m.lease)  # type: ignore[arg-type]
    with pytest.raises(LeaseError):
        store().release(hybrid.match(toks(8)).lease)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s, a: s.insert([1, "x", 3, 4], kv=a["kv"][:1]), TokenError),
        (lambda s, a: s.insert(toks(8), "bad ns", kv=a["kv"]), NamespaceError),
        (lambda s, a: s.insert(toks(8), kv=a["kv"][:1]), ShapeError),
        (lambda s, a: s.insert(toks(8), kv=a["kv"], state=a["state"][0] + 50), ShapeError),
        (lambda s, a: s.insert(toks(9), kv=a["kv"], state=a["state"]), ShapeError),
        (lambda s, a: s.insert(toks(8), kv=torch.zeros(2, 7, dtype=torch.uint8)), ShapeError),
        (lambda s, a: s.insert(toks(8), kv=[a["kv"][0], a["kv"][0]]), ShapeError),
        (lambda s, a: s.insert(toks(8), kv=torch.tensor([0.5, 1.5])), ShapeError),
        (lambda s, a: s.allocate({"nope": 1}), ShapeError),
        (lambda s, a: s.allocate({"kv": -1}), ShapeError),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, error) -> None:  # type: ignore[no-untyped-def]
    s = store()
    put(s, toks(8, 500))
    alloc = s.allocate({"kv": 2, "swa": 2, "state": 1})
    before = (s.stats(), s.index.num_pages, {k: s.arena.num_live(k) for k in s.kinds})
    with pytest.raises(error):
        call(s, alloc)
    after = (s.stats(), s.index.num_pages, {k: s.arena.num_live(k) for k in s.kinds})
    assert before == after
    s.check_integrity()


def test_cache_ids_cannot_be_stolen_by_another_prefix(hybrid: TierStore) -> None:
    put(hybrid, toks(8))
    m = hybrid.match(toks(8))
    with pytest.raises(ShapeError, match="other cached pages"):
        hybrid.insert(toks(8, 100), kv=m.kv)
    with pytest.raises(ShapeError, match="belong to the cache"):
        hybrid.free("kv", m.kv)
    hybrid.release(m.lease)  # type: ignore[arg-type]
    hybrid.check_integrity()


def test_a_cached_checkpoint_cannot_be_given_to_a_longer_prefix(hybrid: TierStore) -> None:
    # The checkpoint the cache holds at 8 tokens is the caller's to pass back only for an
    # insert ending at those 8 tokens; at 12 it would name one block at two nodes.
    put(hybrid, toks(8))
    m = hybrid.match(toks(8))
    assert m.state is not None
    more = hybrid.allocate({"kv": 1, "swa": 1})
    assert more is not None
    with pytest.raises(ShapeError, match="other cached pages"):
        hybrid.insert(toks(12), kv=more["kv"], swa=more["swa"], state=m.state)
    again = hybrid.insert(toks(8), kv=m.kv, swa=m.swa, state=m.state)  # its own end: fine
    assert again.stored and again.duplicates_freed == 0
    hybrid.release(m.lease)  # type: ignore[arg-type]
    hybrid.check_integrity()


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "xla"])
def test_bad_device_is_a_config_error(device: str) -> None:
    from tierstore.config import StoreConfig

    with pytest.raises(ValueError, match="device"):
        StoreConfig(capacity_bytes=1 << 20, device=device)


# ------------------------------------------------------------------ engine-shaped calls
def test_insert_takes_only_the_new_pages_after_a_match(hybrid: TierStore) -> None:
    put(hybrid, toks(8))
    m = hybrid.match(toks(16))
    assert m.pages == 2
    alloc = hybrid.allocate({"kv": 2, "swa": 2, "state": 1})
    assert alloc is not None
    r = hybrid.insert(toks(16), kv=alloc["kv"], swa=alloc["swa"], state=alloc["state"])
    assert (r.new_pages, r.cached_pages, r.checkpoint) == (2, 2, True)
    hybrid.release(m.lease)  # type: ignore[arg-type]
    full = hybrid.match(toks(16))
    assert full.pages == 4 and full.kv[2:].tolist() == alloc["kv"].tolist()
    hybrid.release(full.lease)  # type: ignore[arg-type]
    hybrid.check_integrity()


def test_trailing_pages_need_the_leading_ones_cached(hybrid: TierStore) -> None:
    put(hybrid, toks(8))
    alloc = hybrid.allocate({"kv": 1})
    assert alloc is not None
    before = (hybrid.stats(), hybrid.index.num_pages)
    with pytest.raises(ShapeError, match="the first 2 pages are cached"):
        hybrid.insert(toks(16), kv=alloc["kv"])  # pages 2 and 3 are new: two ids needed
    with pytest.raises(ShapeError, match="need 4 envelopes"):
        hybrid.insert(toks(16, 900), kv=alloc["kv"])  # nothing cached: every page
    assert (hybrid.stats(), hybrid.index.num_pages) == before
    hybrid.free("kv", alloc["kv"])
    hybrid.check_integrity()


def test_read_prefix_pins_the_matched_rows_until_closed(hybrid: TierStore) -> None:
    kv, swa, state = random_envelopes(hybrid, seed=1)
    hybrid.insert(toks(16), kv=kv, swa=swa, state=state)
    with hybrid.read_prefix(toks(17)) as read:
        assert read.match.pages == 4
        assert torch.equal(torch.stack(read.rows["kv"]), kv)  # type: ignore[arg-type]
        assert read.rows["swa"][:2] == [None, None]  # outside the window: tombstones
        assert torch.equal(torch.stack(read.rows["swa"][2:]), swa)  # type: ignore[arg-type]
        assert torch.equal(read.rows["state"][0], state)  # type: ignore[arg-type]
        assert hybrid.arena.stats().pending_fences == 3  # kv, swa, state rows fenced
        assert hybrid.allocate({"kv": 10_000}) is None  # leased: nothing to evict
        assert hybrid.peek(toks(16)) == 16
    assert hybrid.arena.stats().pending_fences == 0
    read.close()  # idempotent
    assert hybrid.allocate({"kv": 10_000}) is None  # never fits, but evicts what is unleased
    assert hybrid.peek(toks(16)) == 0  # the lease is gone: the prefix was evicted
    hybrid.check_integrity()
