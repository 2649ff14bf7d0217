"""The shadow's compiled loops (tierstore/_c_mrc.c) beside its pure-Python ones: the same
curves and the same stack, event by event, over random workloads; bad input refused."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import pytest

from tierstore import mrc, mrc_loops, mrc_stack
from tierstore.mrc import Shadow

PAGE = 16
UNITS = {"kv": 100, "state": 700}

_c: Any = pytest.importorskip("tierstore._c_mrc")  # built by setup.py; imported even when pure


def workload(n: int, seed: int) -> list[tuple[str, list[bytes], int]]:
    """Matches then inserts of chained page keys: a few shared system prompts, conversations
    that grow (zipf-ish reuse) and start over."""
    rng = random.Random(seed)
    convs: list[list[bytes]] = []
    ops: list[tuple[str, list[bytes], int]] = []
    for _ in range(n):
        if not convs or rng.random() < 0.3:
            system = hashlib.sha256(bytes([rng.randrange(4)])).digest()
            convs.append([system, hashlib.sha256(system).digest()])
        c = convs[min(int(rng.paretovariate(1.2)) - 1, len(convs) - 1)]
        if len(c) > 40:
            del c[2:]
        for _ in range(rng.randrange(1, 4)):
            c.append(hashlib.sha256(c[-1] + rng.randbytes(8)).digest())
        ops.append(("match", c[:-1], (len(c) - 1) * PAGE + rng.randrange(PAGE)))
        ops.append(("insert", list(c), 0))
    return ops


def pair(capacities: dict[str, int], units: dict[str, int], **kw: Any) -> tuple[Shadow, Shadow]:
    kw["whole_in_c"] = False  # (these loops, not the whole shadow in C)
    compiled, pure = Shadow(capacities, units, PAGE, **kw), Shadow(capacities, units, PAGE, **kw)
    compiled._c, pure._c = _c, None
    return compiled, pure


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize(("capacities", "units", "kw"), [
    ({"l1": 20_000}, UNITS, {"max_tracked": 16}),  # pages past the curves' depth dropped
    # every distance read (an unbounded tier below): rates halve, ends rotate, slots compact
    ({"l1": 20_000}, UNITS, {"max_tracked": 16, "unbounded_below": True}),
    ({"l1": 20_000}, UNITS, {}),  # the serving default: pages from 1/16
    ({"l1": 20_000}, {"kv": 100, "swa": 50}, {"max_tracked": 64}),  # no state: every page ends
    ({"l1": 10_000, "l2": 20_000}, UNITS, {"max_tracked": 64}),  # L2: the overlap's loops
    ({"l1": 10_000, "l2": 20_000}, UNITS, {"rate": 1.0}),
    ({"l1": 10_000, "l2": 20_000}, UNITS, {"max_tracked": 64, "write_through": True}),
    ({"l1": 10_000, "l2": 20_000}, UNITS, {"max_tracked": 64, "unbounded_below": True}),
])
def test_compiled_loops_match_the_pure_ones_event_by_event(
        seed: int, capacities: dict[str, int], units: dict[str, int], kw: dict[str, Any]) -> None:
    rng = random.Random(seed)
    compiled, pure = pair(capacities, units, **kw)
    for i, (op, keys, n) in enumerate(workload(700, seed=seed)):
        keys = keys if rng.random() < 0.8 else keys[:max(1, len(keys) - rng.randrange(3))]
        checkpoint = rng.random() < 0.9
        for s in (compiled, pure):
            if op == "match":
                s._reference(list(keys), n)
            else:
                s._insert(list(keys), checkpoint)
            if i % 37 == 0:  # (between the drains' trims, pages past the depth are read)
                mrc_stack.trim(s)
        assert compiled._pages == pure._pages and compiled._clock == pure._clock
        assert compiled._tree.values == pure._tree.values
        assert compiled._tree.sums == pure._tree.sums
        assert (compiled._fl, compiled._lo, compiled._win, compiled._d) \
            == (pure._fl, pure._lo, pure._win, pure._d)  # L1's window and its L2 copy bits
    assert compiled.curves() == pure.curves()
    assert compiled._num_ends == pure._num_ends


def test_suffix_matches_the_slots() -> None:
    rng = random.Random(3)
    slots = mrc._Slots([float(rng.randrange(100)) for _ in range(1000)])
    for _ in range(500):
        i = rng.randrange(1000)
        end = rng.randrange(i, 1001)
        assert _c.suffix_of(slots.values, slots.sums, i, end) == slots.suffix(i, end)


def test_bad_input_is_refused() -> None:
    key = hashlib.sha256(b"k").digest()
    with pytest.raises(TypeError):
        _c.scan([key, "not bytes"], b"\x10", None, 1, 2, -1, None, None)
    with pytest.raises(TypeError):
        _c.scan(key, b"\x10", None, 1, 2, -1, None, None)  # not a list of keys
    with pytest.raises(ValueError):
        _c.scan([key], b"\x10", {}, 1, 2, 5, [], [])  # known past the keys
    with pytest.raises(TypeError):
        _c.scan([key], b"\x10", None, 1)  # too few arguments
    values, sums = [0.0] * 512, [0.0] * 2
    with pytest.raises(ValueError):
        _c.suffix_of(values, sums, 10, 600)
    with pytest.raises(ValueError):
        _c.suffix_of(values, [0.0], 0, 10)  # sums per block disagree
    with pytest.raises(IndexError):
        _c.touch({}, values, sums, 1.0, 2.0, [key], [3], None, True, 0)
    with pytest.raises(ValueError):
        _c.touch({key: 2000 << 1}, values, sums, 1.0, 2.0, [key], [0], None, True, 0)
    bad = [0.0] * 512
    bad[0] = 1  # an int among the slots
    with pytest.raises(TypeError):
        _c.touch({key: 0}, bad, sums, 1.0, 2.0, [key], [0], None, True, 1)
    assert values == [0.0] * 512 and sums == [0.0, 0.0]  # refused before any change
    fl, d = [0] * 512, [0.0, 0.0]
    with pytest.raises(ValueError):  # negative copy bits (force) would never run out of bits
        _c.touch_overlap({}, values, sums, fl, d, {}, 1.0, 2.0, [key], [0], None, True, 0, 0,
                         0.0, 100.0, [0.0, 0.0], {}, -1)
    with pytest.raises(ValueError):  # a bit past the multiples
        _c.touch_overlap({}, values, sums, fl, d, {}, 1.0, 2.0, [key], [0], None, True, 0, 0,
                         0.0, 100.0, [0.0, 0.0], {}, 4)
    with pytest.raises(KeyError):  # a page below L1's window without its distance read
        _c.touch_overlap({key: 0}, [1.0] + values[1:], [1.0, 0.0], fl, d, {}, 1.0, 2.0, [key],
                         [0], None, False, 1, 1, 0.0, 100.0, [0.0, 0.0], {}, 0)


def test_end_prefilter_marks_like_its_twin_and_keeps_every_end() -> None:
    """The end prefilter: the compiled mark_end sets the bit the pure one does (none for a key
    under 11 bytes), and after ends rotate every key of the end set has its bit, so the
    compiled scan looks up every end (no false negatives)."""
    rng = random.Random(5)
    ours, theirs = bytearray(mrc_loops.END_BITS // 8), bytearray(mrc_loops.END_BITS // 8)
    for n in (1, 10, 11, 16, 32):
        for _ in range(50):
            key = rng.randbytes(n)
            assert _c.mark_end(ours, key) is mrc_loops.mark_end(theirs, key)
            assert _c.mark_end(ours, key) is True  # (set now, or no bit at all)
    assert ours == theirs and any(ours)
    assert mrc_loops.end_bits([b"short"]) == bytearray(mrc_loops.END_BITS // 8)
    s = Shadow({"l1": 20_000}, UNITS, PAGE, max_tracked=16, whole_in_c=False)  # ends rotate
    for op, keys, n in workload(400, seed=6):
        if op == "match":
            s._reference(list(keys), n)
        else:
            s._insert(list(keys), True)
    assert s._rotated and s._end_bits == mrc_loops.end_bits(s._end_set)


def test_scan_with_the_end_prefilter_finds_the_same_ends() -> None:
    """scan with the prefilter finds what it finds without; a clear bit rules a key out
    without a lookup (a zero prefilter finds no 32-byte end; a short key is always looked
    up); a prefilter of the wrong size is refused."""
    rng = random.Random(7)
    keys = [rng.randbytes(32) for _ in range(64)] + [b"short"]
    end_set = dict.fromkeys(keys[::3] + [b"short"])
    bits = mrc_loops.end_bits(end_set)
    plain = _c.scan(keys, b"\x10", end_set, 2**32, 2**32, -1, None, None)
    assert _c.scan(keys, b"\x10", end_set, 2**32, 2**32, -1, None, None, bits) == plain
    assert _c.scan(keys, b"\x10", end_set, 2**32, 2**32, -1, None, None, None) == plain
    zero = bytearray(mrc_loops.END_BITS // 8)
    assert _c.scan(keys, b"\x10", end_set, 2**32, 2**32, -1, None, None, zero)[0] == [64]
    known = _c.scan(keys[:10], b"\x10", end_set, 2**32, 2**32, -1, None, None, bits)
    assert _c.scan(keys, b"\x10", end_set, 2**32, 2**32, 10, known[0], known[2], bits) == plain
    with pytest.raises(ValueError):
        _c.scan(keys, b"\x10", end_set, 2**32, 2**32, -1, None, None, bytearray(10))
    with pytest.raises(ValueError):
        _c.mark_end(bytearray(10), keys[0])
    with pytest.raises(TypeError):
        _c.mark_end(bits, "not bytes")


@pytest.mark.parametrize("pure", [False, True])
def test_end_generations_and_the_tracked_pages_invariant(pure: bool) -> None:
    """The end set keeps two generations in one dict (the last keys in are the young one):
    after every insert it holds what two dicts aged as before would. And the invariant that
    lets a new end skip the page lookup: a page tracked as such sorts below the page limit,
    and until ends are first forgotten every tracked end is in the end set."""
    s = Shadow({"l1": 20_000}, UNITS, PAGE, max_tracked=16,  # rates halve, ends rotate
               unbounded_below=True,  # (no page dropped for its depth: every rate halves)
               whole_in_c=False)  # (the Python tables, read after every event)
    s._c = None if pure else _c
    young: dict[bytes, None] = {}
    old: dict[bytes, None] = {}
    for op, keys, n in workload(600, seed=8):
        if op == "match":
            s._reference(list(keys), n)
            continue
        s._insert(list(keys), True)
        if keys[-1] not in young and keys[-1] not in old:
            young[keys[-1]] = None
            if len(young) >= 4 * 16:
                old, young = young, {}
        assert set(s._end_set) == set(old) | set(young)
        for key, code in s._pages.items():
            assert code & 1 or key < s._page_limit
            assert not code & 1 or s._rotated or key in s._end_set
    assert s._rotated and s.threshold < mrc.DEFAULT_RATE * mrc_loops.SPACE


@pytest.mark.parametrize("kw", [{"max_tracked": 16}, {"max_tracked": 16, "unbounded_below": True},
                                {}])
def test_an_insert_of_the_match_pages_plays_as_the_pure_path(kw: dict[str, Any]) -> None:
    """The engine's usual step: a match, then an insert of the very same pages with a
    checkpoint at their end (a new end, or one already known), which reuses the match's scan
    (its last page now an end, sampled as one or not). The same stack as the pure path's,
    event by event."""
    rng = random.Random(9)
    compiled, pure = pair({"l1": 20_000}, UNITS, **kw)
    for op, keys, n in workload(800, seed=10):
        if op != "match":
            continue
        checkpoint = rng.random() < 0.9
        for s in (compiled, pure):
            s._reference(list(keys), n)
            s._insert(list(keys), checkpoint)
        assert compiled._pages == pure._pages and compiled._clock == pure._clock
        assert compiled._tree.values == pure._tree.values
        assert compiled._end_set == pure._end_set
    assert compiled.curves() == pure.curves()
    assert compiled._num_ends == pure._num_ends
