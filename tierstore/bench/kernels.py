"""Strided copy GB/s vs index_select/index_copy_, a loop of copy_, a plain copy_; remap ids/s.

For each envelope size, N scattered envelopes move between slots (GB/s = 10^9 envelope bytes
copied per second; memory traffic is twice that). Contenders, in interleaved rounds (best round
kept, so a noisy neighbour hurts all alike):

- ``strided_copy``: the dispatcher (host ``memmove`` path on CPU, the CUDA kernel on GPU);
- ``reference``: :func:`kernels.strided_copy_reference` (batched gather, then scatter);
- ``index_select``: ``rows.index_copy_(0, d, rows.index_select(0, s))`` on uint8 rows;
- ``loop_copy``: one ``copy_`` (a ``cudaMemcpyAsync`` on GPU) per envelope;
- ``contiguous``: one ``copy_`` of the same number of bytes: the peak of this run.

On CPU the envelopes move within one buffer (compaction: live slots into free ones). With CUDA
(and CuPy for the kernel rows) it adds device->device, device->pinned host and pinned host->device.
Remap translates a batch of virtual ids to slots (and per-token slots for ``--page-size``).
Table sync: after k blocks move, the arena brings its device copy of a pool's location table up
to date by patching the k changed entries (``Pool.patch``) instead of copying the whole table;
both run side by side (each round moves k blocks, then syncs), on the CPU and, with CUDA, into
device memory.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import kernels
from gpu_arena.pool import Pool
from gpu_arena.spec import PoolSpec
from tierstore.bench._util import best_of, ratio, table

_METHODS = ("contiguous", "strided_copy", "reference", "index_select", "loop_copy")
_CUDA_BATCH = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="16K,64K,256K,2M", help="envelope sizes, e.g. 16K,2M")
    parser.add_argument("--total-mb", type=int, default=64,
                        help="MiB moved per host measurement (device: 16x)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best kept)")
    parser.add_argument("--loop-max", type=int, default=2048,
                        help="envelopes moved by the loop-of-copy_ contender (it is slow)")
    parser.add_argument("--ids", type=int, default=1 << 20, help="virtual ids per remap call")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page for remap")
    parser.add_argument("--table-slots", type=int, default=1 << 20,
                        help="slots of the larger location table in the sync rows")
    parser.add_argument("--no-gpu", action="store_true", help="skip the CUDA measurements")


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("KM")) * scale


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    gpu = torch.cuda.is_available() and not args.no_gpu
    paths = [("h2h", "cpu", "cpu")]
    if gpu:
        paths += [("d2d", "cuda", "cuda"), ("d2h", "cuda", "pinned"), ("h2d", "pinned", "cuda")]
    rows: list[dict[str, object]] = []
    for path, src_at, dst_at in paths:
        total = (args.total_mb << 20) * (16 if path == "d2d" else 1)
        for nbytes in sizes:
            rows += _copy_rows(path, src_at, dst_at, nbytes, max(2, total // nbytes), args)
    result: dict = {
        "unit": "GB/s (1e9 envelope bytes copied per second); remap: ids/s",
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "cuda_kernels": gpu and kernels.cuda_kernels_ready(),
        "copy": rows,
        "remap": _remap_rows(args, gpu),
        "table_sync": _table_sync_rows(args, gpu),
    }
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _place(numel: int, where: str) -> torch.Tensor:
    if where == "cuda":
        return torch.randint(0, 256, (numel,), dtype=torch.uint8, device="cuda")
    buf = torch.randint(0, 256, (numel,), dtype=torch.uint8)
    return buf.pin_memory() if where == "pinned" else buf


def _copy_rows(
    path: str, src_at: str, dst_at: str, nbytes: int, n: int, args: argparse.Namespace
) -> list[dict[str, object]]:
    """Best GB/s of every contender for ``n`` envelopes of ``nbytes`` along ``path``."""
    gen = torch.Generator().manual_seed(nbytes)
    if path == "h2h":  # one buffer, 2n slots: live slots move into free ones
        src = dst = _place(2 * n * nbytes, src_at)
        perm = torch.randperm(2 * n, generator=gen)
        s, d = perm[:n].clone(), perm[n:].clone()
    else:
        src, dst = _place(2 * n * nbytes, src_at), _place(2 * n * nbytes, dst_at)
        s = torch.randperm(2 * n, generator=gen)[:n]
        d = torch.randperm(2 * n, generator=gen)[:n]
    device = "cuda" if path != "h2h" else "cpu"
    s_dev, d_dev = s.to(device), d.to(device)
    src_rows, dst_rows = src.view(2 * n, nbytes), dst.view(2 * n, nbytes)
    flat_a, flat_b = _place(n * nbytes, src_at), _place(n * nbytes, dst_at)
    geometry = dict(nbytes=nbytes, src_stride=nbytes, dst_stride=nbytes)
    loop_n = min(n, args.loop_max)
    loop_pairs = list(zip(s[:loop_n].tolist(), d[:loop_n].tolist(), strict=True))

    def loop_copy() -> None:
        for i, j in loop_pairs:
            dst_rows[j].copy_(src_rows[i], non_blocking=True)

    def index_select() -> None:
        gathered = src_rows.index_select(0, s_dev if src_rows.is_cuda else s)
        target = d_dev if dst_rows.is_cuda else d
        dst_rows.index_copy_(0, target, gathered.to(dst_rows.device))

    contenders: dict[str, tuple[Callable[[], object], int]] = {
        "contiguous": (lambda: flat_b.copy_(flat_a, non_blocking=True), n),
        "reference": (lambda: kernels.strided_copy_reference(src, dst, s, d, **geometry), n),
        "index_select": (index_select, n),
        "loop_copy": (loop_copy, loop_n),
    }
    if path == "h2h" or kernels.cuda_kernels_ready():
        # Device indices on the GPU (the arena's case); vouch for the disjoint slots there.
        overlap = None if path == "h2h" else False
        contenders["strided_copy"] = (
            lambda: kernels.strided_copy(src, dst, s_dev, d_dev, overlap=overlap, **geometry), n)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, (fn, count) in contenders.items():
            cuda = path != "h2h"
            seconds = best_of(_synced(fn, cuda), repeat=1, min_time=0.05)
            calls = _CUDA_BATCH if cuda else 1
            best[name] = max(best.get(name, 0.0), calls * count * nbytes / seconds / 1e9)
    peak = best["contiguous"]
    return [
        {"path": path, "size_kib": nbytes >> 10, "method": m, "gb_s": best[m],
         "vs_contiguous": ratio(best[m], peak)}
        for m in _METHODS if m in best
    ]


def _synced(fn: Callable[[], object], cuda: bool) -> Callable[[], object]:
    """``fn`` as one timed call: on CUDA, _CUDA_BATCH calls queued back to back and then waited
    for (so the device, not the launch overhead, is measured), counted as one."""
    if not cuda:
        return fn

    def run() -> None:
        for _ in range(_CUDA_BATCH):
            fn()
        torch.cuda.synchronize()

    return run


def _remap_rows(args: argparse.Namespace, gpu: bool) -> list[dict[str, object]]:
    """ids/s of the remap paths, per page and per token."""
    slots = max(args.ids, 1024)
    gen = torch.Generator().manual_seed(1)
    table_cpu = torch.randperm(slots, generator=gen)
    table_cpu[torch.randint(0, slots, (slots // 10,), generator=gen)] = -1
    ids_cpu = torch.randint(-16, slots + 16, (args.ids,), generator=gen)
    cases: list[tuple[str, torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]]] = [
        ("cpu reference", table_cpu, ids_cpu, kernels.remap_reference),
    ]
    if gpu:
        table, ids = table_cpu.cuda(), ids_cpu.cuda()
        cases.append(("cuda reference", table, ids, kernels.remap_reference))
        if kernels.cuda_kernels_ready():
            cases.append(("cuda kernel", table, ids, kernels.remap_cuda))
    rows: list[dict[str, object]] = []
    for name, table, ids, fn in cases:
        for page_size in (1, args.page_size):
            call = _synced(_remap_call(fn, table, ids, page_size), table.is_cuda)
            seconds = best_of(call, repeat=args.rounds, min_time=0.05)
            seconds /= _CUDA_BATCH if table.is_cuda else 1
            rows.append({"remap": name, "page_size": page_size, "ids": ids.numel(),
                         "ids_per_s": ids.numel() / seconds,
                         "slots_per_s": ids.numel() * page_size / seconds})
    return rows


def _remap_call(
    fn: Callable[..., torch.Tensor], table: torch.Tensor, ids: torch.Tensor, page_size: int
) -> Callable[[], object]:
    return lambda: fn(table, ids, sink=0, page_size=page_size)


def _table_sync_rows(args: argparse.Namespace, gpu: bool) -> list[dict[str, object]]:
    """Seconds to move k blocks and bring a mirror of the location table up to date: patching
    the changed entries vs copying the whole table."""
    rows: list[dict[str, object]] = []
    for device in ["cpu"] + (["cuda"] if gpu else []):
        for slots in (1 << 16, args.table_slots):
            for changed in (16, 1024):
                pool = Pool(PoolSpec("kv", 16, "low"), origin=0, max_slots=slots, lo=0)
                pool.take_ids(torch.arange(slots // 2))  # a half-full pool
                pool.start_log()
                mirror = pool.loc.to(device, copy=True)
                times = {}
                for method in ("patch", "full_copy"):
                    call = _synced(_sync_call(pool, mirror, changed, method), device == "cuda")
                    times[method] = best_of(call, repeat=args.rounds, min_time=0.05)
                assert torch.equal(mirror.cpu(), pool.loc), "the mirror fell behind"
                rows.append({"device": device, "slots": slots, "changed": changed,
                             "patch_us": times["patch"] * 1e6 / _batch(device),
                             "full_copy_us": times["full_copy"] * 1e6 / _batch(device),
                             "speedup": ratio(times["full_copy"], times["patch"])})
    return rows


def _batch(device: str) -> int:
    return _CUDA_BATCH if device == "cuda" else 1


def _sync_call(pool: Pool, mirror: torch.Tensor, changed: int, method: str
               ) -> Callable[[], object]:
    """Move ``changed`` blocks between the pool's two halves (back and forth), then sync."""
    half = pool.max_slots // 2
    a, b = torch.arange(changed), torch.arange(half, half + changed)
    state = {"flip": False}

    def call() -> None:
        src, dst = (b, a) if state["flip"] else (a, b)
        state["flip"] = not state["flip"]
        pool.relink(src, dst)
        if method == "patch":
            pool.patch(mirror)
        else:
            mirror.copy_(pool.loc)
            pool.start_log()

    return call


def render(result: dict) -> str:
    head = (f"device {result['device']}  torch threads {result['torch_threads']}  "
            f"cuda kernels {result['cuda_kernels']}  ({result['seconds']} s)\n{result['unit']}")
    copy = table(result["copy"], ["path", "size_kib", "method", "gb_s", "vs_contiguous"])
    remap = table(result["remap"], ["remap", "page_size", "ids", "ids_per_s", "slots_per_s"])
    sync = table(result["table_sync"],
                 ["device", "slots", "changed", "patch_us", "full_copy_us", "speedup"])
    return f"{head}\n\n{copy}\n\n{remap}\n\nlocation-table sync after k moves:\n{sync}"
