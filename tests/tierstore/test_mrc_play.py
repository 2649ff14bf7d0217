"""The shadow played whole in C (tierstore/_c_play.c's Core) beside the pure-Python Shadow: the
same tables, the same pending match and the same curves to the bit, drain by drain, over random
workloads; refused input changes nothing, and a queue the core does not take hands its state
back to the Python loop, which goes on as the pure twin does."""

from __future__ import annotations

import gc
import hashlib
import math
import random
from typing import Any

import pytest

from tierstore import mrc, mrc_stack
from tierstore.mrc import Shadow

from .test_mrc_native import workload as conversations

PAGE = 16
UNITS = {"kv": 100, "state": 700}

_p: Any = pytest.importorskip("tierstore._c_play")  # built by setup.py; imported even when pure


@pytest.fixture(autouse=True)
def _core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shadows made here get the core even where the package runs pure Python."""
    monkeypatch.setattr(mrc, "_P", _p)


def workload(n: int, seed: int) -> list[tuple[str, list[bytes], int]]:
    """test_mrc_native's conversations (a match, then its insert), with some matches left
    without their insert, some inserts of another prompt or one page shorter, and empty
    matches."""
    rng = random.Random(seed + 1000)
    steps = conversations(n, seed)
    prompts = [keys for op, keys, _ in steps if op == "insert"]
    ops: list[tuple[str, list[bytes], int]] = []
    for op, keys, n_tokens in steps:
        if op == "match":
            if rng.random() < 0.02:
                ops.append(("match", [], rng.randrange(PAGE)))
            ops.append((op, keys, n_tokens))
            continue
        r = rng.random()
        if r < 0.1:
            continue  # the match's touch is left to the next match
        if r < 0.2:
            keys = prompts[rng.randrange(len(prompts))]
        ops.append(("insert", keys[:len(keys) - rng.randrange(2)] or keys, 0))
    return ops


def twins(capacities: dict[str, int], units: dict[str, int], **kw: Any) -> tuple[Shadow, Shadow]:
    core = Shadow(capacities, units, PAGE, **kw)
    pure = Shadow(capacities, units, PAGE, whole_in_c=False, **kw)
    assert core._core is not None
    pure._c = None
    return core, pure


def assert_same_state(core: Shadow, pure: Shadow) -> None:
    got = core._core.export()
    assert got["pages"] == pure._pages
    assert got["clock"] == pure._clock and got["num_ends"] == pure._num_ends
    assert got["values"] == pure._tree.values and got["sums"] == pure._tree.sums
    assert set(got["old"]) | set(got["young"]) == set(pure._end_set)
    young = list(pure._end_set)[len(pure._end_set) - pure._young:]
    assert set(got["young"]) == set(young) and got["young_n"] == pure._young
    assert bool(got["rotated"]) == pure._rotated
    assert (got["threshold"], got["end_threshold"]) == (pure.threshold, pure.end_threshold)
    assert got["trim_at"] == pure._trim_at
    assert got["hist"] == pure._hist
    for kind, h, r in zip(("kv", "swa", "state"), got["kind_hist"], got["refs"], strict=True):
        assert h == pure._kind_hist.get(kind) and r == pure._kind_refs.get(kind, 0.0)
    assert (got["tokens"], got["requests"]) == (pure.tokens, pure.requests)
    p = pure._pending
    if p is None:
        assert got["pending"] is None
    else:
        n, last, ends, low, threshold, touched, at = got["pending"]
        assert (n, last, ends, low, at) == (p[0], p[1], p[3], p[5], p[4])
        assert touched == [p[2][i] for i in p[4]]
        assert threshold == (int.from_bytes(p[6], "big") if len(p[6]) == 4 else 1 << 32)


CONFIGS = [
    ({"l1": 20_000}, UNITS, {"max_tracked": 16}),  # pages past the curves' depth dropped
    # every distance read (an unbounded tier below): rates halve, ends rotate, slots compact
    ({"l1": 20_000}, UNITS, {"max_tracked": 16, "unbounded_below": True}),
    ({"l1": 20_000}, UNITS, {}),  # the serving default: pages from 1/16
    ({"l1": 20_000}, UNITS, {"rate": 1.0, "max_tracked": 64}),
    ({"l1": 20_000}, {"kv": 100, "swa": 50}, {"max_tracked": 64}),  # no state: every page ends
    ({"l1": 20_000}, {"kv": 100, "swa": 50, "state": 300}, {"max_tracked": 32}),
    ({"l1": 8_000, "l3": 30_000}, UNITS, {"max_tracked": 32}),  # an L3 curve, no L2
    ({"l1": 5_000}, {"kv": 100, "swa": 50, "state": 300},
     {"swa_window_pages": 4, "swa_window_only": True, "max_tracked": 32}),
]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(("capacities", "units", "kw"), CONFIGS)
def test_the_core_plays_as_the_pure_shadow_drain_by_drain(
        seed: int, capacities: dict[str, int], units: dict[str, int], kw: dict[str, Any]) -> None:
    rng = random.Random(seed)
    core, pure = twins(capacities, units, **kw)
    for i, (op, keys, n) in enumerate(workload(900, seed=seed)):
        checkpoint = rng.random() < 0.9
        for s in (core, pure):
            if op == "match":
                s.reference(list(keys), n)
            else:
                s.insert(list(keys), checkpoint)
        if rng.random() < 0.3:  # (drains between the queue's own: every spacing)
            core.drain()
            pure.drain()
            assert_same_state(core, pure)
        if i % 97 == 0:
            core._core.trim()
            mrc_stack.trim(pure)
    assert core.curves() == pure.curves()
    assert_same_state(core, pure)
    assert core.rate == pure.rate and core.end_rate == pure.end_rate
    assert core.tracked() == pure.tracked()


def test_the_serving_default_over_a_long_stream() -> None:
    """The default shadow (pages from 1/16, 16k tracked) over enough events that slots compact
    and the depth bound drops pages, the engine's way: a match, then its insert."""
    core, pure = twins({"l1": 3_000}, UNITS)
    ops = workload(6000, seed=11)
    for op, keys, n in ops:
        for s in (core, pure):
            if op == "match":
                s.reference(keys, n)
            else:
                s.insert(keys, True)
    assert core.curves() == pure.curves()
    assert_same_state(core, pure)


def test_the_end_prefilter_grows_with_the_end_set() -> None:
    """The core's end prefilter starts at 2^18 bits and doubles while the ends (both
    generations) have fewer than 16 bits each: 2^20 for the 40,000 here, the first doubling
    right after a rotation. It only rules keys out, so
    the ends found stay the pure twin's: past the growth, matches of old ends, young ends and
    fresh keys leave both in the same state."""
    core, pure = twins({"l1": 20_000}, UNITS, max_tracked=8192)  # ends rotate at 32,768

    def key(i: int) -> bytes:
        return hashlib.sha256(i.to_bytes(8, "little")).digest()

    for i in range(40_000):
        for s in (core, pure):
            s.insert([key(i)], True)
    core.drain()
    pure.drain()
    assert_same_state(core, pure)
    state = core._core.export()
    assert len(state["old"]) == 32_768 and len(state["young"]) == 40_000 - 32_768
    assert state["end_bits"] == 1 << 20
    rng = random.Random(5)
    for j in range(600):
        keys = [key(rng.randrange(45_000)) for _ in range(rng.randrange(1, 9))]
        for s in (core, pure):
            s.reference(list(keys), len(keys) * PAGE)
            if j % 3 == 0:
                s.insert(list(keys), j % 2 == 0)
    core.drain()
    pure.drain()
    assert_same_state(core, pure)
    assert core.curves() == pure.curves()


@pytest.mark.parametrize("its_insert_first", [False, True])
def test_a_queue_the_core_refuses_hands_its_state_back(its_insert_first: bool) -> None:
    """Keys the core does not take (shorter than 8 bytes, a tuple) mid-stream: the shadow plays
    on in Python, with the state the core had (a match pending: its touch, or its scan reused by
    its insert), exactly as the pure twin does."""
    core, pure = twins({"l1": 20_000}, UNITS, max_tracked=32)
    ops = workload(500, seed=4)
    at = next(j for j, op in enumerate(ops) if j > 250 and op[0] == "match")
    for j, (op, keys, n) in enumerate(ops):
        for s in (core, pure):
            if op == "match":
                s.reference(list(keys), n)
            else:
                s.insert(list(keys), True)
        if j == at:  # a match pending in the core when it hands over
            core.drain()
            pure.drain()
            assert core._core is not None and core._core.export()["pending"] is not None
            for s in (core, pure):
                if its_insert_first:
                    s.insert(list(keys), True)
                s.reference([b"short"], 5)
                s.insert((b"tuple-key-0123456",), True)
    assert core.curves() == pure.curves()
    assert core._core is None
    assert core._pages == pure._pages and core._tree.values == pure._tree.values


def test_refused_input_changes_nothing() -> None:
    core, _ = twins({"l1": 20_000}, UNITS, max_tracked=32)
    for op, keys, n in workload(80, seed=5):
        if op == "match":
            core.reference(list(keys), n)
        else:
            core.insert(list(keys), True)
    c = core._core
    c.on_refuse = None
    before = c.export()
    assert before["queued"] > 0
    good = [b"k" * 32]
    bad_keys = ["no list", tuple(good), [b"x" * 33], [good[0], "str"], [b"short"]]
    cases: list[tuple[Any, Any, Any]] = [(hook, keys, 1) for keys in bad_keys
                                         for hook in (c.match, c.insert)]
    cases += [(c.match, good, arg) for arg in (5.0, 1 << 70, "5", True)]
    cases += [(c.insert, good, arg) for arg in (1.0, "yes", None)]
    for hook, keys, arg in cases:
        with pytest.raises(ValueError):
            hook(keys, arg)
        assert c.export() == before
    with pytest.raises(TypeError):
        c.match(good)
    c.drain()
    assert c.export()["queued"] == 0
    edges = [1.0, 2.0, math.inf]
    kinds = (True, False, True)
    for args in [(True, 16, 100, 700, 0, 1, 16, 64, edges, kinds, 64),
                 (True, 16, 100, 700, 1 << 33, 1, 16, 64, edges, kinds, 64),
                 (True, 16, 100, 700, 1, 1, 0, 64, edges, kinds, 64),
                 (True, 16, 100, 700, 1, 1, 16, 64, [], kinds, 64),
                 (True, 16, 100, 700, 1, 1, 16, 64, [2.0, 1.0], kinds, 64),
                 (True, 16, 100, 700, 1, 1, 16, 64, ["1"], kinds, 64),
                 (True, 16, 100, 700, 1, 1, 16, 64, edges, (True, False), 64),
                 (True, 16, 100, 700, 1, 1, 16, 64, edges, kinds, 0)]:
        with pytest.raises((TypeError, ValueError)):
            _p.Core(*args)


def test_an_insert_shares_its_match_keys_only_while_they_are_the_same() -> None:
    """The queue keeps one copy of the keys an insert has in common with the match before it;
    an insert that parts from them (or is shorter) keeps its own, and plays as the pure twin."""
    k = [hashlib.sha256(b"%d" % i).digest() for i in range(12)]
    core, pure = twins({"l1": 2_000}, UNITS, rate=1.0, max_tracked=64)
    steps = [(True, k[:4]), (False, k[:6]), (True, k[:4]), (False, k[:2] + k[8:10]),
             (True, k[:6]), (False, k[:3]), (True, k[8:12]), (False, k[8:12]),
             (True, k[:5]), (False, [k[0], k[9]] + k[2:5])]
    for is_match, keys in steps:
        for s in (core, pure):
            if is_match:
                s.reference(list(keys), PAGE * len(keys))
            else:
                s.insert(list(keys), True)
    core.drain()
    pure.drain()
    assert_same_state(core, pure)
    assert core.curves() == pure.curves()


def test_a_shadow_with_an_l2_overlap_keeps_the_python_loop() -> None:
    assert Shadow({"l1": 1_000, "l2": 2_000}, UNITS, PAGE)._core is None
    assert Shadow({"l1": 1_000}, UNITS, PAGE)._core is not None


def test_a_call_back_into_the_core_while_it_exports_is_refused() -> None:
    """The collector may run a finalizer while the core builds its Python objects: a call back
    into the core then is refused (RuntimeError), and the export is whole. From on_refuse the
    core may be called again (nothing is in flight there)."""
    core, pure = twins({"l1": 20_000}, UNITS, max_tracked=64)
    for op, keys, n in workload(200, seed=7):
        for s in (core, pure):
            if op == "match":
                s.reference(list(keys), n)
            else:
                s.insert(list(keys), True)
    c = core._core
    c.drain()
    seen: list[str] = []

    def back(phase: str, info: dict[str, Any]) -> None:
        for call in (c.drain, c.tallies, c.export, c.trim, lambda: c.match([b"k" * 32], 16)):
            try:
                call()
                seen.append("ran")
            except RuntimeError:
                seen.append("refused")

    old = gc.get_threshold()
    hold: list[object] = [[] for _ in range(500)] + [{} for _ in range(500)]  # (no free lists)
    gc.callbacks.append(back)
    gc.set_threshold(1)
    try:
        got = c.export()
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(back)
    del hold
    assert seen and set(seen) == {"refused"}
    pure.drain()
    assert got["pages"] == pure._pages and got["values"] == pure._tree.values

    calls: list[int] = []

    def refuse(is_match: bool, keys: Any, arg: Any) -> None:
        c.drain()
        c.match([b"r" * 32], 16)
        calls.append(len(keys))

    c.on_refuse = refuse
    assert c.match([b"short"], 16) is None and calls == [1]
    assert c.export()["queued"] == 1
