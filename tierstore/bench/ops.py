"""Per-request cost of the core as the cache grows: an engine-shaped loop at 10³-10⁶ pages.

Each request is a prompt of a shared prefix (``--shared-pages``) plus private pages
(``--private-pages``) of ``--page-size`` tokens. Like an engine's scheduler, the loop calls
``match`` (the shared prefix hits), ``allocate`` for the pages the match did not cover (plus a
state checkpoint for hybrid layouts), ``insert`` with only those new blocks, and ``release``.
The cache is first filled until it evicts; then ``--requests`` requests are timed, per
operation (``evict`` is the part of ``allocate`` spent choosing and demoting victims).

In the same run, a floor: a plain ``dict`` of chained page hashes with an ``OrderedDict`` LRU
and a free list doing the same bookkeeping (hash once, walk, evict the oldest, hand out ids),
without the hybrid rule, tiers or an arena. ``growth`` is µs per request at the largest size
divided by µs at the smallest; times are the calling thread's CPU time. The device is ``meta``
(accounting only); one extra row (``--real-pages``) runs a scaled layout on real CPU bytes.
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from tierstore.bench._util import ratio, table
from tierstore.config import StoreConfig
from tierstore.hashing import PageHasher
from tierstore.layout import ModelLayout, load_preset, preset_names
from tierstore.scaling import scale_layout
from tierstore.store import TierStore

OPS = ("match", "allocate", "insert", "release", "evict")
# CPU time of this thread: the loop is pure CPU work (no I/O on a meta / CPU arena without
# tiers), and on a shared machine wall time mostly measures the other processes.
_now = time.thread_time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-next-80b-a3b", choices=preset_names())
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--sizes", default="1000,10000,100000,1000000",
                        help="cached pages at which to measure (comma-separated)")
    parser.add_argument("--requests", type=int, default=2000, help="timed requests per size")
    parser.add_argument("--shared-pages", type=int, default=8)
    parser.add_argument("--private-pages", type=int, default=24)
    parser.add_argument("--real-pages", type=int, default=10000,
                        help="cached pages of the real-CPU-bytes row (0: skip it)")
    parser.add_argument("--seed", type=int, default=0)


class EngineLoop:
    """Drives one store with the requests of the module docstring and times each call."""

    def __init__(self, store: TierStore, shared: int, private: int, seed: int,
                 prefixes: int = 1) -> None:
        self.store = store
        self.page = store.layout.page_size
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.prefixes = [rng.integers(0, 150_000, shared * self.page, dtype=np.int64)
                         for _ in range(prefixes)]
        self.private = private
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

    def prompt(self) -> np.ndarray:
        shared = self.prefixes[int(self.rng.integers(len(self.prefixes)))]
        tail = self.rng.integers(0, 150_000, self.private * self.page, dtype=np.int64)
        return np.concatenate([shared, tail])

    def demand(self, pages: int) -> dict[str, int]:
        """Blocks a request computing ``pages`` new pages asks for."""
        return {"kv": pages, **({"swa": pages} if self.swa else {}),
                **({"state": 1} if self.state else {})}

    def warm(self) -> None:
        """Cache the shared prefixes with their checkpoints (the system prompts)."""
        store = self.store
        for shared in self.prefixes:
            got = store.allocate(self.demand(len(shared) // self.page))
            assert got is not None, "the arena cannot hold even the shared prefixes"
            store.insert(shared, kv=got["kv"], swa=got["swa"] if self.swa else None,
                         state=got["state"] if self.state else None)

    def step(self, prompt: np.ndarray) -> None:
        store = self.store
        t0 = _now()
        m = store.match(prompt)
        t1 = _now()
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
        for op, s in zip(OPS, (t1 - t0, t2 - t1 - evict, t3 - t2, t4 - t3, evict), strict=True):
            self.seconds[op] += s


class DictFloor:
    """The floor: chained page hashes in an OrderedDict (LRU order) over a free list of ids."""

    def __init__(self, hasher: PageHasher, capacity_pages: int) -> None:
        self.hasher = hasher
        self.pages: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(capacity_pages))

    def step(self, prompt: np.ndarray) -> None:
        keys = self.hasher.pages(prompt.astype("<u4"), "default")
        hit = 0
        for k in keys:
            if k not in self.pages:
                break
            self.pages.move_to_end(k)
            hit += 1
        need = len(keys) - hit
        while len(self.free) < need:
            self.free.append(self.pages.popitem(last=False)[1])
        for k in keys[hit:]:
            self.pages[k] = self.free.pop()


def _store(layout: ModelLayout, pages: int, per_request: int, device: str) -> TierStore:
    envelopes = {k: e.nbytes for k, e in layout.envelopes().items()}
    checkpoints = pages // per_request + 2 if "state" in envelopes else 0
    capacity = pages * (envelopes["kv"] + envelopes.get("swa", 0)) \
        + checkpoints * envelopes.get("state", 0)
    return TierStore(layout, StoreConfig(capacity_bytes=capacity, device=device))


def _measure(layout: ModelLayout, pages: int, args: argparse.Namespace, device: str
             ) -> dict[str, Any]:
    """One row: fill a store of ``pages`` cached pages, then time the loop and the floor on
    the same prompts."""
    per_request = args.private_pages
    store = _store(layout, pages, per_request, device)
    loop = EngineLoop(store, args.shared_pages, per_request, args.seed)
    loop.warm()
    fill = 0
    while store.stats().evictions == 0:
        loop.step(loop.prompt())
        fill += 1
    loop.seconds = dict.fromkeys(OPS, 0.0)
    prompts = [loop.prompt() for _ in range(args.requests)]
    evictions = store.stats().evictions
    for p in prompts:
        loop.step(p)
    evictions = store.stats().evictions - evictions
    n = args.requests
    hasher = PageHasher(layout.name, layout.fingerprint, layout.page_size, memo_bytes=0)
    floor = DictFloor(hasher, store.index.num_pages or pages)
    for _ in range(fill + 1):
        floor.step(loop.prompt())
    start = _now()
    for p in prompts:
        floor.step(p)
    floor_us = (_now() - start) / n * 1e6
    per_op = {op: s / n * 1e6 for op, s in loop.seconds.items()}
    total = sum(per_op.values())
    store.check_integrity()
    return {"pages": pages, "cached_pages": store.index.num_pages, "device": device,
            "us_per_request": total, **{f"us_{op}": v for op, v in per_op.items()},
            "evictions_per_request": evictions / n, "failed": loop.failed,
            "floor_us_per_request": floor_us, "vs_floor": ratio(total, floor_us)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = load_preset(args.model, page_size=args.page_size)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    rows = [_measure(layout, s, args, "meta") for s in sizes]
    if args.real_pages:
        scaled = scale_layout(layout, 1 / 2048).layout
        rows.append(_measure(scaled, args.real_pages, args, "cpu"))
    meta = [r for r in rows if r["device"] == "meta"]
    growth = ratio(meta[-1]["us_per_request"], meta[0]["us_per_request"]) if meta else None
    return {"model": args.model, "page_size": args.page_size,
            "pages_per_request": args.shared_pages + args.private_pages,
            "requests": args.requests, "rows": rows, "growth": growth,
            "max_us_per_request": max(r["us_per_request"] for r in meta) if meta else None,
            "max_vs_floor": max((r["vs_floor"] for r in meta if r["vs_floor"] is not None),
                                default=None)}


def render(result: dict[str, Any]) -> str:
    columns = ["pages", "device", "us_per_request", *(f"us_{op}" for op in OPS),
               "evictions_per_request", "floor_us_per_request", "vs_floor"]
    head = (f"{result['model']}, {result['pages_per_request']} pages of "
            f"{result['page_size']} tokens per request, {result['requests']} timed requests "
            f"per size")
    growth = result["growth"]
    tail = f"growth (largest / smallest size): {growth:.2f}x" if growth else ""
    return "\n".join([head, table(result["rows"], columns), tail])

