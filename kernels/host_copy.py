"""The CPU path of :func:`kernels.strided_copy`: numpy row gathers, or a ``memmove`` per item.

Measured on the 2-core CI machine (64 MiB moved within one buffer, see the module docstring of
``tierstore.bench.kernels``; figures swing with the load of the other core):

- a batched ``index_select`` + ``index_copy_`` (the reference) moves 2-3 GB/s against 25-50
  for a contiguous ``copy_``: it writes a fresh temporary, and a fresh tensor of many MiB costs
  more in page faults than the copy itself; torch's multi-threaded index ops also stall (down
  to 0.1 GB/s) whenever the other core is busy;
- a ``memmove`` per item costs ~0.35 µs of Python, then runs at memcpy speed without the GIL:
  ~10 GB/s at 16 KiB, ~18 at 64 KiB, 20-23 from 256 KiB (one core). Two threads gain only from
  256 KiB (26-30): below, every call hands the GIL back and forth;
- numpy fancy indexing in ~1 MiB tasks releases the GIL for a whole task, so two threads do
  add up below 256 KiB: 17-19 GB/s at 16 KiB, ~24 at 64 KiB.

Tasks come from one shared queue, so a busy core does not hold the batch back.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kernels.layout import (
    CopyLayout,
    has_hazard,
    kept_pairs,
    ranges_intersect,
    slot_view,
    span_starts,
    word_size,
)

MEMMOVE_ITEM_BYTES = 256 << 10
"""Items this large move by ``memmove`` (one pass); smaller ones by numpy row gathers."""
TASK_BYTES = 1 << 20
"""Bytes per task handed to a thread (cache-sized: a numpy gather's temporary stays warm)."""
_MAX_THREADS = 8
# The copy threads follow the CPUs this process may use, not torch's intra-op setting (which a
# service pins to 1 so that its many small tensor ops do not stall).
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def copy_host(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    layout: CopyLayout,
    *,
    overlap: bool | None,
) -> None:
    """Copy the batch between two CPU buffers (``dst`` changes): items of
    :data:`MEMMOVE_ITEM_BYTES` and more by ``memmove``, smaller ones by numpy gathers and
    scatters, in tasks of ~:data:`TASK_BYTES` spread over the intra-op threads. A batch that
    reads bytes another item writes (or ``overlap=True``) is gathered whole before anything is
    written. Raises on out-of-range indices."""
    src_slots, dst_slots = layout.slots(src, dst)
    s, d = kept_pairs(src_index, dst_index, src_slots, dst_slots)
    if s.size == 0:
        return
    reads = span_starts(src.data_ptr(), layout.src, layout.rows, s)
    writes = span_starts(dst.data_ptr(), layout.dst, layout.rows, d)
    if overlap is None:
        overlap = ranges_intersect(src, dst) and has_hazard(reads, writes, layout.nbytes)
    if layout.nbytes >= MEMMOVE_ITEM_BYTES:
        if overlap:
            temp = torch.empty(reads.size * layout.nbytes, dtype=torch.uint8)
            staged = np.arange(reads.size, dtype=np.int64) * layout.nbytes + temp.data_ptr()
            memmove_all(staged.tolist(), reads.tolist(), layout.nbytes)
            reads = staged
        memmove_all(writes.tolist(), reads.tolist(), layout.nbytes)
        return
    word = word_size(src, dst, layout)
    src_view = slot_view(src, layout.src, layout, src_slots, word).numpy()
    dst_view = slot_view(dst, layout.dst, layout, dst_slots, word).numpy()
    if overlap:
        dst_view[d] = src_view[s]  # numpy evaluates the whole gather first
        return

    def task(lo: int, hi: int) -> None:
        # Fancy indexing, not np.take: take copies a non-contiguous source whole first.
        dst_view[d[lo:hi]] = src_view[s[lo:hi]]

    run_tasks(s.size, max(1, TASK_BYTES // (layout.rows * layout.nbytes)), task)


def memmove_all(writes: list[int], reads: list[int], nbytes: int) -> None:
    """``memmove(writes[k], reads[k], nbytes)`` for every k, in no particular order, on the
    intra-op threads. The addresses must be valid: nothing is checked here."""

    def task(lo: int, hi: int) -> None:
        _memmove_range(writes[lo:hi], reads[lo:hi], nbytes)

    run_tasks(len(writes), max(1, TASK_BYTES // nbytes), task)


def run_tasks(count: int, per_task: int, task: Callable[[int, int], None]) -> None:
    """Call ``task(lo, hi)`` over consecutive ranges of ``per_task`` covering ``[0, count)``, in
    no particular order: the calling thread and up to ``_CPUS - 1`` helpers
    take ranges from one shared queue until it is empty."""
    threads = min(_CPUS, _MAX_THREADS, -(-count // per_task))
    starts = iter(range(0, count, per_task))  # shared: next() is atomic under the GIL

    def worker() -> None:
        for lo in starts:
            task(lo, min(lo + per_task, count))

    futures = [_pool().submit(worker) for _ in range(threads - 1)]
    try:
        worker()
    finally:
        for future in futures:
            future.result()


def _memmove_range(writes: list[int], reads: list[int], nbytes: int) -> None:
    move: Callable[[int, int, int], object] = ctypes.memmove  # drops the GIL while copying
    for w, r in zip(writes, reads, strict=True):
        move(w, r, nbytes)


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """Helper threads for large host copies; the calling thread works alongside them."""
    return ThreadPoolExecutor(max_workers=_MAX_THREADS - 1, thread_name_prefix="tierstore-copy")
