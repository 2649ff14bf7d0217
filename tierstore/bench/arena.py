"""Arena: alloc/free ids/s, an engine's steady request churn, compaction copy bandwidth vs
contiguous copy_, admitted concurrency.

Request churn is the arena's share of the store's steady state (``bench ops``): per request,
``can_alloc`` fails, the oldest request's blocks are freed (``free_owned``, as eviction does),
``can_alloc`` passes and the new request's blocks are allocated (``alloc_ids``); 24 KV blocks
(high band) and 24 SWA blocks (floating band) each, on an accounting-only arena of each size.

Admitted concurrency uses a real preset's envelope sizes on an accounting-only (meta) arena:
requests arrive in a fixed seeded order and are admitted first-come-first-served until one does
not fit. The unified arena is compared with a fixed state/KV split at its best ratio (searched on
a 0.1% grid after the fact, i.e. with hindsight) and at a mis-set ratio (the best ratio for a
different mix).
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import time

import torch

from gpu_arena import Arena, PoolSpec
from tierstore.bench._util import fmt_ratio, ratio, table
from tierstore.layout import load_preset

KiB = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-next-80b-a3b", help="preset for concurrency")
    parser.add_argument("--capacity-gib", type=float, default=40.0,
                        help="arena size for the concurrency study")
    parser.add_argument("--sizes-kib", default="16,64,256,1024",
                        help="envelope sizes (KiB) for the compaction bandwidth")
    parser.add_argument("--compact-mib", type=int, default=128,
                        help="bytes moved per compaction round (MiB)")
    parser.add_argument("--requests", type=int, default=5000, help="requests in each mix")
    parser.add_argument("--churn-slots", default="2000,500000",
                        help="arena sizes (blocks per pool) for the request churn")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (for the demo)")


# ---------------------------------------------------------------- alloc / free
def _alloc_free(batch: int, rounds: int) -> float:
    arena = Arena(1 << 24, [PoolSpec("kv", 256, "high"), PoolSpec("state", 1024, "low")])
    arena.alloc("kv", 4096)  # a band with live blocks, like a warm cache
    start = time.perf_counter()
    for _ in range(rounds):
        ids = arena.alloc("kv", batch)
        assert ids is not None
        arena.free("kv", ids)
    return 2 * batch * rounds / (time.perf_counter() - start)


# ---------------------------------------------------------------- request churn
def _churn(slots: int, requests: int, per_kind: int = 24) -> dict[str, float]:
    """µs per request of the arena calls of one steady engine request (thread CPU time over
    the loop; the split by call is wall time, so it may not add up under load)."""
    unit = 256
    arena = Arena(slots * 2 * unit, [PoolSpec("swa", unit, "float"),
                                     PoolSpec("kv", unit, "high")], device="meta")
    demand = {"kv": per_kind, "swa": per_kind}
    held: collections.deque[tuple[list[int], list[int]]] = collections.deque()
    while arena.can_alloc(demand):  # fill: every later request evicts the oldest
        kv, swa = arena.alloc_ids("kv", per_kind), arena.alloc_ids("swa", per_kind)
        assert kv is not None and swa is not None
        held.append((kv, swa))
    split = {"can_alloc": 0.0, "free": 0.0, "alloc": 0.0}
    clock = time.perf_counter
    start = time.thread_time()
    for i in range(requests + 100):
        if i == 100:  # the first 100 warm up
            split = dict.fromkeys(split, 0.0)
            start = time.thread_time()
        t0 = clock()
        fits = arena.can_alloc(demand)
        t1 = clock()
        kv, swa = held.popleft()
        arena.free_owned("kv", kv)
        arena.free_owned("swa", swa)
        t2 = clock()
        fits_now = arena.can_alloc(demand)
        t3 = clock()
        kv, swa = arena.alloc_ids("kv", per_kind), arena.alloc_ids("swa", per_kind)
        t4 = clock()
        assert not fits and fits_now and kv is not None and swa is not None
        held.append((kv, swa))
        split["can_alloc"] += t1 - t0 + t3 - t2
        split["free"] += t2 - t1
        split["alloc"] += t4 - t3
    cpu = time.thread_time() - start
    arena.check_integrity()
    out = {"slots": slots, "us_per_request": cpu / requests * 1e6}
    out.update({f"us_{k}": v / requests * 1e6 for k, v in split.items()})
    return out


def _churn_rows(sizes: list[int], requests: int) -> dict[str, object]:
    rows = [_churn(n, requests) for n in sizes]
    return {"blocks_per_request": {"kv": 24, "swa": 24}, "requests": requests, "rows": rows,
            "growth": ratio(rows[-1]["us_per_request"], rows[0]["us_per_request"])}


# ---------------------------------------------------------------- compaction
def _compaction(unit: int, total: int, repeat: int) -> dict[str, float | None]:
    """``h = total / unit`` holes: 3h live blocks, every other one of the first 2h freed; a full
    compact() then moves the last h blocks into the h holes (``total`` bytes, one batched copy).
    Timed alternately with one contiguous ``copy_`` of ``total`` bytes between warm buffers
    (which keeps torch's default threads; the arena runs with one, as ``serve`` does)."""
    h = max(1, total // unit)
    arena = Arena(unit * 3 * h, [PoolSpec("kv", unit, "low")])
    src = torch.empty(h * unit, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    arena.buffer.fill_(1)
    compact_times, copy_times = [], []
    for _ in range(repeat):
        ids = arena.alloc("kv", 3 * h)
        assert ids is not None
        arena.free("kv", ids[0 : 2 * h : 2])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as `tierstore serve` runs: small bookkeeping ops
        try:  # stall under intra-op threads when the other cores are busy
            start = time.perf_counter()
            moves = arena.compact()
            compact_times.append(time.perf_counter() - start)
        finally:
            torch.set_num_threads(threads)  # the copy_ baseline keeps every thread
        assert moves == h, f"expected {h} moves, got {moves}"
        arena.free("kv", ids[1 : 2 * h : 2].tolist() + ids[2 * h :].tolist())
        start = time.perf_counter()
        dst.copy_(src)
        copy_times.append(time.perf_counter() - start)
    moved = h * unit
    compact, copy = min(compact_times), min(copy_times)
    return {"envelope_kib": unit / KiB, "moved_mib": moved / 2**20,
            "compact_gbps": moved / compact / 1e9, "copy_gbps": moved / copy / 1e9,
            "ratio": ratio(copy, compact)}


# ---------------------------------------------------------------- concurrency
def _mix(n: int, long_share: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(16_384, 65_536) if rng.random() < long_share else rng.randint(256, 2048)
            for _ in range(n)]


def _admit_arena(lengths: list[int], capacity: int, state_unit: int, kv_unit: int,
                 page: int) -> int:
    arena = Arena(capacity, [PoolSpec("state", state_unit, "low"), PoolSpec("kv", kv_unit, "high")],
                  device="meta")
    for i, length in enumerate(lengths):
        need = {"state": 1, "kv": math.ceil(length / page)}
        if not arena.can_alloc(need):
            return i
        arena.alloc("state", 1)
        arena.alloc("kv", need["kv"])
    return len(lengths)


def _admit_split(lengths: list[int], capacity: int, share: float, state_unit: int, kv_unit: int,
                 page: int) -> int:
    states = int(capacity * share) // state_unit
    pages = (capacity - int(capacity * share)) // kv_unit
    used = 0
    for i, length in enumerate(lengths):
        used += math.ceil(length / page)
        if i + 1 > states or used > pages:
            return i
    return len(lengths)


def _best_share(lengths: list[int], capacity: int, state_unit: int, kv_unit: int,
                page: int) -> tuple[float, int]:
    best = (0.0, -1)
    for k in range(1, 1000):
        admitted = _admit_split(lengths, capacity, k / 1000, state_unit, kv_unit, page)
        if admitted > best[1]:
            best = (k / 1000, admitted)
    return best


def _concurrency(args: argparse.Namespace) -> dict[str, object]:
    layout = load_preset(args.model)
    assert layout.kv is not None and layout.state is not None, "needs a kv + state preset"
    capacity = int(args.capacity_gib * 2**30) // 256 * 256
    su, ku, page = layout.state.nbytes, layout.kv.nbytes, layout.page_size
    skewed = _mix(args.requests, 0.05, seed=1)  # many short requests, a few long ones
    other = _mix(args.requests, 0.5, seed=2)  # the mix a fixed ratio might have been tuned for
    best_share, best = _best_share(skewed, capacity, su, ku, page)
    wrong_share, _ = _best_share(other, capacity, su, ku, page)
    wrong = _admit_split(skewed, capacity, wrong_share, su, ku, page)
    arena = _admit_arena(skewed, capacity, su, ku, page)
    return {"model": args.model, "capacity_gib": args.capacity_gib, "state_unit_mib":
            su / 2**20, "kv_page_mib": ku / 2**20, "arena": arena, "best_fixed": best,
            "best_fixed_state_share": best_share, "misset_fixed": wrong,
            "misset_state_share": wrong_share, "arena_vs_best": ratio(arena, best),
            "arena_vs_misset": ratio(arena, wrong)}


def run(args: argparse.Namespace) -> dict:
    repeat = 2 if args.quick else 5
    rounds = 200 if args.quick else 2000
    sizes = [int(s) * KiB for s in str(args.sizes_kib).split(",")]
    churn_slots = [int(s) for s in str(args.churn_slots).split(",")]
    return {
        "alloc_free_single_ids_per_s": _alloc_free(1, rounds),
        "alloc_free_batch1k_ids_per_s": _alloc_free(1000, max(20, rounds // 20)),
        "churn": _churn_rows(churn_slots, 300 if args.quick else 3000),
        "compaction": [_compaction(u, args.compact_mib * 2**20, repeat) for u in sizes],
        "concurrency": _concurrency(args),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }


def render(result: dict) -> str:
    c = result["concurrency"]
    lines = [
        f"alloc+free, single id:  {result['alloc_free_single_ids_per_s']:,.0f} ids/s",
        f"alloc+free, 1k batch:   {result['alloc_free_batch1k_ids_per_s']:,.0f} ids/s",
        "",
        "steady request churn (24 KV + 24 SWA blocks freed and allocated per request; µs per "
        "request, thread CPU; the split is wall time):",
        table(result["churn"]["rows"], ["slots", "us_per_request", "us_can_alloc", "us_free",
                                        "us_alloc"]),
        f"growth (largest / smallest size): {fmt_ratio(result['churn']['growth'])}",
        "",
        "compaction copy bandwidth vs one contiguous copy_ of the same bytes:",
        table(result["compaction"], ["envelope_kib", "moved_mib", "compact_gbps", "copy_gbps",
                                     "ratio"]),
        "",
        f"admitted concurrency, {c['model']} ({c['state_unit_mib']:.1f} MiB state, "
        f"{c['kv_page_mib']:.2f} MiB KV page), {c['capacity_gib']} GiB, 5% long requests:",
        f"  unified arena          {c['arena']}",
        f"  best fixed split       {c['best_fixed']}  (state share "
        f"{c['best_fixed_state_share']:.1%}, chosen with hindsight)  arena/best = "
        f"{fmt_ratio(c['arena_vs_best'], '.3f')}",
        f"  mis-set fixed split    {c['misset_fixed']}  (state share "
        f"{c['misset_state_share']:.1%}, best for a 50%-long mix)  arena/mis-set = "
        f"{fmt_ratio(c['arena_vs_misset'])}",
    ]
    return "\n".join(lines)
