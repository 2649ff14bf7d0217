"""The shadow's depth bound (``mrc_stack.trim``): pages deeper than the last size a curve reads
count as untracked and are dropped. The curves are those of the same shadow with every page
kept (above an unbounded tier nothing is dropped: its curve reads every distance), it tracks
far fewer pages, and when the pages are dropped changes nothing."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import pytest

from tierstore import mrc_stack
from tierstore.mrc import Shadow
from tierstore.native import load

PAGE = 16
UNITS = {"kv": 100, "state": 700}
_C = load("tierstore._c_mrc")
_P = load("tierstore._c_play")
# pure Python; the compiled loops (tierstore/_c_mrc.c) over the Python tables; the whole shadow in
# C (tierstore/_c_play.c: without an L2, else the compiled loops), its state taken back to read
PATHS = [pytest.param("pure", id="pure")] \
    + ([pytest.param("compiled", id="compiled")] if _C else []) \
    + ([pytest.param("core", id="core")] if _P else [])


def workload(n: int, seed: int, match_only: float = 0.0) -> list[tuple[str, list[bytes], int]]:
    """Matches then inserts of chained page keys over many conversations (most of the stack
    lies past 4x the small tiers below); ``match_only``: the share of matches with no insert."""
    rng = random.Random(seed)
    convs: list[list[bytes]] = []
    ops: list[tuple[str, list[bytes], int]] = []
    for _ in range(n):
        if not convs or rng.random() < 0.4:
            system = hashlib.sha256(bytes([rng.randrange(4)])).digest()
            convs.append([system, hashlib.sha256(system).digest()])
        c = convs[min(int(rng.paretovariate(0.8)) - 1, len(convs) - 1)]
        if len(c) > 30:
            del c[2:]
        for _ in range(rng.randrange(1, 4)):
            c.append(hashlib.sha256(c[-1] + rng.randbytes(8)).digest())
        ops.append(("match", c[:-1], (len(c) - 1) * PAGE + rng.randrange(PAGE)))
        if rng.random() >= match_only:
            ops.append(("insert", list(c), 0))
    return ops


def play(shadow: Shadow, ops: list[tuple[str, list[bytes], int]], trim_every: int = 0) -> None:
    for i, (op, keys, n) in enumerate(ops):
        if op == "match":
            shadow.reference(keys, n)
        else:
            shadow.insert(keys, True)
        if trim_every and i % trim_every == 0:
            shadow.drain()
            trim(shadow)
    shadow.drain()
    if shadow._core is not None:  # (its tables read as the Python loop's from here on)
        shadow._take_back()


def trim(s: Shadow) -> None:
    if s._core is not None:
        s._core.trim()
    else:
        mrc_stack.trim(s)


def shadow(capacities: dict[str, int], path: str, **kw: Any) -> Shadow:
    s = Shadow(capacities, UNITS, PAGE, max_tracked=1 << 20,  # no rate halves
               whole_in_c=path == "core", **kw)
    if path == "pure":
        s._c = None
    return s


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("capacities", [{"l1": 3_000}, {"l1": 2_000, "l2": 4_000}])
@pytest.mark.parametrize("rate", [1.0, 1 / 4])
def test_dropping_pages_past_the_depth_changes_no_tally(
        path: str, capacities: dict[str, int], rate: float) -> None:
    """Every tally a curve reads (hit tokens and entries per distance up to the last edge,
    references, L2's hits per multiple and its copies of L1) equals the unbounded twin's, on
    the engine's steps (a match, then an insert of the prompt)."""
    ops = workload(1200, seed=3)
    bounded = shadow(capacities, path, rate=rate)
    kept = shadow(capacities, path, rate=rate, unbounded_below=True)
    assert bounded.edges == kept.edges[:-1]  # (the last edge of the unbounded one: infinite)
    play(bounded, ops)
    play(kept, ops)
    k = len(bounded.edges)
    assert bounded._hist[:k] == kept._hist[:k] and sum(bounded._hist[:k]) > 0
    for kind in bounded.kinds:
        assert bounded._kind_hist[kind][:k] == kept._kind_hist[kind][:k]
    assert bounded._kind_refs == kept._kind_refs
    assert (bounded._l2_hit, bounded._l2_kind, bounded._d, bounded._win) \
        == (kept._l2_hit, kept._l2_kind, kept._d, kept._win)
    tiers: Any = (bounded.curves()["tiers"], kept.curves()["tiers"])
    assert tiers[0]["l1"]["hit_rate"] == tiers[1]["l1"]["hit_rate"]
    # tracked (dropped once the pages double past 1,024; here at once): what lies within
    # the last edge, a fraction of every page kept
    mrc_stack.trim(bounded)
    assert len(bounded._pages) < len(kept._pages) / 3
    tree, clock = bounded._tree, bounded._clock
    for code in bounded._pages.values():
        assert tree.suffix(code >> 1, clock) <= bounded.edges[-1]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("capacities", [{"l1": 3_000}, {"l1": 2_000, "l2": 4_000}])
def test_when_pages_are_dropped_changes_no_curve(path: str, capacities: dict[str, int]) -> None:
    """A page past the depth reads as untracked whether it is dropped yet or not (a match
    does not move it: no cache of a size the curves read holds it), so dropping after every
    event or only when the tracked pages double gives the same stack and curves, matches
    without their insert included."""
    ops = workload(1200, seed=5, match_only=0.3)
    eager, lazy = shadow(capacities, path), shadow(capacities, path)
    play(eager, ops, trim_every=1)
    play(lazy, ops)
    mrc_stack.trim(lazy)

    def order(s: Shadow) -> list[tuple[bytes, int]]:  # the stack, oldest first
        return [(key, code & 1) for key, code in sorted(s._pages.items(), key=lambda kv: kv[1])]

    assert order(eager) == order(lazy)
    assert eager.curves()["tiers"] == lazy.curves()["tiers"]


def test_a_match_past_the_depth_moves_nothing() -> None:
    """A match of a page deeper than every size leaves it where it is (and dropped by the
    next trim); the same match within the depth moves it to the top."""
    # (the Python tables, read between events; the core plays as they do)
    s = Shadow({"l1": 1_000}, UNITS, PAGE, rate=1.0, whole_in_c=False)
    old = [hashlib.sha256(b"old%d" % i).digest() for i in range(2)]
    s.insert(old, True)
    for i in range(60):  # 60 other prompts of 2 pages push it past 4 x 1,000 bytes
        s.insert([hashlib.sha256(b"x%d-%d" % (i, j)).digest() for j in range(2)], True)
    s.drain()
    deep = s._pages[old[-1]] >> 1
    assert s._tree.suffix(deep, s._clock) > s.edges[-1]
    s.reference(old, 2 * PAGE)
    s.reference(old[:1], PAGE)  # (the first match's touch is left to this next event)
    s.drain()
    assert s._pages[old[-1]] >> 1 == deep  # not moved
    mrc_stack.trim(s)
    assert old[-1] not in s._pages and old[0] not in s._pages
    refs = s._kind_refs["state"]
    assert refs > 0  # both matches counted their end as referenced (a miss at every size)


_S: Any = load("tierstore._c_shadow")


def _tables(seed: int) -> tuple[dict[bytes, int], list[float], list[float], list[int]]:
    rng = random.Random(seed)
    slots = rng.sample(range(3000), 900)
    pages = {rng.randbytes(32): slot << 1 | (rng.random() < 0.4) for slot in slots}
    pages[rng.randbytes(32)] = -2 | 1  # a page off the stack (mid-move): kept
    tree = mrc_stack.Slots([0.0] * 4096)
    for code in pages.values():
        if code >= 0:
            tree.add(code >> 1, rng.choice([100.0, 800.0, 1e-3]))
    return pages, tree.values, tree.sums, [rng.randrange(8) for _ in range(4096)]


@pytest.mark.skipif(_S is None, reason="tierstore._c_shadow not built or pure")
@pytest.mark.parametrize("cut", [0, 1, 1500, 4096])
def test_compiled_drop_matches_the_pure_one(cut: int) -> None:
    a, b = _tables(cut), _tables(cut)
    assert _S.drop(*a, cut) == mrc_stack.drop(*b, cut)
    assert a == b
    assert all(code < 0 or code >> 1 >= cut for code in a[0].values())


@pytest.mark.skipif(_S is None, reason="tierstore._c_shadow not built or pure")
def test_drop_refuses_bad_input_and_changes_nothing() -> None:
    pages, values, sums, fl = _tables(7)
    before = (dict(pages), list(values), list(sums), list(fl))
    bad: list[tuple[Any, ...]] = [
        ({**pages, "str": 2}, values, sums, fl, 3000),  # a key not bytes
        ({**pages, b"k": 2.0}, values, sums, fl, 3000),  # a code not an int
        ({**pages, b"k": 10_000 << 1}, values, sums, fl, 20_000),  # past the slots
        (pages, values, sums[:-1], fl, 3000),  # sums of other slots
        (pages, values, sums, fl[:10], 3000),  # copy bits too short
        (pages, values, sums, fl, 3000.0),  # cut not an int
        (list(pages.items()), values, sums, fl, 3000),
        (pages, tuple(values), sums, fl, 3000),
    ]
    for args in bad:
        with pytest.raises((TypeError, ValueError)):
            _S.drop(*args)
    values[next(c for c in pages.values() if c >= 0) >> 1] = 1  # a slot's bytes not a float
    with pytest.raises(TypeError):
        _S.drop(pages, values, sums, fl, 3000)
    values[next(c for c in pages.values() if c >= 0) >> 1] = before[1][
        next(c for c in pages.values() if c >= 0) >> 1]
    with pytest.raises(TypeError):
        _S.drop(pages, values, sums, fl, 3000, 1)
    assert (pages, values, sums, fl) == before
