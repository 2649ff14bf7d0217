"""The miss-ratio shadow against an exact LRU of bytes run at each size: equal when nothing is
sampled, close when sampled, bounded in what it tracks, and monotone."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import pytest

from tierstore.mrc import MULTIPLES, Shadow

PAGE = 16
UNITS = {"kv": 100, "state": 700}


def key(path: tuple[int, ...]) -> bytes:
    return hashlib.sha256(repr(path).encode()).digest()


class ExactLRU:
    """An LRU of page objects (KV bytes, plus the checkpoint's for a page a checkpoint
    follows) under the hybrid rule: a prompt is served up to its deepest checkpointed page
    whose whole prefix is resident. Deepest pages of a path are used first (least recent)."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.objects: OrderedDict[bytes, int] = OrderedDict()
        self.total = 0
        self.ends: set[bytes] = set()
        self.hit = 0

    def _touch(self, keys: list[bytes], create: bool) -> None:
        for k in reversed(keys):
            if k in self.objects:
                self.objects.move_to_end(k)
            elif create:
                size = UNITS["kv"] + (UNITS["state"] if k in self.ends else 0)
                self.objects[k] = size
                self.total += size
        while self.total > self.capacity:
            _, size = self.objects.popitem(last=False)
            self.total -= size

    def insert(self, keys: list[bytes]) -> None:
        if keys[-1] not in self.ends:
            self.ends.add(keys[-1])
            if keys[-1] in self.objects:
                self.objects[keys[-1]] += UNITS["state"]
                self.total += UNITS["state"]
        self._touch(keys, True)

    def match(self, keys: list[bytes]) -> None:
        best = 0
        for i, k in enumerate(keys):
            if k not in self.objects:
                break
            if k in self.ends:
                best = i + 1
        self.hit += best * PAGE
        if best:
            self._touch(keys[:best], False)


def workload(n: int, seed: int) -> list[tuple[str, list[bytes], int]]:
    """Prompts over a few shared system prompts and zipf-ish conversations that grow."""
    rng = random.Random(seed)
    systems = [[key((s,)), key((s, -1))] for s in range(4)]  # 2-page system prompts
    convs: list[list[bytes]] = []
    ops = []
    for _ in range(n):
        if not convs or rng.random() < 0.3:
            convs.append(list(systems[rng.randrange(4)]))
        c = convs[min(int(rng.paretovariate(1.2)) - 1, len(convs) - 1)]
        if len(c) > 40:  # a conversation that grew too long starts over
            del c[2:]
        for _ in range(rng.randrange(1, 4)):  # chained: each page key covers its prefix
            c.append(hashlib.sha256(c[-1] + rng.randbytes(8)).digest())
        keys = list(c)
        tail = rng.randrange(PAGE)
        ops.append(("match", keys[:-1], (len(keys) - 1) * PAGE + tail))
        ops.append(("insert", keys, 0))
    return ops


def curves(shadow: Shadow) -> dict[str, Any]:
    """The shadow's curves, typed loosely for the tests' reads."""
    out: dict[str, Any] = shadow.curves()
    return out


def run(shadow: Shadow, oracles: dict[float, ExactLRU], ops: list) -> int:
    tokens = 0
    for op, keys, n in ops:
        if op == "match":
            shadow.reference(keys, n)
            tokens += n
            for o in oracles.values():
                o.match(keys)
        else:
            shadow.insert(keys, True)
            for o in oracles.values():
                o.insert(keys)
    return tokens


def test_unsampled_shadow_equals_an_exact_lru_at_every_size() -> None:
    capacity = 30_000
    ops = workload(600, seed=1)
    shadow = Shadow({"l1": capacity}, UNITS, PAGE, rate=1.0)
    oracles = {m: ExactLRU(m * capacity) for m in MULTIPLES}
    tokens = run(shadow, oracles, ops)
    curve = curves(shadow)["tiers"]["l1"]["hit_rate"]
    exact = [oracles[m].hit / tokens for m in MULTIPLES]
    assert exact[-1] > exact[0] > 0  # the sizes matter on this workload
    # The shadow serves what an unbounded cache would (its accesses do not depend on size),
    # the oracle what it hit: a small difference, measured here.
    assert curve == pytest.approx(exact, abs=0.01)


class TwoTiers:
    """L1 and L2 as the store runs them (``Mover``): L1 an LRU of ``c1`` bytes whose victims
    are copied down to L2 unless L2 holds them; a page served from L2 (or inserted while L2
    holds it) is *copied* into L1 and L2 keeps its copy; L2 evicts by last use (kept for every
    page: a node's ``last_use``), making room before the copy goes in. A request's pages come
    in together (its path is locked meanwhile), then L1 makes room. A candidate's tokens are
    counted in the tier holding its deepest page, as the shadow counts them."""

    def __init__(self, c1: float, c2: float, write_through: bool = False) -> None:
        self.c1, self.c2, self.write_through = c1, c2, write_through
        self.l1: OrderedDict[bytes, int] = OrderedDict()
        self.l2: dict[bytes, int] = {}
        self.used: dict[bytes, int] = {}
        self.ends: set[bytes] = set()
        self.clock = 0
        self.hit = {1: 0, 2: 0}

    def _size(self, k: bytes) -> int:
        return UNITS["kv"] + (UNITS["state"] if k in self.ends else 0)

    def _touch(self, keys: list[bytes], create: bool) -> None:
        for k in reversed(keys):
            self.clock += 1
            self.used[k] = self.clock
            if k in self.l1:
                self.l1.move_to_end(k)
            elif create or k in self.l2:
                self.l1[k] = self._size(k)
        held = sum(self.l1.values())
        while held > self.c1:
            k, size = self.l1.popitem(last=False)
            held -= size
            self._copy_down(k, size)

    def _copy_down(self, k: bytes, size: int) -> None:
        if k in self.l2:
            return
        room = self.c2 - sum(self.l2.values())
        while self.l2 and room < size:
            room += self.l2.pop(min(self.l2, key=self.used.__getitem__))
        if size <= self.c2:
            self.l2[k] = size

    def insert(self, keys: list[bytes]) -> None:
        if keys[-1] not in self.ends:
            self.ends.add(keys[-1])
            for tier in (self.l1, self.l2):
                if keys[-1] in tier:
                    tier[keys[-1]] += UNITS["state"]
        self._touch(keys, True)
        if self.write_through:  # Mover.backup: the inserted path, root first
            for k in keys:
                if k in self.l1:
                    self._copy_down(k, self.l1[k])

    def match(self, keys: list[bytes]) -> None:
        best = 0
        for i, k in enumerate(keys):
            if k not in self.l1 and k not in self.l2:
                break
            if k in self.ends:
                best = i + 1
        done = 0
        for i in range(best):
            if keys[i] in self.ends:
                self.hit[1 if keys[i] in self.l1 else 2] += (i + 1 - done) * PAGE
                done = i + 1
        if best:
            self._touch(keys[:best], False)


@pytest.mark.parametrize(("seed", "n", "c1", "c2"), [(2, 600, 10_000, 20_000),
                                                     (1, 1500, 20_000, 30_000),
                                                     (3, 1500, 10_000, 60_000)])
def test_l2_curve_follows_its_copies_of_l1(seed: int, n: int, c1: int, c2: int) -> None:
    """L2 keeps a copy of what it promotes, so it is partly inclusive of L1: an L2 at ``m``
    times its size serves what lies within ``C1 + m*C2 - D_m``, ``D_m`` the bytes of L1's
    pages it holds copies of at that size, measured per multiple. Checked against the two
    tiers simulated at each multiple; the exclusive reading (L2 = the next ``m*C2`` bytes
    after L1, an LRU of ``C1 + m*C2`` less L1's hits) misses the first run by ~6 points."""
    ops = workload(n, seed=seed)
    shadow = Shadow({"l1": c1, "l2": c2}, UNITS, PAGE, rate=1.0)
    checked = (0.5, 1.0, 2.0, 4.0)
    sims = {m: TwoTiers(c1, m * c2) for m in checked}
    exclusive = {m: ExactLRU(c1 + m * c2) for m in checked} if seed == 2 else {}
    tokens = run(shadow, exclusive, ops)
    for op, keys, _ in ops:
        for sim in sims.values():
            (sim.match if op == "match" else sim.insert)(keys)
    tiers = curves(shadow)["tiers"]
    at = [MULTIPLES.index(m) for m in checked]
    l2 = [sims[m].hit[2] / tokens for m in checked]
    total = [(sims[m].hit[1] + sims[m].hit[2]) / tokens for m in checked]
    assert [tiers["l2"]["hit_rate"][i] for i in at] == pytest.approx(l2, abs=0.01)
    assert [tiers["l2"]["total_hit_rate"][i] for i in at] == pytest.approx(total, abs=0.01)
    l1 = sims[1.0].hit[1] / tokens
    assert tiers["l1"]["hit_rate"][MULTIPLES.index(1.0)] == pytest.approx(l1, abs=0.005)
    if exclusive:  # the correction is not vacuous: the exclusive reading was off here
        off = [exclusive[m].hit / tokens - l1 - v for m, v in zip(checked, l2, strict=True)]
        assert max(off) > 0.04


def test_l2_curve_under_write_through() -> None:
    """Write-through copies every inserted page down at once: L2 holds copies of nearly all of
    L1, and the shadow (told the policy) follows it."""
    ops = workload(1500, seed=1)
    c1, c2 = 20_000, 30_000
    shadow = Shadow({"l1": c1, "l2": c2}, UNITS, PAGE, rate=1.0, write_through=True)
    checked = (0.5, 1.0, 2.0, 4.0)
    sims = {m: TwoTiers(c1, m * c2, write_through=True) for m in checked}
    back = {m: TwoTiers(c1, m * c2) for m in checked}
    tokens = run(shadow, {}, ops)
    for op, keys, _ in ops:
        for sim in (*sims.values(), *back.values()):
            (sim.match if op == "match" else sim.insert)(keys)
    at = [MULTIPLES.index(m) for m in checked]
    l2 = [sims[m].hit[2] / tokens for m in checked]
    assert [curves(shadow)["tiers"]["l2"]["hit_rate"][i] for i in at] == pytest.approx(l2,
                                                                                   abs=0.01)
    assert max(b.hit[2] / tokens - v for b, v in zip(back.values(), l2, strict=True)) > 0.02


@pytest.mark.parametrize("unbounded_below", [True, False])
def test_sampled_shadow_stays_close_and_bounded(unbounded_below: bool) -> None:
    capacity = 60_000
    ops = workload(1500, seed=3)
    exact_shadow = Shadow({"l1": capacity}, UNITS, PAGE, rate=1.0)
    sampled = Shadow({"l1": capacity}, UNITS, PAGE, max_tracked=1000,  # pages from 1/16
                     unbounded_below=unbounded_below)
    run(exact_shadow, {}, ops)
    run(sampled, {}, ops)
    info = curves(sampled)["sampling"]
    assert info["rate"] < 0.5
    # Above an unbounded tier every distance counts: the ends' rate halves. Else pages past
    # the curves' depth are dropped first, and all of the 1,500 ends stay sampled.
    assert (info["end_rate"] < 1) == unbounded_below
    assert info["tracked_pages"] <= 1000 and info["tracked_ends"] <= 1000
    exact = curves(exact_shadow)["tiers"]["l1"]["hit_rate"]
    est = curves(sampled)["tiers"]["l1"]["hit_rate"]
    # Sampling follows Python's per-process hash seed: six seeds gave 0.9-2.6 points at most.
    assert est == pytest.approx(exact, abs=0.05)


def test_curves_grow_with_size_and_bad_settings_are_refused() -> None:
    shadow = Shadow({"l1": 5_000}, UNITS, PAGE)
    run(shadow, {}, workload(300, seed=4))
    curve = curves(shadow)["tiers"]["l1"]["hit_rate"]
    assert curve == sorted(curve) and curve[0] >= 0 and curve[-1] <= 1
    with pytest.raises(ValueError):
        Shadow({"l1": 1}, UNITS, PAGE, rate=0)
    with pytest.raises(ValueError):
        Shadow({"l1": 1}, UNITS, PAGE, max_tracked=2)


class _EagerShadow(Shadow):
    """The shadow touching a match's pages at once, as before the match -> insert fast path."""

    def _reference(self, keys: Sequence[bytes], n_tokens: int) -> None:
        super()._reference(keys, n_tokens)
        pending, self._pending = self._pending, None
        if pending is not None:
            self._flush(pending)


@pytest.mark.parametrize(("max_tracked", "l2_points"), [(16, 2.0), (1000, 0.25), (None, 0.0)])
def test_a_match_touch_left_to_its_insert_changes_no_curve(max_tracked: int | None,
                                                           l2_points: float) -> None:
    # 16 tracked: rates halve and checkpoint-end generations rotate many times on the way
    # (above an unbounded tier, so that no page is dropped for its depth and every rate
    # halves; on other seeds L2 differs by 1-13 points at 16 tracked, 2-5 with the depth bound).
    # The stack and L1's curve are the same either way. L2's copy bits are not quite: the
    # insert reads those of pages past the match's path before the match's pages move (as
    # one request), the eager touch after; equal unsampled, within ``l2_points`` sampled.
    ops = workload(800, seed=4)
    kw: dict[str, Any] = {"max_tracked": max_tracked, "unbounded_below": max_tracked == 16} \
        if max_tracked else {"rate": 1.0}
    lazy = Shadow({"l1": 20_000, "l2": 40_000}, UNITS, PAGE, **kw)
    eager = _EagerShadow({"l1": 20_000, "l2": 40_000}, UNITS, PAGE, **kw)
    for op, keys, n in ops:
        for s in (lazy, eager):
            if op == "match":
                s.reference(keys, n)
            else:  # half the inserts are of another prompt than the match before them
                s.insert(keys if n % 2 == 0 else keys[:-2] or keys, True)
    a, b = curves(lazy), curves(eager)
    def order(s: Shadow) -> list[tuple[bytes, int]]:  # the stack, oldest first
        return [(k, c & 1) for k, c in sorted(s._pages.items(), key=lambda kv: kv[1])]

    assert order(lazy) == order(eager)
    assert a["tiers"]["l1"]["hit_rate"] == b["tiers"]["l1"]["hit_rate"]
    for field in ("hit_rate", "total_hit_rate"):
        assert a["tiers"]["l2"][field] == pytest.approx(
            b["tiers"]["l2"][field], abs=l2_points / 100)
    if max_tracked:
        assert a["sampling"]["rate"] < 1


class _UnqueuedShadow(Shadow):
    """The shadow playing every event as it comes, as before events were queued."""

    def reference(self, keys: Sequence[bytes], n_tokens: int) -> None:
        self._reference(keys, n_tokens)

    def insert(self, keys: Sequence[bytes], checkpoint: bool) -> None:
        self._insert(keys, checkpoint)


def test_queued_events_change_no_curve() -> None:
    ops = workload(800, seed=6)
    queued = Shadow({"l1": 20_000, "l2": 40_000}, UNITS, PAGE, max_tracked=64)
    now = _UnqueuedShadow({"l1": 20_000, "l2": 40_000}, UNITS, PAGE, max_tracked=64)
    for i, (op, keys, n) in enumerate(ops):
        for s in (queued, now):
            if op == "match":
                s.reference(keys, n)
            else:
                s.insert(keys, True)
        if i == 301:  # a read mid-way plays what is queued
            assert queued._queue and curves(queued) == curves(now) and not queued._queue
    assert queued._queue  # some events left queued at the end: curves() plays them
    assert curves(queued) == curves(now)
    assert curves(queued)["sampling"]["rate"] < 1


def test_slot_sums_match_a_plain_sum() -> None:
    rng = random.Random(5)
    shadow = Shadow({"l1": 1_000}, UNITS, PAGE, rate=1.0, max_tracked=16)
    slots = shadow._tree
    values = [0.0] * len(slots.values)
    for _ in range(2000):
        i = rng.randrange(len(values))
        d = float(rng.randrange(-50, 100))
        slots.add(i, d)
        values[i] += d
        j = rng.randrange(len(values))
        end = rng.randrange(j, len(values) + 1)
        assert slots.suffix(j, end) == sum(values[j:end])
