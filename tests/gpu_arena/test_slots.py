"""The compiled slot loops (``gpu_arena._c_slots``) against the pure-Python ones
(``gpu_arena.slots.SlotLoops``): the same random call sequences through an arena built on each,
side by side in one process, give the same return values, tables, hole heaps and stats after
every call; and the compiled loops refuse bad input without changing anything. The hole heap
lives in the loops (a C array compiled, a list pure): its entries are compared as sorted lists,
the only order either hands out."""

from __future__ import annotations

import random
from array import array
from typing import Any

import numpy as np
import pytest
import torch

from gpu_arena import Arena, ArenaError, PoolSpec
from gpu_arena.pool import Pool
from gpu_arena.slots import SlotLoops, native, slot_loops

needs_native = pytest.mark.skipif(
    native is None, reason="gpu_arena._c_slots not built or TIERSTORE_PURE_PYTHON=1")

POOLS = [PoolSpec("state", 96, "low"), PoolSpec("swa", 64, "float"), PoolSpec("kv", 48, "high")]


def _arena(compiled: bool, monkeypatch: pytest.MonkeyPatch, capacity: int,
           pools: list[PoolSpec], small: tuple[int, ...] | None = None) -> Arena:
    monkeypatch.setattr(Pool, "compiled", compiled)
    arena = Arena(capacity, pools)
    monkeypatch.setattr(Pool, "compiled", None)
    for pool, batch in zip(arena._pools.values(), small or (), strict=False):
        pool.small_batch = batch
        pool.sweep_slack = 2  # sweep the hole heap often
    return arena


def _state(arena: Arena) -> tuple[object, ...]:
    """Everything the loops touch: tables, counters, hole heaps, bands, stats."""
    pools = []
    for p in arena._pools.values():
        pools.append((p.loc.tolist(), p.owner.tolist(), p.free_ids[: p.num_free_ids].tolist(),
                      sorted(p.loops.entries()), len(p.loops), p.lo, p.hi, p.num_live,
                      p.num_pending, p.num_free_ids, p.allocated, p.moves, p.visited))
    return tuple(pools), arena.stats()


def _compared(a: Arena, b: Arena, call: str, *args: object) -> Any:
    """Call ``call`` on both arenas; the same result or the same exception type."""
    results = []
    for arena in (a, b):
        try:
            out = getattr(arena, call)(*args)
        except (ArenaError, ValueError, AssertionError) as exc:
            out = ("raised", type(exc))
        results.append(out.tolist() if isinstance(out, torch.Tensor) else out)
    assert results[0] == results[1], f"{call}{args}: compiled {results[0]}, pure {results[1]}"
    return results[0]


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_random_calls_agree_side_by_side(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Alloc (tensor and list), free (validated and owned: list, array, tensor), joint
    can_alloc, compaction and fences, batches across every pool's list / numpy threshold."""
    rng = random.Random(seed)
    small = (rng.choice([0, 4, 64]), rng.choice([2, 64]), rng.choice([8, 64]))
    capacity = 96 * 64 + 16
    a = _arena(True, monkeypatch, capacity, POOLS, small)
    b = _arena(False, monkeypatch, capacity, POOLS, small)
    assert type(a._pools["kv"].loops) is not SlotLoops
    assert type(b._pools["kv"].loops) is SlotLoops
    live: dict[str, list[int]] = {p.name: [] for p in POOLS}
    fences: list[tuple[object, object]] = []
    for step in range(600):
        pool = rng.choice(POOLS).name
        op = rng.random()
        if op < 0.35:
            n = rng.choice([0, 1, 2, 3, 5, 8, 13, 24, 40])
            got = _compared(a, b, rng.choice(["alloc", "alloc_ids"]), pool, n)
            if isinstance(got, list):
                live[pool] += got
        elif op < 0.65 and live[pool]:
            k = rng.randint(1, min(len(live[pool]), 30))
            ids = rng.sample(live[pool], k)
            how = rng.choice(["free", "list", "numpy ints", "array", "tensor"])
            for arena in (a, b):
                if how == "free":
                    arena.free(pool, ids)
                elif how == "list":
                    arena.free_owned(pool, list(ids))
                elif how == "numpy ints":  # items with __index__, as list(an array) gives
                    arena.free_owned(pool, list(np.asarray(ids)))
                elif how == "array":
                    arena.free_owned(pool, np.asarray(ids))
                else:
                    arena.free_owned(pool, torch.tensor(ids))
            live[pool] = [i for i in live[pool] if i not in set(ids)]
        elif op < 0.8:
            request = {p.name: rng.randint(0, 12) for p in POOLS if rng.random() < 0.7}
            _compared(a, b, "can_alloc", request)
        elif op < 0.87:
            _compared(a, b, "compact", rng.choice([None, 0, 1, 3]))
        elif op < 0.94 and live[pool] and len(fences) < 4:
            vid = rng.choice(live[pool])
            mode = rng.choice(["read", "write"])
            fences.append((a.fence(pool, [vid], mode),  # type: ignore[arg-type]
                           b.fence(pool, [vid], mode)))  # type: ignore[arg-type]
        elif fences:
            for f in fences.pop(rng.randrange(len(fences))):
                f.complete()  # type: ignore[attr-defined]
        assert _state(a) == _state(b), f"seed {seed} step {step}: arenas differ"
        if step % 50 == 0:
            a.check_integrity()
            b.check_integrity()
    assert sum(a.stats().pools[p.name].allocated for p in POOLS) > 300  # not vacuous


@needs_native
@pytest.mark.parametrize("slots", [2_000, 50_000])
def test_steady_churn_agrees_side_by_side(slots: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's steady request (the bench's loop): can_alloc, free_owned of the oldest
    request's 24 KV + 24 SWA blocks, can_alloc, alloc_ids of 24 + 24; same ids, same slots."""
    pools = [PoolSpec("swa", 16, "float"), PoolSpec("kv", 16, "high")]
    a = _arena(True, monkeypatch, slots * 2 * 16, pools)
    b = _arena(False, monkeypatch, slots * 2 * 16, pools)
    demand = {"kv": 24, "swa": 24}
    held = []
    while _compared(a, b, "can_alloc", demand):
        held.append((_compared(a, b, "alloc_ids", "kv", 24),
                     _compared(a, b, "alloc_ids", "swa", 24)))
    for _ in range(300):
        assert not _compared(a, b, "can_alloc", demand)
        kv, swa = held.pop(0)
        for arena in (a, b):
            arena.free_owned("kv", list(kv))
            arena.free_owned("swa", list(swa))
        assert _compared(a, b, "can_alloc", demand)
        held.append((_compared(a, b, "alloc_ids", "kv", 24),
                     _compared(a, b, "alloc_ids", "swa", 24)))
        for pool in ("kv", "swa"):
            assert torch.equal(a.resolve(pool, held[-1][0 if pool == "kv" else 1]),
                               b.resolve(pool, held[-1][0 if pool == "kv" else 1]))
    assert _state(a) == _state(b)
    a.check_integrity()


def _tables(n: int, rng: random.Random) -> list[np.ndarray]:
    """Tables of a pool with about half its slots live and a few fenced."""
    loc = np.full(n, -1, dtype=np.int64)
    owner = np.full(n, -1, dtype=np.int64)
    ids = list(range(n))
    rng.shuffle(ids)
    live = ids[: n // 2]
    slots = rng.sample(range(n), len(live))
    loc[live] = slots
    owner[slots] = live
    readers = np.zeros(n, dtype=np.int32)
    writers = np.zeros(n, dtype=np.int32)
    for s in rng.sample(range(n), n // 10):
        (readers if rng.random() < 0.5 else writers)[s] = rng.randint(1, 2)
    free = np.asarray(ids[n // 2 :][::-1] + [0] * (n // 2), dtype=np.int64)
    return [loc, owner, readers, writers, free]


def _same(c: Any, p: Any, c_tables: list[np.ndarray], p_tables: list[np.ndarray],
          what: str) -> None:
    """The two loops hold the same heap entries and tables, and read as many slots."""
    assert sorted(c.entries()) == sorted(p.entries()) and len(c) == len(p), f"{what}: heaps differ"
    assert c.visited == p.visited, f"{what}: visited {c.visited} compiled, {p.visited} pure"
    for ct, pt in zip(c_tables, p_tables, strict=True):
        assert np.array_equal(ct, pt), f"{what}: tables differ"


@needs_native
@pytest.mark.parametrize("seed", range(20))
def test_each_loop_agrees_on_random_tables(seed: int) -> None:
    """add, take, take_bind, bind, free (with its sweep and trim), sweep and trim on random
    tables (fenced slots, stale and repeated heap entries, empty and out-of-band ranges), one
    sequence through both loops: same results, same heap entries, same tables after each."""
    rng = random.Random(seed)
    n = rng.choice([8, 64, 300, 1200])  # (past 512 entries the pure heap leaves its list case)
    c_tables = _tables(n, rng)
    p_tables = [t.copy() for t in c_tables]
    sign = rng.choice([1, -1])
    c = slot_loops(*c_tables, sign=sign, compiled=True)
    p = slot_loops(*p_tables, sign=sign, compiled=False)
    for step in range(60):
        loc = c_tables[0]
        lo = rng.randint(0, n)
        hi = rng.randint(lo - 2, n)  # an empty (or inverted) band finds nothing
        fenced = rng.random() < 0.7
        top = int(np.count_nonzero(loc < 0))
        which = rng.choice(["add", "take", "take_bind", "bind", "free", "sweep", "trim"])
        what = f"seed {seed} step {step} {which}"
        if which == "add":  # any slots, repeats and live ones too: stale entries
            slots = [rng.randrange(n) for _ in range(rng.randint(0, 2 * n))]
            c.add(list(slots))
            p.add(list(slots))
        elif which == "take":
            want = rng.randint(0, n)
            assert c.take(lo, hi, want, fenced) == p.take(lo, hi, want, fenced), what
        elif which == "take_bind":
            want = rng.randint(0, min(n, top))
            got = c.take_bind(lo, hi, want, fenced, top)
            assert got == p.take_bind(lo, hi, want, fenced, top), what
            if got is not None:
                ids, packed = got
                assert packed == bytearray(array("q", ids)) and len(ids) == want, what
        elif which == "bind":
            free_slots = np.flatnonzero(c_tables[1] < 0).tolist()
            slots = rng.sample(free_slots, rng.randint(0, min(len(free_slots), top)))
            assert c.bind(list(slots), top) == p.bind(list(slots), top), what
        elif which == "free":
            live = np.flatnonzero(loc >= 0)
            if not live.size:
                continue
            live_slots = loc[live]
            lo, hi = int(live_slots.min()) - rng.randint(0, 3), int(live_slots.max()) + 1
            lo, hi = max(lo, 0), min(hi + rng.randint(0, 3), n)
            ids = rng.sample(live.tolist(), rng.randint(0, live.size))
            occupied = int(live.size) + rng.randint(0, 2)
            occupied = min(occupied, hi - lo)
            slack, mode = rng.randint(0, 8), rng.choice([-1, 0, 1, 2])
            args = (ids, top, fenced, lo, hi, occupied, slack, mode)
            assert c.free(*args) == p.free(*args), what
        elif which == "sweep":
            assert c.sweep(lo, hi, fenced) == p.sweep(lo, hi, fenced), what
        else:
            lo, hi = min(lo, max(hi, lo)), max(hi, lo)
            mode = rng.choice([0, 1, 2])
            assert c.trim(lo, hi, fenced, mode) == p.trim(lo, hi, fenced, mode), what
        _same(c, p, c_tables, p_tables, what)


@needs_native
def test_compiled_loops_refuse_bad_input_and_change_nothing() -> None:
    rng = random.Random(1)
    tables = _tables(16, rng)
    loops = slot_loops(*tables, compiled=True)
    loops.add([3, 5, 5, 9])
    before = [t.copy() for t in tables]
    keys = sorted(loops.entries())
    live = int(np.flatnonzero(tables[0] >= 0)[0])
    dead = int(np.flatnonzero(tables[0] < 0)[0])
    top = int(np.count_nonzero(tables[0] < 0))
    n_live = int(np.count_nonzero(tables[0] >= 0))
    with pytest.raises(ValueError, match="not live"):
        loops.free([live, dead], top, False, 0, 16, n_live, 0, 0)
    with pytest.raises(ValueError, match="outside"):
        loops.free([16], top, False, 0, 16, n_live, 0, 0)
    with pytest.raises(ValueError, match="free stack"):
        loops.free([live], 16, False, 0, 16, n_live, 0, 0)
    with pytest.raises(ValueError, match="band"):
        loops.free([live], top, False, 4, 2, n_live, 0, 0)
    with pytest.raises(ValueError, match="band"):
        loops.free([live], top, False, 0, 17, n_live, 0, 0)
    with pytest.raises(ValueError, match="occupied"):
        loops.free([live], top, False, 0, 16, 0, 0, 0)
    with pytest.raises(ValueError, match="slack"):
        loops.free([live], top, False, 0, 16, n_live, -1, 0)
    with pytest.raises(ValueError, match="trim"):
        loops.free([live], top, False, 0, 16, n_live, 0, 3)
    with pytest.raises(TypeError, match="list"):
        loops.free((live,), top, False, 0, 16, n_live, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside"):
        loops.bind([-1], top)
    with pytest.raises(ValueError, match="free stack"):
        loops.bind([0, 1], 1)
    with pytest.raises(ValueError, match="band"):
        loops.take(0, 17, 1, False)
    with pytest.raises(ValueError, match="band"):
        loops.take_bind(-1, 4, 1, False, top)
    with pytest.raises(ValueError, match="free stack"):
        loops.take_bind(0, 16, 2, False, 1)
    with pytest.raises(ValueError, match="anchor"):
        loops.trim(0, 16, False, 3)
    with pytest.raises(ValueError, match="band"):
        loops.trim(0, 17, False, 0)
    with pytest.raises(ValueError, match="band"):
        loops.sweep(-1, 4, False)
    with pytest.raises(ValueError, match="outside"):
        loops.add([2, 16])
    with pytest.raises(TypeError):
        loops.add([2, "x"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        loops.bind(["x"], top)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        loops.take_bind(0, 16, 1, False)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        loops.take(0, 16, "1", False)  # type: ignore[arg-type]
    for t, b in zip(tables, before, strict=True):
        assert np.array_equal(t, b)
    assert sorted(loops.entries()) == keys, "a refused call changed the hole heap"
    with pytest.raises(TypeError, match="int64"):
        native.SlotLoops(tables[2], *tables[1:])  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="entries"):
        native.SlotLoops(tables[0][:8], *tables[1:])  # type: ignore[union-attr]
    with pytest.raises(TypeError):
        native.SlotLoops(tables[0].astype(np.float64), *tables[1:])  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="sign"):
        native.SlotLoops(*tables, 2)  # type: ignore[union-attr]
    with pytest.raises(ValueError):  # read-only: the loops write the tables
        ro = tables[0].copy()
        ro.flags.writeable = False
        native.SlotLoops(ro, *tables[1:])  # type: ignore[union-attr]


def test_pure_loops_are_used_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    arena = _arena(False, monkeypatch, 64 * 16, [PoolSpec("kv", 16, "low")])
    assert type(arena._pools["kv"].loops) is SlotLoops
    assert arena.alloc_ids("kv", 3) == [0, 1, 2]
    arena.free_owned("kv", [1])
    assert arena.alloc_ids("kv", 1) == [1] and arena.resolve("kv", [1]).tolist() == [1]
    arena.check_integrity()
