"""The storage API's disk copy: engine-keyed values in the local disk tier's slots.

A value is cut into chunks of ``chunk_bytes`` (the last one zero padded), each in one slot of a
:class:`disk_tier.DiskTier` with a single slab, so values of any size share one file and a
batch lands in consecutive slots (one vectored call per run). A chunk's slot header binds it
to its value and its write:

- ``parent``: the 32-byte digest of the stored key (tenant, namespace and key);
- ``key``: the digest's first 16 bytes, the write's id (8), the chunk's index (4) and the
  value's chunk count (4), so no chunk of one write can stand in for another's;
- ``depth``: the value's length in bytes;

and the slot's MAC (the L3 scheme) covers all of them and the chunk's bytes. A chunk that
fails verification (torn, stale, foreign, forged) makes its value a miss.

After a clean close the tier reads its checkpointed index; after a crash it scans the slot
headers. Either way the values re-form from their chunks here: a value whose chunks are not
all found is dropped, and of two complete writes of one key the newer wins (a crash in the
middle of an overwrite leaves the previous value). A value evicted or deleted before a crash
may be found again by the scan (the last bytes written under its key, verified).

Not thread-safe: the owner runs every call on one thread (I/O happens on the tier's own
workers, in parallel within a batch).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np

from disk_tier import DiskTier, Recovered, SlotMeta
from disk_tier.slab import aligned
from remote_tier.mac import Mac
from tierstore.settings import mac_secret

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from tierstore.service.config import ServiceConfig

log = logging.getLogger(__name__)

KIND = "kv"  # the one slab (the tier's kinds name envelope kinds; values use the first)
LAYOUT = "tierstore storage API values v1"  # bound into every header: no page slot reads here
DEFAULT_CHUNK_BYTES = 256 << 10
MAX_VALUE_BYTES = (1 << 32) - 1  # the length rides in the header's 32-bit depth
STAGE_BYTES = 64 << 20  # reads of more slots than this go in several groups


def digest(key: str) -> bytes:
    """The 32 bytes a stored key is known by on disk."""
    return blake3.blake3(key.encode()).digest()


@dataclass
class Entry:
    """One value on disk: its chunks' slots and keys, and its length."""

    slots: list[int]
    keys: list[bytes]
    length: int


class DiskValues:
    """Values under stored keys in ``size_bytes`` of slots under ``path``, least recently used
    first out when room is needed (``mac``: the L3 scheme's; ``direct``: as
    :class:`~disk_tier.DiskTier`)."""

    def __init__(self, path: str | os.PathLike[str], size_bytes: int, mac: Mac, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, io_threads: int = 4,
                 direct: bool | None = None) -> None:
        self.chunk = chunk_bytes
        self.tier = DiskTier(path, size_bytes, {KIND: chunk_bytes}, LAYOUT, mac,
                             io_threads=io_threads, direct=direct, weights={KIND: 1.0})
        self._index: OrderedDict[bytes, Entry] = OrderedDict()
        self._stage: np.ndarray | None = None
        self.evictions = 0
        self.recovered = self._rebuild(self.tier.recovered)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def chunks(self, length: int) -> int:
        return max(1, -(-length // self.chunk))

    # ------------------------------------------------------------------ writes
    def put(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> list[bool]:
        """Write ``values`` under ``keys`` (digests), replacing what the keys held and
        evicting the least recently used values for room; per value whether it is on disk
        (a value larger than the tier, or whose write failed, is not, and its old value is
        gone)."""
        views = [memoryview(v).cast("B") for v in values]
        for key in keys:
            self._drop(key)
        need = [self.chunks(v.nbytes) if v.nbytes <= MAX_VALUE_BYTES else -1 for v in views]
        fits = [0 < n <= self.tier.nslots[KIND] for n in need]
        total = sum(n for n, ok in zip(need, fits, strict=True) if ok)
        while not self.tier.can_alloc({KIND: total}) and self._index:
            self._evict()
        while not self.tier.can_alloc({KIND: total}):  # still short: drop the last values
            last = max(i for i, ok in enumerate(fits) if ok)
            fits[last] = False
            total -= need[last]
        slots = self.tier.alloc(KIND, total) or []
        write_id = secrets.token_bytes(8)
        rows: list[memoryview] = []
        metas: list[SlotMeta] = []
        placed: list[tuple[int, Entry]] = []
        at = 0
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            if not fits[i]:
                continue
            n = need[i]
            own = slots[at:at + n]
            at += n
            names = [key[:16] + write_id + j.to_bytes(4, "big") + n.to_bytes(4, "big")
                     for j in range(n)]
            rows += [view[j * self.chunk:(j + 1) * self.chunk] for j in range(n)]
            metas += [SlotMeta(name, key, view.nbytes) for name in names]
            placed.append((i, Entry(own, names, view.nbytes)))
        ok = self.tier.write(KIND, slots, rows, metas) if slots else []
        stored = [False] * len(keys)
        at = 0
        for i, entry in placed:
            good = all(ok[at:at + len(entry.slots)])
            at += len(entry.slots)
            if good:
                self._drop(keys[i])  # a key given twice in the batch: the last one stays
                self._index[keys[i]] = entry
                stored[i] = True
            else:
                self.tier.free(KIND, entry.slots)
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        """Forget ``keys``' values (their slots are reused); how many were held."""
        return sum(self._drop(k) for k in keys)

    def _drop(self, key: bytes) -> bool:
        entry = self._index.pop(key, None)
        if entry is not None:
            self.tier.free(KIND, entry.slots)
        return entry is not None

    def _evict(self) -> None:
        _, entry = self._index.popitem(last=False)
        self.tier.free(KIND, entry.slots)
        self.evictions += 1

    # ------------------------------------------------------------------ reads
    def length(self, key: bytes) -> int | None:
        """The length of ``key``'s value on disk, or None."""
        entry = self._index.get(key)
        return None if entry is None else entry.length

    def get_into(self, keys: Sequence[bytes], targets: Sequence[np.ndarray | None]
                 ) -> list[bool]:
        """Copy the values of ``keys`` into ``targets`` (uint8 arrays of each value's length;
        None: skip); per key whether it was there, verified and copied. A value with a chunk
        that fails verification is dropped. Reads go through one staging buffer, reused, in
        groups of at most ``STAGE_BYTES`` (a fresh buffer costs a page fault per 4 KiB)."""
        first: dict[bytes, int] = {}  # a key given twice is read (and dropped, freed) once
        for i, (k, t) in enumerate(zip(keys, targets, strict=True)):
            if t is not None and k in self._index and t.size == self._index[k].length:
                first.setdefault(k, i)
        want = [(i, self._index[k]) for k, i in first.items()]
        out = [False] * len(keys)
        slot = self.tier.slot_size[KIND]
        group: list[tuple[int, Entry]] = []
        for item in [*want, None]:
            if item is not None and (not group or (sum(len(e.slots) for _, e in group)
                                                   + len(item[1].slots)) * slot <= STAGE_BYTES):
                group.append(item)
                continue
            if group:
                self._read_group(keys, targets, group, out)
            group = [] if item is None else [item]
        for i, (k, t) in enumerate(zip(keys, targets, strict=True)):
            j = first.get(k, i)
            if j != i and out[j] and t is not None and t.size == self._index[k].length:
                t[:] = targets[j]
                out[i] = True
        return out

    def _read_group(self, keys: Sequence[bytes], targets: Sequence[np.ndarray | None],
                    group: Sequence[tuple[int, Entry]], out: list[bool]) -> None:
        slots = [s for _, e in group for s in e.slots]
        names = [n for _, e in group for n in e.keys]
        # Where each slot's chunk goes: (target, offset, bytes); the tier's workers copy
        # them out as their runs verify.
        place: list[tuple[np.ndarray, int, int]] = []
        for i, entry in group:
            target = targets[i]
            assert target is not None
            place += [(target, j * self.chunk, min(self.chunk, entry.length - j * self.chunk))
                      for j in range(len(entry.slots))]

        def sink(first: int, rows: np.ndarray, ok: list[bool]) -> None:
            for k, good in enumerate(ok):
                target, at, n = place[first + k]
                if good and n > 0:
                    target[at:at + n] = rows[k, :n]

        need = len(slots) * self.tier.slot_size[KIND]
        if self._stage is None or self._stage.nbytes < need:
            self._stage = aligned(max(need, STAGE_BYTES), zero=False)
        _, ok = self.tier.read(KIND, slots, names, out=self._stage, sink=sink)  # frees failed
        at = 0
        for i, entry in group:
            n = len(entry.slots)
            good = ok[at:at + n]
            if all(good):
                out[i] = True
                self._index.move_to_end(keys[i])
            else:
                del self._index[keys[i]]
                self.tier.free(KIND, [s for s, g in zip(entry.slots, good, strict=True) if g])
            at += n

    # ------------------------------------------------------------------ restart
    def _rebuild(self, recovered: Sequence[Recovered]) -> int:
        """Re-form values from the chunks a previous run left: complete writes only, the
        newest per key, oldest first in the LRU order; the other slots are freed."""
        writes: dict[tuple[bytes, bytes], dict[int, Recovered]] = {}
        for rec in recovered:
            name, key = rec.meta.key, rec.meta.parent
            if len(name) == 32 and len(key) == 32 and name[:16] == key[:16]:
                writes.setdefault((key, name[16:24]), {})[int.from_bytes(name[24:28], "big")] \
                    = rec
        best: dict[bytes, tuple[int, list[Recovered]]] = {}
        for (key, _), chunks in writes.items():
            first = next(iter(chunks.values()))
            n, length = int.from_bytes(first.meta.key[28:], "big"), first.meta.depth
            if n != self.chunks(length) or sorted(chunks) != list(range(n)) or any(
                    c.meta.depth != length or c.meta.key[28:] != first.meta.key[28:]
                    for c in chunks.values()):
                continue
            gen = min(c.generation for c in chunks.values())
            if key not in best or best[key][0] < gen:
                best[key] = (gen, [chunks[j] for j in range(n)])
        kept = sorted(best.items(), key=lambda kv: kv[1][0])
        used: set[int] = set()
        for key, (_, parts) in kept:
            self._index[key] = Entry([c.slot for c in parts], [c.meta.key for c in parts],
                                     parts[0].meta.depth)
            used.update(c.slot for c in parts)
        stray = [r.slot for r in recovered if r.slot not in used]
        if stray:
            self.tier.free(KIND, stray)
        if recovered:
            log.info("storage API disk copy: %d values found again (%d stray slots freed)",
                     len(kept), len(stray))
        return len(kept)

    # ------------------------------------------------------------------ lifetime
    def stats(self) -> dict[str, Any]:
        snap = self.tier.snapshot()
        return {"disk_keys": len(self._index), "disk_used_bytes": snap["used_bytes"],
                "disk_capacity_bytes": snap["capacity_bytes"], "disk_evictions": self.evictions,
                "disk_bytes_read": snap["bytes_read"], "disk_bytes_written": snap["bytes_written"],
                "disk_misses": snap["misses"], "disk_recovered": self.recovered}

    def check_integrity(self) -> None:
        """AssertionError unless every indexed chunk is a held slot, no slot is in two values
        and free + held slots are all slots."""
        slots = [s for e in self._index.values() for s in e.slots]
        assert len(slots) == len(set(slots)), "a slot is in two values"
        assert self.tier.used(KIND) == len(slots), \
            f"{self.tier.used(KIND)} slots held, {len(slots)} indexed"
        assert self.tier.used(KIND) + self.tier.free_slots(KIND) == self.tier.nslots[KIND]

    def close(self) -> None:
        """Close the tier (a clean close checkpoints its index)."""
        self.tier.close()

    def __enter__(self) -> DiskValues:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_disk(config: ServiceConfig) -> DiskValues | None:
    """The disk copy ``config`` asks for (``kv_disk_path``), or None."""
    if config.kv_disk_path is None:
        return None
    secret = config.kv_disk_mac_key if config.kv_disk_mac_key is not None else mac_secret()
    return DiskValues(config.kv_disk_path, config.kv_disk_bytes, Mac(secret),
                      chunk_bytes=config.kv_disk_chunk_bytes)
