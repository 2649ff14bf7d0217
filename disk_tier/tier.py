"""``DiskTier``: per-kind slabs of fixed-size slots in preallocated files, one directory.

Each kind (kv, swa, state) has its own file ``{kind}.slab`` of equal slots sized for the
kind's envelope (:func:`~disk_tier.slot.slot_bytes`), and a free list (a heap, so a batch
takes the lowest free slots and tends to be one run of consecutive slots: one vectored call).
The in-memory index is ``slot -> SlotMeta`` per kind; the store keeps slot numbers in its
prefix index.

I/O runs on a small thread pool, never on the caller's thread: a batch is cut into runs of
consecutive slots, and each run is one ``preadv`` / ``pwritev`` plus, in the same worker, the
MAC of every slot in it (BLAKE3 releases the GIL too). Reads verify each slot's header (magic,
kind, expected page key, layout, length) and tag; a slot that fails is a miss, never bytes.

On open the tier scans every slot's header (one aligned block each) and reports what a
previous run left in :attr:`DiskTier.recovered`; tags are checked lazily, when a slot is read.
A directory is used by one process at a time (an ``flock`` on ``lock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import disk_tier.index as index
from disk_tier.slab import MAX_RUN_BYTES, SlabFile, aligned, runs
from disk_tier.slot import (
    ALIGN,
    HEADER_BYTES,
    TAG_AT,
    TAG_BYTES,
    Recovered,
    SlotMeta,
    layout_hash,
    pack,
    slot_bytes,
    unpack,
)
from remote_tier.mac import Mac
from tierstore.errors import UsageError

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

Sink = Callable[[int, np.ndarray, list[bool]], None]
FORMAT = 1
# Slots per page of each kind when the size is split: a KV and an SWA envelope per page, a
# state checkpoint about every fourth page (they sit only at the ends of cached prompts).
DEFAULT_WEIGHTS = {"kv": 1.0, "swa": 1.0, "state": 0.25}
SCAN_BATCH = 64  # headers one scan job reads
SCAN_THREADS = 32  # header reads in flight at restart: latency-bound, so many at once


class DiskTierError(UsageError):
    """A disk tier that cannot be set up as asked (size, path, a directory in use)."""


@dataclass
class DiskStats:
    """Counters since open."""

    reads: int = 0  # slots read
    writes: int = 0  # slots written
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0  # wall time of read / write batches
    write_s: float = 0.0
    misses: int = 0  # slots that failed verification (torn, stale, forged)
    io_errors: int = 0
    scan_s: float = 0.0
    scanned: int = 0
    recovered: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class DiskTier:
    """Slabs for ``units`` ({kind: envelope bytes}) in ``size_bytes`` under ``path``.

    ``mac`` signs and verifies slots (the L3 scheme); ``layout_fingerprint`` is bound into
    every header, so slots of another layout are misses. ``direct``: None probes O_DIRECT and
    falls back to buffered I/O; False forces buffered; True asks for O_DIRECT and warns when
    the filesystem refuses it. Raises :class:`DiskTierError` when the directory is in use by
    another process or ``size_bytes`` cannot hold one slot per kind."""

    def __init__(self, path: str | os.PathLike[str], size_bytes: int, units: Mapping[str, int],
                 layout_fingerprint: str, mac: Mac, *, io_threads: int = 4,
                 direct: bool | None = None, weights: Mapping[str, float] | None = None
                 ) -> None:
        self.path = os.fspath(path)
        self.units = dict(units)
        self.mac = mac
        self.layout = layout_hash(layout_fingerprint)
        self.slot_size = {k: slot_bytes(u) for k, u in self.units.items()}
        self.nslots = _split(size_bytes, self.slot_size, weights or DEFAULT_WEIGHTS)
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        self._lock = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT
                             | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise DiskTierError(f"the disk tier {self.path} is in use by another process"
                                ) from None
        self.stats = DiskStats()
        self.files: dict[str, SlabFile] = {}
        self._ready = False  # set up whole: close() then checkpoints the index
        self._pool = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="tierstore-disk")
        try:
            reuse = self._check_meta()
            for kind, n in self.nslots.items():
                where = os.path.join(self.path, f"{kind}.slab")
                try:
                    self.files[kind] = SlabFile(where, n, self.slot_size[kind], direct=direct)
                except OSError as exc:  # no space for the size asked, a read-only mount
                    with contextlib.suppress(OSError):
                        os.unlink(where)  # give back what a failed fallocate reserved
                    raise DiskTierError(f"cannot set up the disk tier file {where} "
                                        f"({n * self.slot_size[kind]} bytes): {exc.strerror}"
                                        ) from None
            self.direct = all(f.direct for f in self.files.values())
            self._held: dict[str, dict[int, SlotMeta]] = {k: {} for k in self.units}
            self._gen_of: dict[str, dict[int, int]] = {k: {} for k in self.units}
            self._gen = 1
            saved = index.take(os.path.join(self.path, index.NAME), mac, self.layout)
            self.recovered: list[Recovered] = []
            if reuse:
                self.recovered = self._restore(saved) if saved else self._scan()
            held = {k: set(h) for k, h in self._held.items()}
            self._free = {k: [s for s in range(n) if s not in held[k]]
                          for k, n in self.nslots.items()}  # ascending: already a heap
            self._ready = True
        except BaseException:
            self.close()
            raise
        log.info("disk tier %s: %.1f GiB, slots %s, %s I/O, %d slots recovered in %.3f s "
                 "(from %s)", self.path, self.capacity_bytes / (1 << 30), self.nslots,
                 "O_DIRECT" if self.direct else "buffered", len(self.recovered),
                 self.stats.scan_s, self.stats.extra.get("restart", "nothing"))

    # ------------------------------------------------------------------ space
    @property
    def capacity_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def used(self, kind: str) -> int:
        return len(self._held[kind])

    def free_slots(self, kind: str) -> int:
        return len(self._free[kind])

    def can_alloc(self, demand: Mapping[str, int]) -> bool:
        return all(len(self._free[k]) >= n for k, n in demand.items() if n)

    def alloc(self, kind: str, n: int) -> list[int] | None:
        """``n`` free slots of ``kind`` (lowest first), or None when fewer are free."""
        free = self._free[kind]
        if len(free) < n:
            return None
        return [heapq.heappop(free) for _ in range(n)]

    def free(self, kind: str, slots: Sequence[int]) -> None:
        """Hand slots back (their bytes stay until reused; a restart may find them again,
        which is safe: a slot's tag binds its bytes to its key)."""
        held, free, gens = self._held[kind], self._free[kind], self._gen_of[kind]
        for s in slots:
            held.pop(s, None)
            gens.pop(s, None)
            heapq.heappush(free, s)

    def meta(self, kind: str, slot: int) -> SlotMeta | None:
        return self._held[kind].get(slot)

    # ------------------------------------------------------------------ I/O
    def write(self, kind: str, slots: Sequence[int], rows: np.ndarray | Sequence[Buffer],
              metas: Sequence[SlotMeta]) -> list[bool]:
        """Write ``rows`` ([n, unit] uint8, or n buffers of at most unit bytes each, zero
        padded) to ``slots`` (from :meth:`alloc`) as ``metas`` say; True per slot written. A
        slot whose write failed holds nothing (a later read of it is a miss) and stays
        allocated: the caller frees it."""
        unit = self.units[kind]
        if isinstance(rows, np.ndarray):
            bad = rows.ndim != 2 or rows.shape != (len(slots), unit)
        else:
            bad = len(rows) != len(slots) or any(memoryview(r).nbytes > unit for r in rows)
        if bad or len(metas) != len(slots):
            raise UsageError(f"{kind}: {len(rows)} rows of "
                             f"{getattr(rows, 'shape', 'buffers')} / {len(metas)} metas for "
                             f"{len(slots)} slots of {unit} bytes")
        if not len(slots):
            return []
        start = time.perf_counter()
        gens = range(self._gen, self._gen + len(slots))
        self._gen += len(slots)
        jobs = [(i, n, self._pool.submit(self._write_run, kind, slots[i:i + n],
                                         rows[i:i + n], metas[i:i + n], gens[i:i + n]))
                for i, n in runs(slots, self.slot_size[kind])]
        ok = [False] * len(slots)
        for i, n, job in jobs:
            if _wait(job, f"{self.path}: write"):
                ok[i:i + n] = [True] * n
            else:
                self.stats.io_errors += 1
        held, gen_of = self._held[kind], self._gen_of[kind]
        for s, m, g, good in zip(slots, metas, gens, ok, strict=True):
            if good:
                held[s], gen_of[s] = m, g
            else:
                held.pop(s, None)
                gen_of.pop(s, None)
        written = sum(ok)
        self.stats.writes += written
        self.stats.bytes_written += written * unit
        self.stats.write_s += time.perf_counter() - start
        return ok

    def _write_run(self, kind: str, slots: Sequence[int], rows: np.ndarray | Sequence[Buffer],
                   metas: Sequence[SlotMeta], gens: Sequence[int]) -> None:
        size, unit = self.slot_size[kind], self.units[kind]
        buf = _scratch(size * len(slots)).reshape(len(slots), size)
        buf[:, TAG_AT + TAG_BYTES:HEADER_BYTES] = 0  # no stale bytes of another slot go down
        buf[:, HEADER_BYTES + unit:] = 0
        for k, (meta, gen) in enumerate(zip(metas, gens, strict=True)):
            body = buf[k, HEADER_BYTES:HEADER_BYTES + unit]
            row = rows[k] if isinstance(rows, np.ndarray) else \
                np.frombuffer(memoryview(rows[k]).cast("B"), np.uint8)
            body[:row.size] = row
            body[row.size:] = 0
            fields = pack(gen, kind, meta, unit, self.layout)
            buf[k, :TAG_AT] = np.frombuffer(fields, np.uint8)
            buf[k, TAG_AT:TAG_AT + TAG_BYTES] = np.frombuffer(
                self.mac.sign(meta.key, fields, body.data), np.uint8)
        self.files[kind].write(slots[0], list(buf))

    def read(self, kind: str, slots: Sequence[int], expect: Sequence[bytes] | None = None,
             *, out: np.ndarray | None = None, sink: Sink | None = None
             ) -> tuple[np.ndarray, list[bool]]:
        """The envelopes in ``slots`` as rows [n, unit] (a view into ``out``, an aligned
        buffer of at least n slots the caller reuses, else a new one; rows that failed are
        garbage) and whether each verified: the header names ``kind``, this layout, the
        expected page key (``expect``, else the key the index holds for the slot) and its
        tag matches. A slot that fails is freed and counted as a miss. ``sink(first, rows,
        ok)`` is called on the worker thread of each run once it is read and verified (rows
        from ``first`` on), so copies out overlap the other runs' I/O."""
        unit, size = self.units[kind], self.slot_size[kind]
        held = self._held[kind]
        keys = list(expect) if expect is not None else [
            held[s].key if s in held else b"" for s in slots]
        nbytes = size * max(1, len(slots))
        if out is not None:
            assert out.nbytes >= nbytes and out.ctypes.data % ALIGN == 0, "a small or unaligned out"
            buf = out.reshape(-1)[:nbytes].reshape(-1, size)
        else:
            buf = aligned(nbytes, zero=False).reshape(-1, size)
        ok = [False] * len(slots)
        if not len(slots):
            return buf[:0, HEADER_BYTES:HEADER_BYTES + unit], ok
        start = time.perf_counter()
        jobs = [(i, n, self._pool.submit(self._read_run, kind, slots[i:i + n], buf[i:i + n],
                                         keys[i:i + n], i, sink))
                for i, n in runs(slots, size)]
        for i, n, job in jobs:
            got = _wait(job, f"{self.path}: read")
            if got is None:
                self.stats.io_errors += 1
            else:
                ok[i:i + n] = got
        bad = [s for s, good in zip(slots, ok, strict=True) if not good]
        if bad:
            self.stats.misses += len(bad)
            self.free(kind, bad)
        good = len(slots) - len(bad)
        self.stats.reads += good
        self.stats.bytes_read += good * unit
        self.stats.read_s += time.perf_counter() - start
        return buf[:, HEADER_BYTES:HEADER_BYTES + unit], ok

    def _read_run(self, kind: str, slots: Sequence[int], buf: np.ndarray,
                  keys: Sequence[bytes], first: int = 0, sink: Sink | None = None
                  ) -> list[bool]:
        self.files[kind].read(slots[0], list(buf))
        unit = self.units[kind]
        out = []
        for k, key in enumerate(keys):
            head = unpack(buf[k, :HEADER_BYTES].data)
            out.append(head is not None and head.kind == kind and head.meta.key == key
                       and head.layout == self.layout and head.length == unit
                       and self.mac.verify(key, head.fields,
                                           buf[k, HEADER_BYTES:HEADER_BYTES + unit].data,
                                           head.tag))
        if sink is not None:
            sink(first, buf[:, HEADER_BYTES:HEADER_BYTES + unit], out)
        return out

    # ------------------------------------------------------------------ restart
    def _check_meta(self) -> bool:
        """Whether the files there were made with these slot sizes and counts (else they
        are recreated, empty)."""
        where = os.path.join(self.path, "meta.json")
        want = {"format": FORMAT, "slot_bytes": self.slot_size, "slots": self.nslots}
        try:
            with open(where) as f:
                have = json.load(f)
        except (OSError, ValueError):
            have = None
        if have == want:
            return True
        if have is not None:
            log.warning("disk tier %s was made with other slots (%s); starting it empty",
                        self.path, have.get("slots") if isinstance(have, dict) else have)
        for kind in ("kv", "swa", "state"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, f"{kind}.slab"))
        tmp = where + ".tmp"
        with open(tmp, "w") as f:
            json.dump(want, f)
        os.replace(tmp, where)
        return False

    def _scan(self) -> list[Recovered]:
        """Read every slot's header; the slots whose header is this layout's, newest copy
        of each key per kind. Tags are checked when a slot is read."""
        start = time.perf_counter()
        found: list[Recovered] = []
        top = 0
        scan = ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="tierstore-disk-scan")
        for kind, slab in self.files.items():
            jobs = [scan.submit(self._scan_range, kind, lo, min(lo + SCAN_BATCH, slab.nslots))
                    for lo in range(0, slab.nslots, SCAN_BATCH)]
            newest: dict[bytes, Recovered] = {}
            for job in jobs:
                for rec in job.result():
                    top = max(top, rec.generation)
                    old = newest.get(rec.meta.key)
                    if old is None or old.generation < rec.generation:
                        newest[rec.meta.key] = rec
            for rec in newest.values():
                self._held[kind][rec.slot] = rec.meta
                self._gen_of[kind][rec.slot] = rec.generation
            found += newest.values()
            self.stats.scanned += slab.nslots
        scan.shutdown()
        self._gen = top + 1
        self.stats.extra["restart"] = "scan"
        self.stats.scan_s = time.perf_counter() - start
        self.stats.recovered = len(found)
        return found

    def _restore(self, saved: tuple[list[Recovered], int]) -> list[Recovered]:
        """What the checkpointed index of a clean close names (slots in range, this tier's
        kinds, the newest copy of each key); each slot's tag is verified when it is read, as
        after a scan."""
        start = time.perf_counter()
        rows, self._gen = saved
        newest: dict[tuple[str, bytes], Recovered] = {}
        for rec in rows:
            if rec.kind in self._held and 0 <= rec.slot < self.nslots[rec.kind]:
                old = newest.get((rec.kind, rec.meta.key))
                if old is None or old.generation < rec.generation:
                    newest[(rec.kind, rec.meta.key)] = rec
        found = list(newest.values())
        for rec in found:
            self._held[rec.kind][rec.slot] = rec.meta
            self._gen_of[rec.kind][rec.slot] = rec.generation
        self.stats.scan_s = time.perf_counter() - start
        self.stats.recovered = len(found)
        self.stats.extra["restart"] = "index"
        return found

    def _scan_range(self, kind: str, lo: int, hi: int) -> list[Recovered]:
        slab, unit = self.files[kind], self.units[kind]
        block = aligned(ALIGN)
        out = []
        for slot in range(lo, hi):
            os.preadv(slab.fd, [block.data], slot * slab.slot_size)
            head = unpack(block[:HEADER_BYTES].data)
            if head is not None and head.kind == kind and head.layout == self.layout \
                    and head.length == unit:
                out.append(Recovered(kind, slot, head.meta, head.generation))
        return out

    # ------------------------------------------------------------------ lifetime
    def snapshot(self) -> dict[str, Any]:
        """Occupancy and counters, for stats and metrics."""
        s = self.stats
        return {"path": self.path, "direct": self.direct, "capacity_bytes": self.capacity_bytes,
                "slots": dict(self.nslots), "used": {k: len(h) for k, h in self._held.items()},
                "used_bytes": sum(len(h) * self.slot_size[k] for k, h in self._held.items()),
                "reads": s.reads, "writes": s.writes, "bytes_read": s.bytes_read,
                "bytes_written": s.bytes_written, "read_s": s.read_s, "write_s": s.write_s,
                "misses": s.misses, "io_errors": s.io_errors, "scan_s": s.scan_s,
                "scanned": s.scanned, "recovered": s.recovered,
                "restart": s.extra.get("restart", "nothing")}

    def close(self) -> None:
        """Flush and close the files, checkpoint the index (a clean restart reads it instead of
        scanning), stop the workers and free the directory."""
        self._pool.shutdown(wait=True)
        for slab in self.files.values():
            with contextlib.suppress(OSError):
                os.fdatasync(slab.fd)
            slab.close()
        if self._ready:
            self._ready = False
            try:
                index.save(os.path.join(self.path, index.NAME), self.mac, self.layout,
                           self._gen, self._held, self._gen_of)
            except OSError as exc:  # the next start scans instead
                log.warning("disk tier %s: index not saved: %s", self.path, exc)
        self.files = {}
        if self._lock >= 0:
            os.close(self._lock)  # drops the flock
            self._lock = -1

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split(size: int, slot_size: Mapping[str, int], weights: Mapping[str, float]
           ) -> dict[str, int]:
    """Slots per kind: ``size`` bytes shared in proportion to ``weights`` per page."""
    per_page = sum(weights.get(k, 1.0) * s for k, s in slot_size.items())
    pages = size / per_page if per_page else 0
    out = {k: int(weights.get(k, 1.0) * pages) for k in slot_size}
    if any(n < 1 for n in out.values()):
        raise DiskTierError(f"a disk tier of {size} bytes cannot hold one slot per kind "
                            f"(slots of {dict(slot_size)} bytes)")
    return out


_local = threading.local()
SCRATCH_MAX = 8 << 20  # a worker keeps a staging buffer up to this size between writes


def _scratch(nbytes: int) -> np.ndarray:
    """An aligned staging buffer of ``nbytes`` (contents stale) for this worker thread: kept
    and reused up to ``SCRATCH_MAX``, since a fresh buffer costs a page fault per 4 KiB (on a
    busy VM, more than the write itself)."""
    if nbytes > SCRATCH_MAX:
        return aligned(nbytes, zero=False)
    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.buf = aligned(max(nbytes, MAX_RUN_BYTES), zero=False)
    return buf[:nbytes]


def _wait(job: Future[Any], what: str) -> Any:
    """A job's result, or None (logged) when its I/O failed."""
    try:
        result = job.result()
    except OSError as exc:
        log.warning("%s failed: %s", what, exc)
        return None
    return True if result is None else result


__all__ = ["DiskStats", "DiskTier", "DiskTierError", "Recovered"]
