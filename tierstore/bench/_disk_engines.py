"""I/O engines for the disk tier, measured before choosing one (``bench disk --engines``).

The same O_DIRECT transfers through each engine: ``total`` bytes of envelopes to / from a
preallocated file, cut as the tier cuts a batch (calls of up to 2 MiB of consecutive
envelopes, one envelope per call above that), ``depth`` calls in flight, an ``fdatasync``
after the writes. Only the submission mechanism differs; nothing is signed or copied.

- ``threads``: the tier's own, ``os.pwritev`` / ``os.preadv`` on a pool of ``depth`` workers
  (both release the GIL);
- ``threads x1``: the same on one worker (one call in flight);
- ``aiofiles``: ``depth`` asyncio tasks, each with its own ``aiofiles`` file object (unbuffered,
  O_DIRECT), ``seek`` then ``write`` / ``readinto`` (aiofiles runs each call in the loop's
  default executor; it has no positional or vectored calls);
- ``io_uring``: a ``liburing`` ring of ``depth`` entries, when the package imports and a ring
  can be set up (checked in a subprocess, since a wheel built for another CPU dies with
  SIGILL); otherwise the reason is reported.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from disk_tier.slab import MAX_RUN_BYTES, aligned

MiB = 1 << 20


def _calls(total: int, unit: int) -> list[tuple[int, int]]:
    """(offset, bytes) of each call: runs of up to MAX_RUN_BYTES of whole envelopes."""
    per = max(1, MAX_RUN_BYTES // unit) * unit
    n = max(1, total // unit) * unit
    return [(off, min(per, n - off)) for off in range(0, n, per)]


def _threads(path: str, calls: list[tuple[int, int]], depth: int, write: bool) -> float:
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    bufs = [aligned(max(n for _, n in calls)) for _ in range(depth)]
    slot: dict[int, int] = {}

    def one(call: tuple[int, int]) -> None:
        i = slot.setdefault(threading.get_ident(), len(slot))
        off, n = call
        view = bufs[i][:n].data
        if write:
            os.pwritev(fd, [view], off)
        else:
            os.preadv(fd, [view], off)

    start = time.perf_counter()
    with ThreadPoolExecutor(depth) as pool:
        list(pool.map(one, calls))
    if write:
        os.fdatasync(fd)
    took = time.perf_counter() - start
    os.close(fd)
    return took


def _aiofiles(path: str, calls: list[tuple[int, int]], depth: int, write: bool) -> float:
    import aiofiles

    def opener(p: str, flags: int) -> int:
        return os.open(p, flags | os.O_DIRECT)

    async def main() -> float:
        files = [await aiofiles.open(path, "r+b", buffering=0, opener=opener)
                 for _ in range(depth)]
        bufs = [aligned(max(n for _, n in calls)) for _ in range(depth)]
        queue = list(reversed(calls))

        async def worker(i: int) -> None:
            f = files[i]
            while queue:
                off, n = queue.pop()
                await f.seek(off)
                if write:
                    await f.write(bufs[i][:n].data)
                else:
                    await f.readinto(bufs[i][:n].data)

        start = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(depth)))
        if write:
            await files[0].flush()
            os.fdatasync(files[0].fileno())
        took = time.perf_counter() - start
        for f in files:
            await f.close()
        return took

    return asyncio.run(main())


_URING_PROBE = "from liburing import Ring, io_uring_queue_init, io_uring_queue_exit\n" \
               "r = Ring(); io_uring_queue_init(8, r); io_uring_queue_exit(r)"


def _why_not(engine: str) -> str | None:
    """None when ``engine`` can run here, else why not."""
    if engine == "aiofiles":
        try:
            import aiofiles  # noqa: F401
        except ImportError:
            return "aiofiles is not installed (pip install aiofiles)"
        return None
    done = subprocess.run([sys.executable, "-c", _URING_PROBE], capture_output=True,
                          text=True, timeout=60, check=False)
    if done.returncode == 0:
        return "liburing sets up a ring here, but no io_uring engine is built (measure it first)"
    if "No module named" in done.stderr:
        return "liburing is not installed (pip install liburing)"
    return f"liburing cannot set up a ring here (exit {done.returncode}: " + (
        "SIGILL, the wheel was built for another CPU)" if done.returncode == -4
        else done.stderr.strip().splitlines()[-1][:120] + ")")


def compare(where: str, sizes_kib: list[int], total: int, depth: int, repeat: int
            ) -> dict[str, Any]:
    """Write and read MiB/s per engine and envelope size (best of ``repeat``, engines
    alternating), in a scratch file under ``where``."""
    path = os.path.join(where, "engines.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, total)
    os.close(fd)
    engines: dict[str, tuple[Callable[..., float], int]] = {
        "threads": (_threads, depth), "threads x1": (_threads, 1)}
    skipped: dict[str, str] = {}
    for name in ("aiofiles", "io_uring"):
        why = _why_not(name)
        if why is None and name == "aiofiles":
            engines[name] = (_aiofiles, depth)
        else:
            skipped[name] = why or "not built"
    rows = []
    try:
        for kib in sizes_kib:
            calls = _calls(total, kib * 1024)
            nbytes = sum(n for _, n in calls)
            best: dict[tuple[str, bool], float] = {}
            for _ in range(max(1, repeat)):
                for name, (run, n) in engines.items():
                    for write in (True, False):
                        took = run(path, calls, n, write)
                        best[(name, write)] = min(best.get((name, write), took), took)
            base_w, base_r = best[("threads", True)], best[("threads", False)]
            for name in engines:
                w, r = best[(name, True)], best[(name, False)]
                rows.append({"envelope_kib": kib, "engine": name,
                             "write_mib_s": nbytes / MiB / w, "read_mib_s": nbytes / MiB / r,
                             "write_vs_threads": base_w / w, "read_vs_threads": base_r / r})
    finally:
        os.unlink(path)
    return {"depth": depth, "mib": total / MiB, "rows": rows, "skipped": skipped}
