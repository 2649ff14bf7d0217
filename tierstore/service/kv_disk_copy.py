"""The storage API's disk copy as the event loop drives it (:class:`~.kv_disk.DiskValues` is
the copy itself): one thread of its own runs every call on it (its I/O fans out on the disk
tier's workers), reads fill host ranges straight from disk, and committed values are written
behind from their pinned host ranges.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from tierstore.service.kv_changes import Changes
from tierstore.service.kv_disk import DiskValues, digest
from tierstore.service.kv_host import HostValues, Value
from tierstore.service.kv_remote import WRITE_BEHIND_BYTES

log = logging.getLogger(__name__)
T = TypeVar("T")
Found = Value | bytes | memoryview | None


class DiskCopy:
    """Calls on ``disk`` from the loop, and its reads and writes against ``host`` memory;
    :meth:`close` closes the disk copy (its index checkpointed)."""

    def __init__(self, disk: DiskValues, host: HostValues, changes: Changes) -> None:
        self.disk = disk
        self.host = host
        self.changes = changes
        self.behind_bytes = 0
        self._behind: set[asyncio.Task[None]] = set()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tierstore-kv-disk")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the disk copy's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def has(self, key: str) -> bool:
        """Whether the disk holds ``key`` (a read of the disk thread's dict from the loop: a
        value it evicts meanwhile is reported present and then misses, as with Redis)."""
        return digest(key) in self.disk

    async def read(self, keys: Sequence[str], missing: Sequence[int], out: list[Found]
                   ) -> int:
        """Fill ``out[i]`` for the ``missing`` keys the disk holds: a pinned host value (read
        from disk straight into a host range) where one fits, else a view of the buffer the
        disk filled (no copy on the loop). A key put or deleted while read is a miss. How
        many were found."""
        digests = [digest(keys[i]) for i in missing]
        # Lengths read from the disk thread's index on the loop: a value replaced meanwhile
        # no longer matches its target and reads as a miss.
        lengths = [self.disk.length(d) for d in digests]
        targets: list[np.ndarray | None] = []
        ranges: list[Value | None] = []
        for length in lengths:
            value = None if length is None else self.host.reserve(length)
            if value is not None:
                value.pins = 1  # unpublished: nothing may reuse it while the disk fills it
                targets.append(self.host.tensor(value).numpy())
            else:
                targets.append(None if length is None else np.empty(length, np.uint8))
            ranges.append(value)
        fill = asyncio.get_running_loop().run_in_executor(self._thread, self.disk.get_into,
                                                          digests, targets)
        mark = self.changes.begin_read([keys[i] for i in missing])
        try:
            got = await asyncio.shield(fill)
        except BaseException:  # cancelled: give the ranges back once the disk is done
            def give_back(_: object) -> None:
                for value in ranges:
                    if value is not None:
                        value.pins = 0
                        self.host.abandon(value)

            fill.add_done_callback(give_back)
            raise
        finally:
            changed = self.changes.end_read(mark)
        found = 0
        for i, ok, value, target in zip(missing, got, ranges, targets, strict=True):
            if keys[i] in changed:  # put or deleted while read: the disk had older bytes
                ok = False
            if value is not None:
                value.pins = 0
                if not ok:
                    self.host.abandon(value)
                    continue
                self.host.publish(keys[i], value)
                self.host.pin(value)
                out[i] = value
            elif ok and target is not None:
                out[i] = target.data  # a view: no copy on the loop
            found += ok
        return found

    async def write_behind(self, items: list[tuple[str, Value]], capacity_bytes: int) -> None:
        """Write published host values to disk in the background (pinned, and their keys
        changing, until written); past ``WRITE_BEHIND_BYTES`` or half of host memory
        (``capacity_bytes``) in flight (as the kernel lets dirty pages take a share of memory
        before a writer waits), before returning."""
        for _, value in items:
            self.host.pin(value)
        self.changes.opened([k for k, _ in items])
        nbytes = sum(v.length for _, v in items)
        self.behind_bytes += nbytes

        def done(_: object = None) -> None:
            self.behind_bytes -= nbytes
            self.changes.settled([k for k, _ in items])
            for _, value in items:
                self.host.unpin(value)

        async def write() -> None:
            put = asyncio.get_running_loop().run_in_executor(
                self._thread, self.disk.put, [digest(k) for k, _ in items],
                [self.host.view(v) for _, v in items])
            try:
                await asyncio.shield(put)
            except asyncio.CancelledError:  # the disk thread reads the ranges until it is done
                put.add_done_callback(done)
                raise
            except Exception:
                log.exception("disk write of %d storage values failed", len(items))
            done()

        if self.behind_bytes > max(WRITE_BEHIND_BYTES, capacity_bytes // 2):
            await write()
        else:
            task = asyncio.ensure_future(write())
            self._behind.add(task)
            task.add_done_callback(self._behind.discard)

    async def flush(self) -> None:
        """Wait for every background write."""
        while self._behind:
            await asyncio.gather(*self._behind, return_exceptions=True)

    def close(self) -> None:
        """Stop the thread and close the disk copy (background writes not yet done are
        lost: :meth:`flush` first)."""
        self._thread.shutdown(wait=True)
        self.disk.close()

    def stats(self) -> dict[str, int]:
        return {**self.disk.stats(), "disk_behind_bytes": self.behind_bytes}
