"""Per-request cost of the core as the cache grows: an engine-shaped loop at 10³-10⁶ pages.

Each request is one of ``--prefixes`` shared prefixes (``--shared-pages`` each) plus private
pages (``--private-pages``) of ``--page-size`` tokens. Like an engine's scheduler, the loop
calls ``match`` (the shared prefix hits), ``allocate`` for the pages the match did not cover
(KV, SWA for layouts with sliding-window layers, and a state checkpoint for hybrid layouts),
``insert`` with only those new blocks, and ``release``. Two phases are timed per size: *fill*,
from an empty cache (the prefixes cached) to the first eviction, and *steady*, ``--requests``
requests after it, per operation (``evict`` is the part of ``allocate`` spent choosing and
demoting victims). A small cache fills in a few dozen requests, too few to time, so the fill
runs again on fresh systems (the same prompts) until ``--fill-min-requests`` requests have run
(``fill_repeats`` fills of ``fill_requests`` each; a long fill runs once); its figures are over
all of them. ``moved_per_allocated`` is the bytes compaction copied per byte allocated during
fill.

In the same run, a floor: a plain ``dict`` of chained page hashes with an ``OrderedDict`` LRU
and a free list doing the same bookkeeping (hash once, walk, evict the oldest, hand out ids),
without the hybrid rule, tiers or an arena; it hashes with the store's hasher (compiled where
built), and ``floor-hashlib`` does the same through ``hashlib``, as a plain Python cache would.
With ``--vs vllm,sglang`` the same prompts also go
through vLLM's ``KVCacheManager`` (hybrid and one-group) and SGLang's ``RadixCache`` where they
import (:mod:`tierstore.bench._ops_vs`; skipped with the reason where not). Systems take turns
of ``--turn`` requests (interleaved, so load on a shared machine hits all alike); times are the
calling thread's CPU time. Before each turn the objects alive so far are frozen out of the
cyclic collector's reach (``gc.freeze``, as servers do after start-up, vLLM included): a full
collection walks every object of every system in the process, hundreds of thousands of tree
nodes at large sizes, and would be charged to whichever system happened to trigger it. The
per-operation figures come from a loop that reads the clock
around each call (~17 reads a request, which the other systems do not pay); the headline
(``us_per_request``, the ``vs_*`` ratios) from a second store run bare on the same prompts, as
the other systems are run (``timed_us_per_request`` is the timed loop's total).
``growth`` is µs per request at the largest size over the smallest.
The device is ``meta`` (accounting only); one extra row (``--real-pages``) runs a scaled layout
on real CPU bytes.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from tierstore.bench._ops_acct import (
    ORDERS,
    BareLoop,
    accounting_pair,
    rise,
    turn_order,
)
from tierstore.bench._ops_vs import ENGINES, DictFloor, System, make_systems
from tierstore.bench._util import ratio, table
from tierstore.config import StoreConfig
from tierstore.hashing import PageHasher
from tierstore.layout import ModelLayout, load_preset, preset_names
from tierstore.scaling import scale_layout
from tierstore.store import TierStore

OPS = ("match", "allocate", "insert", "release", "evict", "accounting")
# Observability the store does per request besides caching (miss attribution, the miss-ratio
# shadow): timed apart, as ``accounting``, so the caching work stays comparable across commits.
_ACCOUNTING = (("mrc", "reference"), ("mrc", "insert"), ("attribution", "explain"),
               ("attribution", "settle"),
               ("mover", "on_drop"))  # on_drop: the ghost index hears of dropped pages
# CPU time of this thread: the loop is pure CPU work (no I/O on a meta / CPU arena without
# tiers), and on a shared machine wall time mostly measures the other processes.
_now = time.thread_time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt-oss-20b", choices=preset_names())
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--sizes", default="2000,50000,500000",
                        help="cached pages at which to measure (comma-separated)")
    parser.add_argument("--requests", type=int, default=2000,
                        help="timed steady-state requests per size")
    parser.add_argument("--shared-pages", type=int, default=8)
    parser.add_argument("--prefixes", type=int, default=8, help="distinct shared prefixes")
    parser.add_argument("--private-pages", type=int, default=24)
    parser.add_argument("--real-pages", type=int, default=10000,
                        help="cached pages of the real-CPU-bytes row (0: skip it)")
    parser.add_argument("--vs", default="",
                        help=f"engines to run the same loop through ({','.join(ENGINES)})")
    parser.add_argument("--turn", type=int, default=50,
                        help="requests per system per turn when systems interleave")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accounting-off", action="store_true",
                        help="also run the loop bare on two stores, accounting on and off, "
                             "interleaved: the rise of on over off (tierstore.bench._ops_acct)")
    parser.add_argument("--pair-order", default="alternate", choices=ORDERS,
                        help="the accounting pair's order within each turn: swapped every turn "
                             "(alternate) or on before off every turn (fixed, rounds 5-7)")
    parser.add_argument("--fill-min-requests", type=int, default=2000,
                        help="requests each size's fill phase runs at least: a fill shorter "
                             "than this is repeated on fresh systems, same prompts")


class Prompts:
    """The request stream: a random shared prefix plus random private pages."""

    def __init__(self, page: int, shared: int, private: int, prefixes: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.page, self.private = page, private
        self.prefixes = [self.rng.integers(0, 150_000, shared * page, dtype=np.int64)
                         for _ in range(prefixes)]

    def __next__(self) -> np.ndarray:
        shared = self.prefixes[int(self.rng.integers(len(self.prefixes)))]
        tail = self.rng.integers(0, 150_000, self.private * self.page, dtype=np.int64)
        return np.concatenate([shared, tail])

    def __iter__(self) -> Iterator[np.ndarray]:
        return self


class EngineLoop:
    """Drives one store with the requests of the module docstring and times each call (for
    the per-operation figures; its clock reads cost the loop time the other systems do not
    pay, so the headline figures come from a bare loop beside it)."""

    name = "tierstore-timed"

    def __init__(self, store: TierStore) -> None:
        self.store = store
        self.page = store.layout.page_size
        self.state = "state" in store.kinds
        self.swa = "swa" in store.kinds
        self.seconds = dict.fromkeys(OPS, 0.0)
        self.failed = 0
        self._evict_s = 0.0
        make_room = store.mover.make_room

        def timed(demand: Any) -> bool:  # the bench's own wrapper: no timing in the core
            t = _now()
            try:
                return make_room(demand)
            finally:
                self._evict_s += _now() - t

        store.mover.make_room = timed  # type: ignore[method-assign]
        self._acct_s = 0.0
        for owner_name, method in _ACCOUNTING:
            owner = store if owner_name is None else getattr(store, owner_name, None)
            if owner is not None and getattr(owner, method, None) is not None:
                setattr(owner, method, self._timed(getattr(owner, method)))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = _now()
            try:
                return fn(*args, **kwargs)
            finally:
                self._acct_s += _now() - t
        return timed

    def demand(self, pages: int) -> dict[str, int]:
        """Blocks a request computing ``pages`` new pages asks for."""
        return {"kv": pages, **({"swa": pages} if self.swa else {}),
                **({"state": 1} if self.state else {})}

    def warm(self, prefixes: list[np.ndarray]) -> None:
        """Cache the shared prefixes with their checkpoints (the system prompts)."""
        store = self.store
        for shared in prefixes:
            got = store.allocate(self.demand(len(shared) // self.page))
            assert got is not None, "the arena cannot hold even the shared prefixes"
            store.insert(shared, kv=got["kv"], swa=got["swa"] if self.swa else None,
                         state=got["state"] if self.state else None)

    def step(self, prompt: np.ndarray) -> None:
        store = self.store
        self._acct_s = 0.0
        t0 = _now()
        m = store.match(prompt)
        t1 = _now()
        acct_match = self._acct_s
        self._evict_s = 0.0
        got = store.allocate(self.demand(len(prompt) // self.page - m.pages))
        t2 = _now()
        evict = self._evict_s
        if got is None:
            self.failed += 1
        else:
            store.insert(prompt, kv=got["kv"], swa=got["swa"] if self.swa else None,
                         state=got["state"] if self.state else None)
        t3 = _now()
        if m.lease is not None:
            store.release(m.lease)
        t4 = _now()
        acct = self._acct_s
        parts = (t1 - t0 - acct_match, t2 - t1 - evict, t3 - t2 - (acct - acct_match), t4 - t3,
                 evict, acct)
        for op, s in zip(OPS, parts, strict=True):
            self.seconds[op] += s

    def evictions(self) -> int:
        return self.store.stats().evictions


def _store(layout: ModelLayout, pages: int, per_request: int, device: str,
           accounting: bool = True) -> TierStore:
    envelopes = {k: e.nbytes for k, e in layout.envelopes().items()}
    checkpoints = pages // per_request + 2 if "state" in envelopes else 0
    capacity = pages * (envelopes["kv"] + envelopes.get("swa", 0)) \
        + checkpoints * envelopes.get("state", 0)
    return TierStore(layout, StoreConfig(capacity_bytes=capacity, device=device,
                                         attribution=accounting, mrc=accounting))


class _Clock:
    """CPU seconds and requests per system, per phase, and each turn's seconds per system."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.requests: dict[str, int] = {}
        self.turns: dict[str, list[float]] = {}
        self.count = 0  # turns run so far (which of the accounting pair goes first)

    def add(self, name: str, seconds: float, requests: int) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.requests[name] = self.requests.get(name, 0) + requests
        self.turns.setdefault(name, []).append(seconds)

    def run(self, system: System, prompts: list[np.ndarray]) -> None:
        step = system.step
        gc.freeze()
        start = _now()
        for p in prompts:
            step(p)
        self.add(system.name, _now() - start, len(prompts))

    def us(self, name: str) -> float | None:
        n = self.requests.get(name, 0)
        return self.seconds[name] / n * 1e6 if n else None


class _Systems:
    """One fresh set of a row's systems, warmed with the shared prefixes, and the prompt
    stream they share (from ``--seed``: every set sees the same prompts)."""

    def __init__(self, layout: ModelLayout, pages: int, args: argparse.Namespace, device: str,
                 engines: list[str]) -> None:
        def store(accounting: bool = True) -> TierStore:
            return _store(layout, pages, args.private_pages, device, accounting)

        self.store = store()
        self.loop = EngineLoop(self.store)
        hasher = PageHasher(layout.name, layout.fingerprint, layout.page_size, memo_bytes=0)
        self.floor = DictFloor(hasher, pages)
        # The same floor hashing through hashlib, as the floor did: the store's hasher
        # is compiled where tierstore._c_chain is built, and so is ``floor``'s.
        self.floor_py = DictFloor(PageHasher(layout.name, layout.fingerprint, layout.page_size,
                                             memo_bytes=0, native=False), pages, "floor-hashlib")
        self.others, self.skipped = make_systems(engines, layout, pages) if engines else ([], {})
        self.pair = accounting_pair(store) if args.accounting_off and device == "meta" else []
        # The headline: the same store run bare (no clock reads inside a request), as the other
        # systems are; the pair's accounting-on loop is one when there is a pair.
        self.bare = self.pair[0] if self.pair else BareLoop("tierstore", store())
        self.all: list[System] = [self.loop, self.floor, self.floor_py, *self.others,
                                  *(self.pair if self.pair else [self.bare])]
        self.prompts = Prompts(layout.page_size, args.shared_pages, args.private_pages,
                               args.prefixes, args.seed)
        self.loop.warm(self.prompts.prefixes)
        for system in self.all[1:]:
            for shared in self.prompts.prefixes:
                system.step(shared)

    def fill(self, clock: _Clock, turn: int, order: str) -> tuple[int, int, int]:
        """Run every system from empty to the store's first eviction, systems taking turns of
        ``turn`` requests; the requests run, and the bytes compaction moved and allocated."""
        loop = self.loop
        before, requests = self.store.arena.stats(), 0
        while loop.evictions() == 0:  # the store leads each turn; the others follow its prompts
            prompts = [next(self.prompts) for _ in range(turn)]
            gc.freeze()
            start = _now()
            for i, p in enumerate(prompts):
                loop.step(p)
                if loop.evictions():
                    prompts = prompts[: i + 1]
                    break
            clock.add(loop.name, _now() - start, len(prompts))
            requests += len(prompts)
            self.turn(clock, prompts, order, self.all[1:])
        after = self.store.arena.stats()
        return (requests, after.moved_bytes - before.moved_bytes,
                after.allocated_bytes - before.allocated_bytes)

    def turn(self, clock: _Clock, prompts: list[np.ndarray], order: str,
             systems: list[System] | None = None) -> None:
        """One turn of ``systems`` (all by default) on ``prompts``, the pair in this turn's
        order."""
        # Split, the pair's first follows the floor: cold, as the other systems run.
        for system in turn_order(list(systems or self.all), self.pair, clock.count, order,
                                 self.floor):
            clock.run(system, prompts)
        clock.count += 1

    @property
    def same_hits(self) -> bool:
        return self.bare.store.ledger.tokens_hit == self.store.ledger.tokens_hit


def _measure(layout: ModelLayout, pages: int, args: argparse.Namespace, device: str,
             engines: list[str]) -> dict[str, Any]:
    """One row: fill each system from empty to the store's first eviction (on fresh sets of
    systems until ``--fill-min-requests`` requests have run), then time the steady state on the
    first set, all on the same prompts, systems taking turns."""
    order = args.pair_order
    main = _Systems(layout, pages, args, device, engines)
    store, loop, bare, pair = main.store, main.loop, main.bare, main.pair
    fill = _Clock()
    fill_requests, moved, allocated = main.fill(fill, args.turn, order)
    # A fill of a small cache is too short to time (~80 requests at 2k pages): repeat it on
    # fresh sets until the phase has run enough requests; a long fill runs once.
    repeats = max(1, -(-args.fill_min_requests // fill_requests))
    fill_ops = dict(loop.seconds)
    total, failed, same_hits, pairs = fill_requests, 0, True, [pair] if pair else []
    for _ in range(repeats - 1):
        extra = _Systems(layout, pages, args, device, engines)
        n, m, a = extra.fill(fill, args.turn, order)
        total, moved, allocated = total + n, moved + m, allocated + a
        for op, seconds in extra.loop.seconds.items():
            fill_ops[op] += seconds
        failed += extra.loop.failed + extra.bare.failed
        same_hits &= extra.same_hits
        if extra.pair:
            pairs.append(extra.pair)
        del extra
        gc.unfreeze()  # let the collector reclaim the spent set (outside every timed turn)
        gc.collect()
    fill_ops = {op: s / total * 1e6 for op, s in fill_ops.items()}
    loop.seconds = dict.fromkeys(OPS, 0.0)
    evictions = loop.evictions()
    steady = _Clock()
    left = args.requests
    while left > 0:
        turn = [next(main.prompts) for _ in range(min(args.turn, left))]
        left -= len(turn)
        main.turn(steady, turn, order)
    n = args.requests
    per_op = {op: s / n * 1e6 for op, s in loop.seconds.items()}
    store.check_integrity()
    us, fill_us = steady.us(bare.name), fill.us(bare.name)
    floor, floor_py, others = main.floor, main.floor_py, main.others
    row: dict[str, Any] = {
        "pages": pages, "cached_pages": store.index.num_pages, "device": device,
        "fill_requests": fill_requests, "fill_repeats": repeats, "fill_requests_total": total,
        "fill_us_per_request": fill_us, "fill_timed_us_per_request": fill.us(loop.name),
        **{f"fill_us_{op}": v for op, v in fill_ops.items()},
        "moved_per_allocated": ratio(moved, allocated),
        "us_per_request": us, "timed_us_per_request": steady.us(loop.name),
        **{f"us_{op}": v for op, v in per_op.items()},
        "evictions_per_request": (loop.evictions() - evictions) / n,
        "failed": loop.failed + bare.failed + failed,
        "same_hits": same_hits and main.same_hits,
        "floor_us_per_request": steady.us(floor.name),
        "vs_floor": ratio(us, steady.us(floor.name)),
        "floor_hashlib_us_per_request": steady.us(floor_py.name),
        "vs_floor_hashlib": ratio(us, steady.us(floor_py.name)),
        "fill_vs_floor_hashlib": ratio(fill_us, fill.us(floor_py.name)),
        "systems": {s.name: {"fill_us_per_request": fill.us(s.name),
                             "us_per_request": steady.us(s.name),
                             "evictions": s.evictions()} for s in main.all},
        "skipped": main.skipped,
    }
    if pair:
        row["accounting"] = {"steady": rise([pair], steady, order),
                             "fill": rise(pairs, fill, order)}
    for s in others:
        row[f"vs_{s.name}"] = ratio(us, steady.us(s.name))
        row[f"fill_vs_{s.name}"] = ratio(fill_us, fill.us(s.name))
    gc.unfreeze()  # this row's systems may go: the collector may reach them again
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = load_preset(args.model, page_size=args.page_size)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    engines = [e.strip() for e in args.vs.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"bench ops: unknown --vs engine(s) {unknown}; known: {list(ENGINES)}")
    if args.fill_min_requests < 0:
        raise SystemExit(f"bench ops: --fill-min-requests {args.fill_min_requests} < 0")
    rows = [_measure(layout, s, args, "meta", engines) for s in sizes]
    if args.real_pages:
        scaled = scale_layout(layout, 1 / 2048).layout
        rows.append(_measure(scaled, args.real_pages, args, "cpu", []))
    meta = [r for r in rows if r["device"] == "meta"]

    def growth(key: str) -> float | None:
        return ratio(meta[-1][key], meta[0][key]) if meta else None

    vs = sorted({k for r in meta for k in r
                 if k.startswith("vs_") and k not in ("vs_floor", "vs_floor_hashlib")})
    return {"model": args.model, "page_size": args.page_size,
            "pages_per_request": args.shared_pages + args.private_pages,
            "prefixes": args.prefixes, "requests": args.requests,
            "fill_min_requests": args.fill_min_requests, "pair_order": args.pair_order,
            "rows": rows,
            "growth": growth("us_per_request"), "fill_growth": growth("fill_us_per_request"),
            # The same over floor-hashlib's fill in the same turns (mostly hashing, so nearly
            # flat in the size): the rows run a minute apart, and a shared machine's speed
            # drifts between them, moving every system's fill alike.
            "fill_growth_vs_floor_hashlib": growth("fill_vs_floor_hashlib"),
            "max_us_per_request": max(r["us_per_request"] for r in meta) if meta else None,
            "max_vs_floor": _max(r["vs_floor"] for r in meta),
            "max_vs_floor_hashlib": _max(r["vs_floor_hashlib"] for r in meta),
            "max_accounting_rise": _max(r["accounting"]["steady"]["rise"] for r in meta
                                        if "accounting" in r),
            "max_accounting_rise_median": _max(r["accounting"]["steady"]["rise_median"]
                                               for r in meta if "accounting" in r),
            **{f"max_{k}": _max(r.get(k) for r in meta) for k in vs},
            "skipped": {k: v for r in meta for k, v in r["skipped"].items()}}


def _max(values: Iterable[float | None]) -> float | None:
    return max((v for v in values if v is not None), default=None)


def render(result: dict[str, Any]) -> str:
    head = (f"{result['model']}, {result['pages_per_request']} pages of "
            f"{result['page_size']} tokens per request ({result['prefixes']} shared prefixes), "
            f"{result['requests']} timed steady requests per size; µs per request (thread CPU)")
    fill = ["pages", "device", "fill_requests", "fill_repeats", "fill_us_per_request",
            "fill_timed_us_per_request",
            *(f"fill_us_{op}" for op in OPS), "moved_per_allocated"]
    steady = ["pages", "device", "us_per_request", "timed_us_per_request",
              *(f"us_{op}" for op in OPS),
              "evictions_per_request", "floor_us_per_request", "vs_floor",
              "floor_hashlib_us_per_request", "vs_floor_hashlib"]
    names = sorted({n for r in result["rows"] for n in r["systems"]})
    side = [{"pages": r["pages"], "phase": phase,
             **{n: _fmt(r["systems"].get(n, {}).get(key)) for n in names}}
            for r in result["rows"] if r["device"] == "meta"
            for phase, key in (("fill", "fill_us_per_request"), ("steady", "us_per_request"))]
    lines = [head, f"fill (empty cache to the first eviction), run on fresh systems until "
                   f"{result['fill_min_requests']} requests:", table(result["rows"], fill),
             "steady state:", table(result["rows"], steady),
             "same prompts, systems interleaved (µs per request):",
             table(side, ["pages", "phase", *names])]
    lines += [f"skipped {name}: {why}" for name, why in result["skipped"].items()]
    lines += [f"accounting on/off at {r['pages']} pages ({result['pair_order']} order): steady "
              f"{_pct(r['accounting']['steady'])}; fill {_pct(r['accounting']['fill'])}"
              for r in result["rows"] if "accounting" in r]
    for key, label in (("fill_growth", "fill"), ("growth", "steady")):
        if result[key]:
            lines.append(f"{label} growth (largest / smallest size): {result[key]:.2f}x")
    if result["fill_growth_vs_floor_hashlib"]:
        lines.append("fill growth relative to floor-hashlib's in the same turns: "
                     f"{result['fill_growth_vs_floor_hashlib']:.2f}x")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _pct(figures: dict[str, Any]) -> str:
    """One accounting on/off figure: the total rise, the per-turn median and quartiles, the rise
    by which side went first, and whether both stores hit alike."""
    same = "" if figures["same_hits"] else " (hits differ!)"
    if figures["rise"] is None:
        return "n/a"

    def pct(key: str) -> str:
        return "n/a" if figures[key] is None else f"{figures[key]:+.1%}"

    return (f"{pct('rise')} (per turn: median {pct('rise_median')}, IQR {pct('rise_q1')} to "
            f"{pct('rise_q3')}, {figures['turns']} turns; on first {pct('rise_on_first')}, "
            f"off first {pct('rise_off_first')}){same}")
