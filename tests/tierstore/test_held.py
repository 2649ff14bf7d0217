"""The usual match counted in one call (tierstore/held.py): the compiled Held beside its pure
twin PyHeld, on the same random matches, give the same splits, counters, window counts and
fallback calls; bad input is refused alike and changes nothing."""

from __future__ import annotations

import gc
import random
import weakref
from typing import Any

import pytest

from tierstore.held import PyHeld

_c: Any = pytest.importorskip("tierstore._c_held")  # built by setup.py; imported even when pure
GhostIndex: Any = pytest.importorskip("tierstore._c_ghost").GhostIndex  # (refuses non-bytes)

PAGE = 16
SLOTS = (9, 1, 5, 7)  # nslots, l1, cold, partial_page


class Recorder:
    """A Held's fallback and on_full, recording their calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def fallback(self, *args: Any) -> tuple[dict[str, int], dict[str, int]]:
        self.calls.append(("fallback", args[0], args[1], list(args[2]), args[4]))
        return {"evicted": 1}, {"l1": 1}

    def on_full(self) -> None:
        self.calls.append(("full",))


def twins(ghost: Any, window: int = 5) -> list[tuple[Any, dict[str, list[int]], Recorder]]:
    out = []
    for cls in (_c.Held, PyHeld):
        counts: dict[str, list[int]] = {}
        rec = Recorder()
        out.append((cls(ghost, counts, PAGE, SLOTS, rec.fallback, rec.on_full, window),
                    counts, rec))
    return out


def test_the_compiled_held_counts_as_its_pure_twin() -> None:
    rng = random.Random(3)
    ghost = GhostIndex(1 << 10)
    pool = [rng.randbytes(32) for _ in range(300)]
    ghost.add(pool[:100], 2)
    (c_held, c_counts, c_rec), (p_held, p_counts, p_rec) = twins(ghost)
    fallbacks = 0
    for _ in range(2000):
        keys = [rng.choice(pool) for _ in range(rng.randrange(0, 12))]
        pages = rng.randrange(len(keys) + 1)
        n_tokens = len(keys) * PAGE + rng.randrange(PAGE)
        namespace = rng.choice(["default", "alpha|chat"])
        got = [h.settle(namespace, n_tokens, keys, None, pages, {1: pages})
               for h in (c_held, p_held)]
        assert got[0] == got[1]
        fallbacks += "evicted" in got[0][0]
        if rng.random() < 0.05:
            for h in (c_held, p_held):
                h.requests = h.shared = 0  # as Attribution._reset_window does
    assert c_counts == p_counts and c_rec.calls == p_rec.calls
    assert (c_held.requests, c_held.shared) == (p_held.requests, p_held.shared)
    assert fallbacks > 100 and sum(c[0] == "full" for c in c_rec.calls) > 100
    assert sum(n for c in c_counts.values() for n in c) > 0


def test_bad_input_is_refused_alike_and_changes_nothing() -> None:
    ghost = GhostIndex(64)
    for held, counts, rec in twins(ghost):
        with pytest.raises(ValueError):
            held.settle("default", 48, [b"a" * 32] * 3, None, 4, {})  # pages past the keys
        with pytest.raises(ValueError):
            held.settle("default", 48, [b"a" * 32] * 3, None, -1, {})
        with pytest.raises(TypeError):  # the ghost's refusal: keys are bytes
            held.settle("default", 48, [b"a" * 32, "b", b"c" * 32], None, 1, {})
        assert counts == {} and held.requests == 0 and rec.calls == []
        # any other sequence of keys goes to the general path, as given
        assert held.settle("default", 48, (b"a" * 32,), None, 0, {}) == \
            ({"evicted": 1}, {"l1": 1})
        assert rec.calls == [("fallback", "default", 48, [b"a" * 32], 0)]
    for cls in (_c.Held, PyHeld):
        with pytest.raises(ValueError):
            cls(ghost, {}, 0, SLOTS, print, print, 5)
        with pytest.raises(ValueError):
            cls(ghost, {}, PAGE, (9, 1, 9, 7), print, print, 5)
    with pytest.raises(RuntimeError):
        _c.Held.__new__(_c.Held).settle("default", 48, [], None, 0, {})


def test_a_held_count_in_a_cycle_is_collected() -> None:
    """Attribution holds its Held, which holds Attribution's bound methods: the collector
    must see through the compiled one."""

    class Owner:
        def __init__(self) -> None:
            self.held = _c.Held(GhostIndex(64), {}, PAGE, SLOTS, self.fall, self.full, 5)

        def fall(self, *args: Any) -> Any:
            return {}, {}

        def full(self) -> None:
            pass

    owner = Owner()
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None
