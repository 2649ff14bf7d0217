"""The accounting switch (``StoreConfig.attribution`` / ``mrc``: off, the store keeps null
parts and caches exactly as with them on), the ghost's one-lookup shortcut (equal to
counting every missing page) and the one-step count of a match L1 serves whole (equal to
``explain`` + ``settle``)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from tierstore.attribution import (
    EVICTED_FROM,
    LOST,
    Attribution,
    Explanation,
    NoAttribution,
    explanation,
)
from tierstore.config import StoreConfig
from tierstore.mrc import NoShadow, Shadow
from tierstore.radix import Segment
from tierstore.store import TierStore

from .conftest import HYBRID, PAGE, SWA_ONLY, layout


def _store(config: dict, *, on: bool, mrc: bool | None = None, l1_pages: int = 6,
           l2_pages: int = 0) -> TierStore:
    lay = layout(config)
    units = {k: e.nbytes for k, e in lay.envelopes().items()}
    per_page = units["kv"] + units.get("swa", 0)
    state = 2 * units.get("state", 0)
    return TierStore(lay, StoreConfig(
        capacity_bytes=l1_pages * per_page + state + 256,
        host_capacity_bytes=l2_pages * per_page + state if l2_pages else 0,
        attribution=on, mrc=on if mrc is None else mrc))


def _workload(seed: int, n: int) -> list[tuple[str, list[int]]]:
    """Inserts and matches over a few branching families, most prompts sharing a trunk."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        family = rng.randrange(3)
        trunk = [family * 1000 + t for t in range(rng.randrange(4) * PAGE)]
        own = [100_000 + (i % 7) * 500 + rng.randrange(3) * 50 + t
               for t in range(rng.randrange(1, 5) * PAGE)]
        out.append((rng.choice(["insert", "match", "match"]), trunk + own))
    return out


def _run(s: TierStore, ops: list[tuple[str, list[int]]]) -> list[tuple[int, dict[str, int]]]:
    """Replay ``ops``; per match, the tokens it hit and its lost split."""
    units = {k: e.nbytes for k, e in s.layout.envelopes().items()}
    seen = []
    for op, toks in ops:
        if op == "insert":
            pages = len(toks) // PAGE
            given: dict[str, torch.Tensor] = {
                k: torch.zeros(pages, units[k], dtype=torch.uint8)
                for k in ("kv", "swa") if k in units}
            if "state" in units:
                given["state"] = torch.zeros(units["state"], dtype=torch.uint8)
            s.insert(toks, **given)  # type: ignore[arg-type]
        else:
            m = s.match(toks + [5])
            seen.append((m.tokens, dict(m.lost)))
            if m.lease is not None:
                s.release(m.lease)
    s.check_integrity()
    return seen


def test_off_keeps_null_parts_and_caches_the_same() -> None:
    for config in (HYBRID, SWA_ONLY):
        ops = _workload(seed=1, n=120)
        on, off = _store(config, on=True, l2_pages=4), _store(config, on=False, l2_pages=4)
        assert isinstance(off.attribution, NoAttribution) and isinstance(off.mrc, NoShadow)
        assert isinstance(on.attribution, Attribution) and isinstance(on.mrc, Shadow)
        assert off.mover.on_drop is None  # no ghost hears of drops
        with_parts, without = _run(on, ops), _run(off, ops)
        assert [t for t, _ in with_parts] == [t for t, _ in without]  # hits unchanged
        assert any(lost for _, lost in with_parts)
        assert all(lost == {} for _, lost in without)  # no split when off
        stats = off.stats()
        assert stats.attribution is None and stats.mrc is None
        assert stats.tokens_hit == on.stats().tokens_hit
        assert on.stats().attribution is not None and on.stats().mrc is not None


def test_each_part_switches_alone() -> None:
    only_mrc = _store(HYBRID, on=False, mrc=True)
    assert isinstance(only_mrc.attribution, NoAttribution) and isinstance(only_mrc.mrc, Shadow)
    _run(only_mrc, _workload(seed=2, n=40))
    assert only_mrc.stats().mrc is not None and only_mrc.stats().attribution is None


def test_held_shortcut_settles_as_explain_and_settle() -> None:
    """A match L1 serves whole is settled in one step (``Attribution.settle_held``): against a
    store whose ``settle_held`` is ``explain`` + ``settle`` spelled out, every match gets the
    same split, and the totals, the warning window and the ghost end the same. Both of its
    ways ran: the next page cold, and remembered by the ghost (handed to ``explain``)."""
    took = {"cold": 0, "remembered": 0}
    cases = [(HYBRID, 4, 0, 16), (HYBRID, 6, 4, 8), (SWA_ONLY, 5, 0, 16), (HYBRID, 3, 3, 1024)]
    for seed, (config, l1, l2, capacity) in enumerate(cases):
        fast, slow = (_store(config, on=True, l1_pages=l1, l2_pages=l2) for _ in range(2))
        f, a = fast.attribution, slow.attribution
        assert isinstance(f, Attribution) and isinstance(a, Attribution)
        for x in (f, a):
            x.ghost.__init__(capacity)  # type: ignore[misc]  # small: generations rotate
            x.window = 16  # the window's check runs often

        def spelled_out(namespace: str, n_tokens: int, keys: Sequence[bytes],
                        path: Sequence[Segment], pages: int, sources: dict[int, int],
                        a: Attribution = a) -> tuple[dict[str, int], dict[str, int]]:
            why = a.explain(path, keys, pages)
            return a.settle(namespace, n_tokens, len(keys), why, [(pages, "ok")], pages,
                            sources)

        def counted(namespace: str, n_tokens: int, keys: Sequence[bytes],
                    path: Sequence[Segment], pages: int, sources: dict[int, int],
                    f: Attribution = f, held: Any = f.settle_held
                    ) -> tuple[dict[str, int], dict[str, int]]:
            if pages < len(keys):
                took["remembered" if keys[pages] in f.ghost else "cold"] += 1
            return held(namespace, n_tokens, keys, path, pages, sources)

        a.settle_held = spelled_out  # type: ignore[method-assign]
        f.settle_held = counted  # type: ignore[method-assign]
        ops = _workload(seed=20 + seed, n=600)
        assert _run(fast, ops) == _run(slow, ops)
        assert f.snapshot() == a.snapshot()
        window = ("_w_base", "_w_share", "_w_next")
        assert [getattr(f, w) for w in window] == [getattr(a, w) for w in window]
        assert (f._w.requests, f._w.shared) == (a._w.requests, a._w.shared)
    assert took["cold"] > 40 and took["remembered"] > 10, took


def _slow(ghost_tier: object, keys: Sequence[bytes], walked: int) -> tuple[dict, dict]:
    """Every missing page looked up on its own, as the shortcut must agree with."""
    names = {1: "l1", 2: "l2", 3: "l3", 4: "disk"}
    lost: dict[str, int] = {}
    evicted: dict[str, int] = {}
    for key in keys[walked:]:
        tier = ghost_tier(key)  # type: ignore[operator]
        reason = "evicted" if tier else "cold"
        lost[reason] = lost.get(reason, 0) + PAGE
        if tier:
            evicted[names[tier]] = evicted.get(names[tier], 0) + PAGE
    return lost, evicted


def test_one_lookup_shortcut_equals_counting_every_page() -> None:
    checked = remembered = 0
    for seed, (l1, l2, capacity) in enumerate([(4, 0, 16), (6, 4, 8), (3, 3, 1 << 10)]):
        s = _store(HYBRID, on=True, l1_pages=l1, l2_pages=l2)
        attribution = s.attribution
        assert isinstance(attribution, Attribution)
        attribution.ghost.__init__(capacity)  # type: ignore[misc]  # small: generations rotate
        explain = attribution.explain

        def checked_explain(path: Sequence[Segment], keys: Sequence[bytes], full: int,
                            explain=explain, a=attribution) -> Explanation:
            nonlocal checked, remembered
            out = explain(path, keys, full)
            walked = sum(seg.pages for seg in path)
            if full < len(keys) and walked < len(keys):  # every page counted, no shortcut
                slow = explanation(full)
                if walked > full:
                    a._beyond(slow, path, walked)
                a._unknown(slow, keys, walked)
                assert (out[LOST], out[EVICTED_FROM]) == (slow[LOST], slow[EVICTED_FROM])
                fresh = explanation(full)  # and _unknown agrees with a lookup per page
                a._unknown(fresh, keys, walked)
                assert (fresh[LOST], fresh[EVICTED_FROM]) == _slow(a.ghost.tier, keys, walked)
                checked += 1
                remembered += bool(fresh[EVICTED_FROM])
            return out

        attribution.explain = checked_explain  # type: ignore[method-assign]
        _run(s, _workload(seed=10 + seed, n=300))
    assert checked > 100 and remembered > 10  # both paths ran


def test_bench_ops_runs_the_loop_with_accounting_on_and_off() -> None:
    """``bench ops --accounting-off``: two bare loops, on and off, on the same prompts; both
    hit alike, and the rise is reported per phase (no timed assertion: a figure)."""
    import argparse
    import json

    from tierstore.bench import ops

    parser = argparse.ArgumentParser()
    ops.add_arguments(parser)
    args = parser.parse_args(["--model", "qwen3-next-80b-a3b", "--sizes", "300",
                              "--requests", "40", "--real-pages", "0", "--turn", "16",
                              "--fill-min-requests", "60", "--accounting-off"])
    result = ops.run(args)
    json.dumps(result)
    row = result["rows"][0]
    assert {"accounting-on", "accounting-off"} <= set(row["systems"])
    for phase in ("fill", "steady"):
        figures = row["accounting"][phase]
        assert figures["same_hits"] and figures["failed"] == 0
        assert figures["on_us"] > 0 and figures["off_us"] > 0 and figures["rise"] is not None
        assert figures["rise_median"] is not None and figures["order"] == "alternate"
    assert result["max_accounting_rise"] == row["accounting"]["steady"]["rise"]
    assert "accounting on/off at 300 pages" in ops.render(result)
