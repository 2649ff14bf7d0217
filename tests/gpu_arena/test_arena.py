"""Unit tests of the unified arena's mechanism: bands, ids, compaction, fences, views."""

from __future__ import annotations

import pytest
import torch

from gpu_arena import Arena, ArenaError, PoolSpec
from gpu_arena.pool import Pool

U = 256  # one "unit" of the design notes' capacity example


def three_pools(capacity: int = 64 * U) -> Arena:
    return Arena(capacity, [PoolSpec("state", 2 * U, "low"), PoolSpec("swa", U, "float"),
                            PoolSpec("kv", U, "high")])


def fill(arena: Arena, pool: str, ids: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (len(ids), arena.spec(pool).unit_bytes), dtype=torch.uint8,
                         generator=g)
    arena.write(pool, ids, data)
    return data


# ----------------------------------------------------------------- capacity example
def admitted(arena_or_split: Arena | tuple[Arena, Arena], state: int, kv: int, offered: int) -> int:
    """How many of ``offered`` requests (``state`` state units + ``kv`` KV units each) fit."""
    n = 0
    for _ in range(offered):
        if isinstance(arena_or_split, Arena):
            a = arena_or_split
            if not a.can_alloc({"state": state, "kv": kv}):
                break
            assert a.alloc("state", state) is not None and a.alloc("kv", kv) is not None
        else:
            s, k = arena_or_split
            if not (s.can_alloc({"state": state}) and k.can_alloc({"kv": kv})):
                break
            assert s.alloc("state", state) is not None and k.alloc("kv", kv) is not None
        n += 1
    return n


def shared(units: int) -> Arena:
    return Arena(units * U, [PoolSpec("state", U, "low"), PoolSpec("kv", U, "high")])


def fixed_split(state_units: int, kv_units: int) -> tuple[Arena, Arena]:
    return (Arena(state_units * U, [PoolSpec("state", U, "low")]),
            Arena(kv_units * U, [PoolSpec("kv", U, "high")]))


def test_capacity_example_short_requests() -> None:
    """24 units; each request needs 2 units of state and 1 of KV. A fixed 8/16 split admits 4 of
    the 7 requests in the picture (state full, 12 KV units idle); the shared arena admits all 7
    (21 units) — and an 8th would still fit (24 units)."""
    assert admitted(fixed_split(8, 16), state=2, kv=1, offered=7) == 4
    assert admitted(shared(24), state=2, kv=1, offered=7) == 7
    assert admitted(shared(24), state=2, kv=1, offered=100) == 8


def test_max_bytes_caps_a_pool_like_a_fixed_split() -> None:
    """The same 24 units with caps of 8 state / 16 KV units behave like the fixed split."""
    capped = Arena(24 * U, [PoolSpec("state", U, "low", max_bytes=8 * U),
                            PoolSpec("kv", U, "high", max_bytes=16 * U)])
    assert admitted(capped, state=2, kv=1, offered=7) == 4
    assert capped.max_alloc("state") == 0 and capped.max_alloc("kv") == 12
    capped.check_integrity()


def test_capacity_example_long_context() -> None:
    """The opposite failure: long requests need 2 state + 6 KV units. The 8/16 split runs out of
    KV after 2 (state has room for 4); the arena fits 3 (24 units)."""
    assert admitted(fixed_split(8, 16), state=2, kv=6, offered=10) == 2
    assert admitted(shared(24), state=2, kv=6, offered=10) == 3


# ----------------------------------------------------------------- bands and ids
def test_bands_grow_from_both_ends_and_float_between() -> None:
    a = three_pools()
    s, k, w = a.alloc("state", 3), a.alloc("kv", 4), a.alloc("swa", 2)
    assert s is not None and k is not None and w is not None
    st = a.stats().pools
    assert st["state"].band_start == 0 and st["state"].band_end == 3 * 2 * U
    assert st["kv"].band_end == 64 * U and st["kv"].band_start == 60 * U
    assert st["state"].band_end <= st["swa"].band_start < st["swa"].band_end <= st["kv"].band_start
    assert a.stats().gap_bytes == 64 * U - (6 + 4 + 2) * U
    a.check_integrity()


def test_alloc_returns_none_and_changes_nothing_when_full() -> None:
    a = three_pools(8 * U)
    assert a.alloc("kv", 6) is not None
    before = a.stats()
    assert a.alloc("state", 2) is None  # needs 4 units, 2 left
    assert not a.can_alloc({"state": 2})
    assert a.can_alloc({"state": 1}) and a.can_alloc({"swa": 2})
    assert not a.can_alloc({"state": 1, "swa": 1})  # jointly 3 units
    assert a.stats() == before
    assert a.max_alloc("kv") == 2 and a.max_alloc("state") == 1 and a.max_alloc("swa") == 2
    a.check_integrity()


@pytest.mark.parametrize("bad", [[99], [0, 0], [-1], torch.tensor([0.5]), [[0]]])
def test_free_rejects_foreign_repeated_and_malformed_ids(bad: object) -> None:
    a = three_pools()
    ids = a.alloc("kv", 2)
    assert ids is not None
    data = fill(a, "kv", ids, 1)
    if bad == [0, 0]:
        a.free("kv", [0])
    with pytest.raises(ArenaError):
        a.free("kv", bad)  # type: ignore[arg-type]
    live = [i for i in ids.tolist() if not (bad == [0, 0] and i == 0)]
    assert a.num_live("kv") == len(live)
    assert torch.equal(a.read("kv", live), data[[ids.tolist().index(i) for i in live]])
    a.check_integrity()


def test_double_free_raises_and_unknown_pool_is_named() -> None:
    a = three_pools()
    ids = a.alloc("state", 1)
    a.free("state", ids)
    with pytest.raises(ArenaError, match="not live"):
        a.free("state", ids)
    with pytest.raises(ArenaError, match="unknown pool 'nope'"):
        a.alloc("nope", 1)
    with pytest.raises(ArenaError, match="non-negative int"):
        a.alloc("kv", -1)


def test_write_rejects_wrong_shape_and_writes_nothing() -> None:
    a = three_pools()
    ids = a.alloc("kv", 2)
    data = fill(a, "kv", ids, 2)
    with pytest.raises(ArenaError, match="uint8"):
        a.write("kv", ids, torch.zeros(2, U + 1, dtype=torch.uint8))
    with pytest.raises(ArenaError):
        a.write("kv", ids, torch.zeros(2, U, dtype=torch.float32))
    assert torch.equal(a.read("kv", ids), data)


@pytest.mark.parametrize(
    "kwargs",
    [dict(capacity_bytes=100, pools=[PoolSpec("a", 16, "low")]),
     dict(capacity_bytes=1024, pools=[PoolSpec("a", 16, "low"), PoolSpec("b", 32, "low")]),
     dict(capacity_bytes=1024, pools=[PoolSpec("a", 16, "low"), PoolSpec("a", 32, "high")]),
     dict(capacity_bytes=1024, pools=[PoolSpec("a", 2048, "low")]),
     dict(capacity_bytes=1024, pools=[])],
)
def test_constructor_rejects_bad_configs(kwargs: dict) -> None:
    with pytest.raises(ArenaError):
        Arena(**kwargs)


def test_poolspec_rejects_unaligned_units() -> None:
    with pytest.raises(ArenaError, match="multiple of 16"):
        PoolSpec("kv", 100, "high")


# ----------------------------------------------------------------- compaction
def test_lazy_compaction_moves_inner_blocks_into_holes() -> None:
    """State blocks A B C; free B; C moves into B's place only when space is needed."""
    a = Arena(8 * U, [PoolSpec("state", 2 * U, "low"), PoolSpec("kv", U, "high")])
    abc = a.alloc("state", 3)
    data = fill(a, "state", abc, 3)
    a.free("state", abc[1:2])
    assert a.stats().moves == 0  # the hole stays until needed
    kv = a.alloc("kv", 3)  # needs the 2 units behind C: compaction moves C into B's slot
    assert kv is not None
    assert a.stats().moves == 1
    assert a.resolve("state", abc[2:3]).tolist() == [1]
    assert torch.equal(a.read("state", abc[[0, 2]]), data[[0, 2]])
    a.check_integrity()


def test_joint_request_counts_holes_of_every_pool() -> None:
    """Unified accounting: freed state checkpoints make room for KV pages."""
    a = Arena(12 * U, [PoolSpec("state", 2 * U, "low"), PoolSpec("kv", U, "high")])
    states = a.alloc("state", 4)  # 8 units
    kv = a.alloc("kv", 4)  # 4 units: full
    assert kv is not None and not a.can_alloc({"kv": 1})
    a.free("state", states[[0, 2]])  # two interior holes of 2 units each
    assert a.can_alloc({"kv": 4}) and not a.can_alloc({"kv": 5})
    assert a.can_alloc({"kv": 2, "state": 1}) and not a.can_alloc({"kv": 3, "state": 1})
    keep = fill(a, "state", states[[1, 3]], 4)
    new = a.alloc("kv", 4)
    assert new is not None
    assert torch.equal(a.read("state", states[[1, 3]]), keep)
    a.check_integrity()


def test_float_band_slides_to_make_room() -> None:
    a = three_pools(16 * U)
    swa = a.alloc("swa", 4)
    data = fill(a, "swa", swa, 5)
    assert a.alloc("state", 3) is not None  # 6 units from the low end
    assert a.alloc("kv", 6) is not None  # the float band must slide toward the state band
    assert a.stats().gap_bytes == 0
    assert torch.equal(a.read("swa", swa), data)
    a.check_integrity()


def test_compact_with_budget_and_interleaved_moves() -> None:
    """Slots 0..19 live; odd slots 1..11 freed. The six blocks at the inner edge (19..14) move
    into the six holes, nearest-to-anchor hole first; the band ends dense at 14 slots."""
    a = Arena(32 * U, [PoolSpec("kv", U, "low")])
    ids = a.alloc("kv", 20)
    assert a.resolve("kv", ids).tolist() == list(range(20))
    data = fill(a, "kv", ids, 6)
    a.free("kv", ids[1:12:2])  # holes interleaved with live blocks
    keep = torch.cat([ids[0:12:2], ids[12:]])
    assert a.compact(max_moves=2) == 2
    assert a.resolve("kv", ids[[19, 18]]).tolist() == [1, 3]
    assert a.compact() == 4
    assert a.compact() == 0
    assert a.stats().pools["kv"].hole_bytes == 0
    assert a.stats().pools["kv"].band_end == 14 * U
    index = {v: i for i, v in enumerate(ids.tolist())}
    assert torch.equal(a.read("kv", keep), data[[index[v] for v in keep.tolist()]])
    a.check_integrity()


# ----------------------------------------------------------------- fences
def test_freed_slot_is_pending_until_its_fence_retires() -> None:
    a = Arena(4 * U, [PoolSpec("kv", U, "high")])
    ids = a.alloc("kv", 4)
    slot = int(a.resolve("kv", ids[:1])[0])
    fence = a.fence("kv", ids[:1], "read")
    a.free("kv", ids[:1])
    assert a.stats().pools["kv"].pending_bytes == U
    assert a.alloc("kv", 1) is None and not a.can_alloc({"kv": 1})
    fence.complete()
    new = a.alloc("kv", 1)
    assert new is not None and int(a.resolve("kv", new)[0]) == slot
    a.check_integrity()


def test_move_keeps_source_reserved_for_readers_and_skips_writers() -> None:
    a = Arena(8 * U, [PoolSpec("kv", U, "low")])
    ids = a.alloc("kv", 4)
    data = fill(a, "kv", ids, 7)
    a.free("kv", ids[:2])
    reader = a.fence("kv", ids[3:4], "read")
    writer = a.fence("kv", ids[2:3], "write")
    assert a.compact() == 1  # the read-fenced block moves; the write-fenced one stays
    assert a.resolve("kv", ids[2:4]).tolist() == [2, 0]
    assert a.stats().pools["kv"].pending_bytes == U  # old slot 3 waits for its reader
    assert torch.equal(a.read("kv", ids[2:4]), data[2:4])
    reader.complete()
    writer.complete()
    assert a.compact() == 1
    assert a.stats().pools["kv"].pending_bytes == 0
    a.check_integrity()


def test_fence_as_context_manager_completes() -> None:
    a = Arena(4 * U, [PoolSpec("kv", U, "high")])
    ids = a.alloc("kv", 1)
    with a.fence("kv", ids, "write") as f:
        assert not f.done()
    assert f.done()
    assert a.stats().pending_fences == 0


# ----------------------------------------------------------------- views and resolve
def test_layer_view_is_zero_copy_and_survives_compaction() -> None:
    """A K field of 'layer 1' inside [page=2 tokens][layers=2][K,V][heads=2][dim=8] fp16."""
    page, layers, heads, dim = 2, 2, 2, 8
    unit = page * layers * 2 * heads * dim * 2
    a = Arena(8 * unit, [PoolSpec("kv", unit, "high")])
    ids = a.alloc("kv", 4)
    token_stride = layers * 2 * heads * dim
    k1 = a.layer_view("kv", torch.float16, (page, heads, dim), (token_stride, dim, 1),
                      offset=(1 * 2 + 0) * heads * dim * 2)
    slots = a.resolve("kv", ids)
    values = torch.randn(4, page, heads, dim).half()
    k1[slots] = values
    # The bytes landed inside each block exactly where the envelope layout says.
    env = a.read("kv", ids).view(torch.float16).view(4, page, layers, 2, heads, dim)
    assert torch.equal(env[:, :, 1, 0], values)
    assert env[:, :, 0].abs().sum() == 0 and env[:, :, 1, 1].abs().sum() == 0
    a.free("kv", ids[:2])
    a.compact()
    assert torch.equal(k1[a.resolve("kv", ids[2:])], values[2:])
    assert k1.data_ptr() >= a.buffer.data_ptr()  # a view, not a copy


def test_layer_view_rejects_fields_outside_the_unit() -> None:
    a = Arena(4 * U, [PoolSpec("kv", U, "high")])
    with pytest.raises(ArenaError, match="must fit"):
        a.layer_view("kv", torch.float32, (65,))
    with pytest.raises(ArenaError, match="must fit"):
        a.layer_view("kv", torch.float32, (4,), offset=2)


def test_resolve_pages_and_sink() -> None:
    a = Arena(8 * U, [PoolSpec("kv", U, "low")])
    ids = a.alloc("kv", 3)
    a.free("kv", ids[1:2])
    with pytest.raises(ArenaError):
        a.resolve("kv", ids)
    slots = a.resolve("kv", ids, sink=-7)
    assert slots.tolist() == [0, -7, 2]
    assert a.resolve("kv", ids[[0, 2]], page_size=4).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]


def _fill_three_pools(slots: int) -> Arena:
    """Allocate request-shaped batches (24 KV, 24 SWA, 1 state) until the arena is full: the
    low and high bands grow into the floating band, which slides on every such collision."""
    a = Arena(slots * U, [PoolSpec("state", 2 * U, "low"), PoolSpec("swa", U, "float"),
                          PoolSpec("kv", U, "high")], device="meta")
    while all([a.alloc(pool, n) is not None for pool, n in (("kv", 24), ("swa", 24),
                                                             ("state", 1))]):
        pass
    a.check_integrity()
    return a


@pytest.mark.parametrize("slots", [2_000, 100_000])
def test_filling_visits_what_it_allocates_not_the_band(slots: int) -> None:
    """Compaction while filling (the floating band slides about once per request) visits the
    slots it moves and the gap it takes, never the whole band: visited slots stay within a
    small constant per allocated block at any size (a band scan per slide would make the
    ratio grow with the band, ~500 at 100k slots)."""
    a = _fill_three_pools(slots)
    st = a.stats()
    allocated = sum(p.allocated for p in st.pools.values())
    assert allocated >= slots * 0.9 and st.compactions >= slots // 49 // 3
    assert a.visited_slots() <= 2 * allocated
    # Each slide moves at most what the neighbour needed: bounded bytes moved per byte.
    assert st.moved_bytes <= 0.5 * st.allocated_bytes


def test_float_band_fills_from_the_free_end_without_moves() -> None:
    """Without a low pool the floating band starts at byte 0 and the high band grows down to
    meet it: filling the arena moves nothing."""
    a = Arena(1000 * U, [PoolSpec("swa", U, "float"), PoolSpec("kv", U, "high")], device="meta")
    while a.alloc("kv", 24) is not None and a.alloc("swa", 24) is not None:
        pass
    st = a.stats()
    assert st.gap_bytes < 48 * U and st.pools["swa"].band_start == 0
    assert st.moves == 0 and st.compactions == 0
    a.check_integrity()


def test_a_free_that_sweeps_the_hole_heap_keeps_its_hole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Edge frees leave stale heap entries (the band trims past them); the free that finally
    sweeps them must still remember its own slot as a hole. It once pushed into the list the
    sweep had replaced: the hole was lost and a later alloc failed ``hole heap found k of n``
    (seen in full replays, where the heap reaches the sweep threshold)."""
    monkeypatch.setattr(Pool, "sweep_slack", 0)
    swept = 0
    for edge_cycles in range(24):  # one of these counts makes the interior free sweep
        arena = Arena(64 * 16, [PoolSpec("kv", 16, "low")])
        first = arena.alloc("kv", 3)  # slots 0, 1, 2
        assert first is not None
        b = int(first[1])
        for _ in range(edge_cycles):  # a block at the edge, freed: a stale entry each time
            edge = arena.alloc("kv", 1)
            assert edge is not None
            arena.free("kv", edge)
        pool = arena._pools["kv"]
        before = len(pool.loops)
        arena.free_owned("kv", [b])  # slot 1: an interior hole
        swept += len(pool.loops) <= before
        arena.check_integrity()
        again = arena.alloc("kv", 1)
        assert again is not None and arena.resolve("kv", again).tolist() == [1]
        arena.check_integrity()
    assert swept, "no free swept the heap: the test no longer covers the sweep"


def test_alloc_ids_is_alloc_as_a_list() -> None:
    """The store's list path hands out what :meth:`Arena.alloc` would, in the same order, and
    shares its refusals: ``None`` when full (nothing changes), named errors for misuse."""
    a, b = three_pools(), three_pools()
    for pool, n in (("kv", 5), ("swa", 3), ("state", 2), ("kv", 0), ("swa", 7)):
        got, want = a.alloc_ids(pool, n), b.alloc(pool, n)
        assert isinstance(got, list) and want is not None and got == want.tolist()
        assert a.resolve(pool, got).tolist() == b.resolve(pool, want).tolist()
    a.free_owned("kv", [1, 3])
    b.free("kv", [1, 3])
    assert a.alloc_ids("kv", 2) == b.alloc("kv", 2).tolist()  # type: ignore[union-attr]
    before = a.stats()
    assert a.alloc_ids("kv", 10_000) is None and a.stats() == before
    with pytest.raises(ArenaError, match="non-negative int"):
        a.alloc_ids("kv", -1)
    with pytest.raises(ArenaError, match="unknown pool"):
        a.alloc_ids("nope", 1)
    a.check_integrity()


def test_alloc_packed_packs_what_alloc_ids_hands_out() -> None:
    """The store's packed path hands out what :meth:`Arena.alloc_ids` would, and its bytes
    are those ids as native int64, on every path: holes (few and many), the gap, a compaction."""
    a, b = three_pools(), three_pools()
    for pool in a.pool_names():
        a._pools[pool].small_batch = b._pools[pool].small_batch = 4  # the numpy paths too
    steps = [("kv", 5), ("swa", 3), ("state", 2), ("kv", 0), ("swa", 7), ("kv", 2)]
    for i, (pool, n) in enumerate(steps * 3):
        got, want = a.alloc_packed(pool, n), b.alloc_ids(pool, n)
        assert got is not None and want is not None and got[0] == want
        assert isinstance(got[1], bytearray)
        assert torch.frombuffer(got[1], dtype=torch.long).tolist() == want if n else \
            got[1] == bytearray()
        if i % 2:  # holes to reuse next time round
            a.free_owned(pool, want[::2])
            b.free_owned(pool, want[::2])
    assert a.stats() == b.stats()
    assert a.alloc_packed("kv", 10_000) is None
    with pytest.raises(ArenaError, match="non-negative int"):
        a.alloc_packed("kv", -1)
    a.check_integrity()


class Big(int):
    """An int subclass: a count try_alloc leaves to can_alloc and alloc_packed."""


@pytest.mark.parametrize("seed", range(6))
def test_try_alloc_is_can_alloc_then_alloc_packed(seed: int) -> None:
    """:meth:`Arena.try_alloc` answers what :meth:`Arena.can_alloc` answers, and what it takes
    is what :meth:`Arena.alloc_packed` of each pool in the request's order hands out, on random
    joint requests (holes, the gap, past the capacity, many blocks, fences pending, int
    subclasses); the arenas stay alike (tables, holes, visited slots). Bad requests raise the
    same error and change nothing."""
    import random

    rng = random.Random(seed)
    a, b = three_pools(96 * U), three_pools(96 * U)
    for arena in (a, b):
        for pool in arena.pool_names():
            arena._pools[pool].small_batch = 6  # requests past it too
    live: dict[str, list[int]] = {p: [] for p in a.pool_names()}
    fences: list[tuple[object, object]] = []
    for _ in range(300):
        pools = rng.sample(a.pool_names(), rng.randint(1, 3))
        request = {p: rng.choice([0, 1, 2, 3, 5, 8, 13]) for p in pools}
        if rng.random() < 0.05:
            request[pools[0]] = Big(request[pools[0]])
        want = b.can_alloc(request)
        got = a.try_alloc(request)
        assert (got is not None) == want
        if got is None:
            continue
        for pool, n in request.items():  # what the store does with the answer
            packed = got[pool] if got else a.alloc_packed(pool, n)
            assert packed is not None
            ids = b.alloc_packed(pool, n)
            assert ids is not None and packed[0] == ids[0] and packed[1] == ids[1]
            live[pool] += ids[0]
        for pool in a.pool_names():  # free some, so holes (and trims) come and go
            if live[pool] and rng.random() < 0.7:
                gone = rng.sample(live[pool], rng.randint(1, len(live[pool])))
                live[pool] = [i for i in live[pool] if i not in gone]
                a.free_owned(pool, gone)
                b.free_owned(pool, gone)
        if rng.random() < 0.1 and live["kv"]:  # a read fence on some live kv blocks
            fences.append((a.fence("kv", live["kv"][:2], "read"),
                           b.fence("kv", live["kv"][:2], "read")))
        if fences and rng.random() < 0.3:
            for fence in fences.pop(0):
                fence.complete()  # type: ignore[attr-defined]
        assert a.stats() == b.stats() and a.visited_slots() == b.visited_slots()
        for pool in a.pool_names():
            pa, pb = a._pools[pool], b._pools[pool]
            assert sorted(pa.loops.entries()) == sorted(pb.loops.entries())
    before = a.stats()
    for bad, error in (({"nope": 1}, "unknown pool"), ({"kv": -1}, "non-negative int"),
                       ({"kv": 1, "swa": 1.5}, "non-negative int"), ({"kv": True}, "int")):
        with pytest.raises(ArenaError, match=error):
            a.try_alloc(bad)  # type: ignore[arg-type]
        with pytest.raises(ArenaError, match=error):
            b.can_alloc(bad)  # type: ignore[arg-type]
    assert a.stats() == before
    a.check_integrity()
    b.check_integrity()


def test_free_owned_takes_lists_arrays_and_tensors() -> None:
    import numpy as np

    a = Arena(16 * U, [PoolSpec("kv", U, "low")])
    ids = a.alloc_ids("kv", 6)
    assert ids is not None
    a.free_owned("kv", ids[:2])
    a.free_owned("kv", np.asarray(ids[2:4]))
    a.free_owned("kv", torch.tensor(ids[4:]))
    a.free_owned("kv", [])
    assert a.num_live("kv") == 0
    a.check_integrity()


@pytest.mark.parametrize("slots", [2_000, 100_000])
def test_steady_churn_keeps_the_hole_heap_small(slots: int) -> None:
    """The engine's steady state: free the oldest request's 24 KV + 24 SWA blocks, allocate a
    new request's. Each allocation reuses the freed holes and visits about one heap entry per
    block, and stale heap entries (left where the band trimmed past them) are swept before
    they pile up, so a pop costs the same at any size and after any history."""
    a = Arena(slots * 2 * U, [PoolSpec("swa", U, "float"), PoolSpec("kv", U, "high")],
              device="meta")
    requests = []
    while a.can_alloc({"kv": 24, "swa": 24}):
        requests.append((a.alloc_ids("kv", 24), a.alloc_ids("swa", 24)))
    visited, moves = a.visited_slots(), a.stats().moves
    for _ in range(1_000):
        kv, swa = requests.pop(0)
        a.free_owned("kv", kv)
        a.free_owned("swa", swa)
        requests.append((a.alloc_ids("kv", 24), a.alloc_ids("swa", 24)))
        for pool in a._pools.values():  # the sweep's threshold when the 24 were freed, + 24
            assert len(pool.loops) <= 2 * (pool.num_holes + 48) + pool.sweep_slack + 24
    assert a.visited_slots() - visited <= 2 * 48 * 1_000
    assert a.stats().moves == moves, "reusing freed holes moves nothing"
    a.check_integrity()
