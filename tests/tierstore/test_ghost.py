"""The ghost index, both paths: the pure-Python dicts and the compiled fingerprint tables
(``tierstore/_c_ghost.c``) give the same answers over random add/lookup sequences; the only
allowed difference, two keys with one fingerprint, is pinned by comparing the compiled index
with the pure one keyed by the fingerprints themselves (few bits, so collisions happen). And
the attribution's compiled tally against its pure loops."""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import native
from tierstore.attribution import _EVICTED, _LOST, _SLOTS, REASONS, _tally_loops
from tierstore.ghost import DEFAULT_CAPACITY, GhostIndex, PyGhostIndex


def _compiled() -> ModuleType | None:
    try:  # imported directly: compared even where TIERSTORE_PURE_PYTHON=1 picks the pure path
        return importlib.import_module("tierstore._c_ghost")
    except ImportError:
        return None


_C = _compiled()
needs_c = pytest.mark.skipif(_C is None, reason="tierstore._c_ghost is not built")
IMPLS: list[Any] = [PyGhostIndex] + ([_C.GhostIndex] if _C is not None else [])
impls = pytest.mark.parametrize("impl", IMPLS, ids=lambda c: c.__module__)


def test_the_store_uses_the_compiled_index_where_built() -> None:
    compiled = native.active()["tierstore._c_ghost"]
    assert GhostIndex is (IMPLS[-1] if compiled else PyGhostIndex)
    assert native.active()["tierstore._c_ghost"] == (_C is not None and not native.PURE)


@impls
def test_bounded_and_remembers_the_latest_half(impl: Callable[[int], Any]) -> None:
    g = impl(8)
    keys = [bytes([i]) * 32 for i in range(20)]
    for i, k in enumerate(keys):
        g.add([k], 1 + i % 3)
        assert len(g) <= 8
    assert all(g.tier(k) == 1 + i % 3 for i, k in enumerate(keys) if i >= 16)
    assert g.tier(keys[0]) == 0 and keys[0] not in g and keys[19] in g
    assert g.forgotten == 16  # four generations of 4 went
    assert g.counts(keys) == [16, 1, 2, 1, 0] and g.counts(keys, 18) == [0, 1, 1, 0, 0]
    assert g.counts(keys, 99) == [0, 0, 0, 0, 0]


@impls
def test_one_add_may_overrun_the_half_then_ages(impl: Callable[[int], Any]) -> None:
    g = impl(8)
    big = [i.to_bytes(32, "little") for i in range(100)]  # past the stack buffer, grows
    g.add(big, 4)
    assert len(g) == 100 and g.forgotten == 0  # aged whole: every page remembered
    assert g.counts(big) == [0, 0, 0, 0, 100]
    g.add([b"x" * 32], 2)  # young at 1 of 4: the 100 stay
    g.add([b"y" * 32, b"z" * 32, b"w" * 32], 2)  # young reaches 4: the 100 are forgotten
    assert g.forgotten == 100 and len(g) == 4 and g.tier(big[0]) == 0


@impls
def test_bad_arguments_raise_and_change_nothing(impl: Callable[..., Any]) -> None:
    with pytest.raises(ValueError):
        impl(1)
    g = impl(16)
    g.add([b"a" * 32], 1)
    for tier in (0, 5, -1):
        with pytest.raises(ValueError):
            g.add([b"b" * 32], tier)
    with pytest.raises(ValueError):
        g.counts([b"a" * 32], -1)
    assert len(g) == 1 and g.tier(b"b" * 32) == 0 and g.tier(b"a" * 32) == 1
    g.__init__(4)  # starting over forgets everything
    assert len(g) == 0 and g.capacity == 4 and g.tier(b"a" * 32) == 0


@needs_c
def test_compiled_rejects_what_is_not_bytes_and_changes_nothing() -> None:
    assert _C is not None
    g = _C.GhostIndex(16)
    g.add([b"a" * 32], 1)
    for keys in ([b"b" * 32, "str"], [b"c" * 32, 7], [None], 5, None):
        with pytest.raises(TypeError):
            g.add(keys, 2)
    assert len(g) == 1 and g.tier(b"b" * 32) == 0 and g.tier(b"c" * 32) == 0
    for bad in ("str", 3, None, bytearray(b"a" * 32)):
        with pytest.raises(TypeError):
            g.tier(bad)
        with pytest.raises(TypeError):
            bad in g  # noqa: B015
    with pytest.raises(TypeError):
        g.counts([b"a" * 32, 1])
    with pytest.raises(TypeError):
        g.counts(7)
    with pytest.raises(TypeError):
        g.add([b"a" * 32], "1")
    with pytest.raises(TypeError):
        _C.GhostIndex("8")
    with pytest.raises(ValueError):
        _C.GhostIndex(1 << 50)
    for bits in (0, 62, -3):
        with pytest.raises(ValueError):
            _C.GhostIndex(8, bits)
    with pytest.raises(AttributeError):
        g.capacity = 3
    bare = _C.GhostIndex.__new__(_C.GhostIndex)  # never initialised: no crash
    assert bare.tier(b"a") == 0 and len(bare) == 0 and bare.counts([b"a"]) == [1, 0, 0, 0, 0]
    with pytest.raises(RuntimeError):
        bare.add([b"a"], 1)
    g.add(iter([b"d" * 32]), 3)  # any iterable of bytes, as the pure path's dict.update
    assert g.counts((b"a" * 32, b"d" * 32)) == [0, 1, 0, 1, 0]


@needs_c
def test_compiled_memory_per_page() -> None:
    """The documented cost: a dense table of 8-byte words per generation, at most half full:
    16 bytes per remembered page when both generations are full, 32 at the low point; no
    object kept per page (the pure path keeps each key: ~105-140 bytes a page). Both tables
    are there from the start: aging reuses the old one's, so no add allocates."""
    assert _C is not None
    g = _C.GhostIndex(DEFAULT_CAPACITY)
    empty = g.nbytes
    g.add([i.to_bytes(32, "little") for i in range(DEFAULT_CAPACITY // 2)], 1)  # ages once
    g.add([i.to_bytes(32, "big") for i in range(DEFAULT_CAPACITY // 2 - 1)], 1)
    assert len(g) == DEFAULT_CAPACITY - 1
    assert g.nbytes <= 16 * DEFAULT_CAPACITY + 256, g.nbytes
    assert g.nbytes / (DEFAULT_CAPACITY // 2) <= 33
    assert g.nbytes == empty


def _run(c: Any, py: Any, pool: list[Any], rng: random.Random, steps: int) -> int:
    """Random adds (batches of 0-90 pool keys, repeats included) and lookups on both,
    every answer compared; returns how many lookups found a remembered key."""
    found = 0
    for _ in range(steps):
        if rng.random() < 0.5:
            batch = [rng.choice(pool) for _ in range(rng.choice((0, 1, 3, 24, 70, 90)))]
            tier = rng.randint(1, 4)
            c.add(batch, tier)
            py.add(batch, tier)
        else:
            keys = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
            start = rng.randint(0, len(keys))
            assert c.counts(keys, start) == py.counts(keys, start)
            assert [c.tier(k) for k in keys] == [py.tier(k) for k in keys]
            assert [k in c for k in keys] == [k in py for k in keys]
            found += sum(k in py for k in keys)
        assert len(c) == len(py) and c.forgotten == py.forgotten
    return found


@needs_c
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), capacity=st.sampled_from([2, 3, 8, 64, 500]),
       pool_size=st.sampled_from([5, 40, 400]))
def test_compiled_equals_pure_on_random_sequences(seed: int, capacity: int,
                                                  pool_size: int) -> None:
    """Full 61-bit fingerprints: with no two pool keys sharing one (checked), the compiled
    index answers exactly as the pure one over the keys themselves."""
    assert _C is not None
    rng = random.Random(seed)
    pool = [rng.randbytes(rng.choice((32, 16, 7, 40))) for _ in range(pool_size)]
    c = _C.GhostIndex(capacity)
    assert len({c.fingerprint(k) for k in set(pool)}) == len(set(pool))
    _run(c, PyGhostIndex(capacity), pool, rng, 60)


@needs_c
def test_compiled_equals_pure_over_many_steps() -> None:
    assert _C is not None
    rng = random.Random(24)
    pool = [rng.randbytes(32) for _ in range(3000)] + [bytes([i]) * 32 for i in range(256)]
    c = _C.GhostIndex(1000)
    assert len({c.fingerprint(k) for k in pool}) == len(pool)
    assert _run(c, PyGhostIndex(1000), pool, rng, 3000) > 1000  # lookups did find keys


class _ByFingerprint:
    """The pure index keyed by the compiled one's fingerprints: what the compiled index must
    equal exactly, collisions included."""

    def __init__(self, capacity: int, fingerprint: Callable[[bytes], int]) -> None:
        self.inner = PyGhostIndex(capacity)
        self.fp = fingerprint

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: bytes) -> bool:
        return self.fp(key) in self.inner

    @property
    def forgotten(self) -> int:
        return self.inner.forgotten

    def add(self, keys: list[bytes], tier: int) -> None:
        self.inner.add(list(map(self.fp, keys)), tier)  # type: ignore[arg-type]

    def tier(self, key: bytes) -> int:
        return self.inner.tier(self.fp(key))  # type: ignore[arg-type]

    def counts(self, keys: list[bytes], start: int = 0) -> list[int]:
        return self.inner.counts(list(map(self.fp, keys)), start)  # type: ignore[arg-type]


@needs_c
@pytest.mark.parametrize("bits", [3, 6, 10])
def test_fingerprint_collisions_are_the_only_difference(bits: int) -> None:
    """Few fingerprint bits force collisions: the compiled index then equals the pure one
    over the fingerprints exactly, and differs from the pure one over the keys (a cold key
    reads as evicted), only for keys that share a fingerprint with a remembered one."""
    assert _C is not None
    rng = random.Random(bits)
    pool = [rng.randbytes(32) for _ in range(300)]
    c = _C.GhostIndex(64, bits)
    fp = c.fingerprint
    assert all(0 <= fp(k) < 1 << bits for k in pool)
    assert len({fp(k) for k in pool}) < len(pool)  # collisions do happen
    _run(c, _ByFingerprint(64, fp), pool, rng, 400)
    exact = PyGhostIndex(1 << 20)
    c.__init__(1 << 20, bits)  # no generation ages: only collisions differ
    added: list[bytes] = []
    differ = 0
    for _ in range(40):
        batch = rng.sample(pool[:150], 3)
        c.add(batch, 1)
        exact.add(batch, 1)
        added += batch
        for k in pool:
            if c.tier(k) != exact.tier(k):
                assert exact.tier(k) == 0 and c.tier(k) == 1  # cold read as evicted
                assert any(fp(a) == fp(k) for a in added if a != k)
                differ += 1
    assert differ > 0


@needs_c
def test_compiled_tally_equals_the_loops_and_rejects_bad_input() -> None:
    """The attribution's per-match tally: the compiled call adds exactly what the pure
    loops add, over random matches; bad input raises (no crash)."""
    assert _C is not None
    tally = partial(_C.tally, _LOST, _EVICTED)
    rng = random.Random(7)
    c_fast, c_loops = [0] * _SLOTS, [0] * _SLOTS
    for _ in range(500):
        sources = {t: rng.randint(0, 9) for t in range(1, rng.randint(1, 5))}
        lost = {r: rng.randint(1, 999) for r in rng.sample(REASONS, rng.randint(0, 3))}
        evicted = {t: rng.randint(1, 99) for t in rng.sample(sorted(_EVICTED), rng.randint(0, 2))}
        tally(c_fast, sources, lost, evicted)
        _tally_loops(c_loops, sources, lost, evicted)
    assert c_fast == c_loops and sum(c_fast) > 0
    c = [0] * _SLOTS
    with pytest.raises(KeyError):
        tally(c, {}, {"nope": 1}, {})
    with pytest.raises(IndexError):
        tally(c, {_SLOTS: 1}, {}, {})
    with pytest.raises(IndexError):
        tally(c, {-1: 1}, {}, {})
    with pytest.raises(TypeError):
        tally(c, {"1": 1}, {}, {})
    with pytest.raises(TypeError):
        tally(c, {1: "x"}, {}, {})
    with pytest.raises(TypeError):
        tally(c, [(1, 1)], {}, {})
    with pytest.raises(TypeError):
        tally(tuple(c), {}, {}, {})
    with pytest.raises(TypeError):
        _C.tally(_LOST, _EVICTED, c, {}, {})
    assert c == [0] * _SLOTS  # every bad item came first: nothing was added
