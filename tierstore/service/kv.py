"""Key-addressed storage: the shape of an engine's L3 backend (e.g. SGLang HiCache storage).

Values are opaque bytes under engine-supplied keys. A bounded LRU copy lives in host memory — a
shared segment that same-host clients read and fill themselves (:mod:`.kv_host`); when Redis is
configured every value is also written there (shared across instances and restarts). Runs on
the service's event loop: host bookkeeping is dict work, Redis I/O is awaited, and bulk copies
happen in the client (shared memory) or while a range is pinned.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Sequence

import numpy as np

from remote_tier import RedisTier, RemoteTierError
from tierstore.service.kv_host import HostValues, Value

log = logging.getLogger(__name__)
_KEY = re.compile(r"^[\x21-\x7e]{1,400}$")
# Batches of more bytes than this are copied into host memory off the loop.
COPY_ON_LOOP_BYTES = 4 << 20
# Committed shared-memory writes reach Redis in the background; beyond this many bytes in
# flight a commit waits for its own write (back-pressure).
WRITE_BEHIND_BYTES = 256 << 20


class BadKeyError(ValueError):
    """A key that is empty, too long or not printable ASCII."""


class KeyValueStore:
    """Engine-keyed values in host memory (LRU, ``capacity_bytes``) and Redis."""

    def __init__(self, capacity_bytes: int, remote: RedisTier | None, *, ttl_s: float = 30.0,
                 shared: bool = True) -> None:
        self.capacity_bytes = capacity_bytes
        self.remote = remote
        self.host = HostValues(capacity_bytes, ttl_s, shared=shared)
        self.hits = {"host": 0, "redis": 0, "miss": 0}
        self.sets = 0
        self._behind: set[asyncio.Task[None]] = set()
        self._behind_bytes = 0

    @staticmethod
    def key(namespace: str, key: object) -> str:
        """The stored key of ``key`` in ``namespace``: ``{len(namespace)}:{namespace}/{key}``,
        so no two (namespace, key) pairs share one (``a/b`` + ``c`` is not ``a`` + ``b/c``);
        BadKeyError when malformed. (Before issue 14 it was ``{namespace}/{key}``: values
        stored then are not found under the new keys.)"""
        if not isinstance(key, str) or not _KEY.match(key):
            raise BadKeyError(f"keys must be 1-400 printable ASCII characters, got {key!r:.60}")
        return f"{len(namespace)}:{namespace}/{key}"

    async def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        """Store values (in the order given: parent first); True where some tier took it.
        Large batches are copied into host memory by a worker thread, not on the loop."""
        if sum(len(v) for v in values) < COPY_ON_LOOP_BYTES:
            stored = [self.host.put(k, v) for k, v in zip(keys, values, strict=True)]
        else:
            stored = await self._put_off_loop(keys, values)
        if self.remote is not None:
            acked = await self._remote_put(keys, values)
            stored = [a or b for a, b in zip(stored, acked, strict=True)]
        self.sets += len(keys)
        return stored

    async def _put_off_loop(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        ranges = [self.host.reserve(len(v)) for v in values]
        done = [(r, v) for r, v in zip(ranges, values, strict=True) if r is not None]
        copy = asyncio.get_running_loop().run_in_executor(None, _fill, self.host, done)
        try:
            await asyncio.shield(copy)
        except BaseException:  # give the ranges back once the copy has stopped
            def give_back(_: object) -> None:
                for value, _data in done:
                    self.host.abandon(value)

            copy.add_done_callback(give_back)
            raise
        for key, value in zip(keys, ranges, strict=True):
            if value is not None:
                self.host.publish(key, value)
        return [r is not None for r in ranges]

    async def lookup(self, keys: Sequence[str]) -> list[Value | bytes | None]:
        """Per key its host value, else the bytes Redis had (copied into host memory when they
        fit, then given as that value), else None. Every value returned is pinned (the caller
        unpins it: later puts of the same batch must not evict it)."""
        out: list[Value | bytes | None] = []
        for key in keys:
            value = self.host.get(key)
            if value is not None:
                self.host.pin(value)
            out.append(value)
        missing = [i for i, v in enumerate(out) if v is None]
        self.hits["host"] += len(keys) - len(missing)
        if missing and self.remote is not None:
            fetched = await self._remote_get([keys[i] for i in missing])
            for i, view in zip(missing, fetched, strict=True):
                if view is None:
                    continue
                self.hits["redis"] += 1
                value = self.host.get(keys[i]) if self.host.put(keys[i], view) else None
                if value is not None:
                    self.host.pin(value)
                out[i] = value if value is not None else bytes(view)
        self.hits["miss"] += sum(v is None for v in out)
        return out

    async def read(self, keys: Sequence[str]
                   ) -> tuple[list[memoryview | bytes | None], Callable[[], None]]:
        """Values of ``keys`` (None where no tier has one) without copying host values, and the
        call that releases them: they stay pinned (never overwritten) until it runs."""
        found = await self.lookup(keys)
        pinned = [v for v in found if isinstance(v, Value)]

        def release() -> None:
            for value in pinned:
                self.host.unpin(value)

        return [self.host.view(v) if isinstance(v, Value) else v for v in found], release

    async def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` as bytes (None where no tier has one)."""
        views, release = await self.read(keys)
        try:
            return [None if v is None else bytes(v) for v in views]
        finally:
            release()

    async def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, some tier holds."""
        count = 0
        while count < len(keys) and keys[count] in self.host:
            count += 1
        if count < len(keys) and self.remote is not None:
            raw = [self.remote.raw_key(k) for k in keys[count:]]
            try:
                count += await self.remote.exists_prefix(raw)
            except RemoteTierError as exc:
                log.warning("redis exists failed: %s", exc)
        return count

    async def exists_each(self, keys: Sequence[str]) -> list[bool]:
        """Whether some tier holds each of ``keys`` (one Redis probe for those not in host
        memory; a failed probe reads absent)."""
        present = [k in self.host for k in keys]
        rest = [i for i, here in enumerate(present) if not here]
        if rest and self.remote is not None:
            try:
                found = await self.remote.exists_many([self.remote.raw_key(keys[i])
                                                       for i in rest])
            except RemoteTierError as exc:
                log.warning("redis exists failed: %s", exc)
                found = [False] * len(rest)
            for i, here in zip(rest, found, strict=True):
                present[i] = here
        return present

    async def delete(self, keys: Sequence[str]) -> int:
        """Delete ``keys`` everywhere; how many some tier held."""
        deleted = sum(self.host.drop(k) for k in set(keys))
        in_redis = 0
        if self.remote is not None:
            try:
                in_redis = await self.remote.delete_many([self.remote.raw_key(k) for k in keys])
            except RemoteTierError as exc:
                log.warning("redis delete failed: %s", exc)
        return max(deleted, in_redis)  # Redis holds every value that host memory holds

    # ------------------------------------------------------------------ reserve -> commit
    def reserve(self, keys: Sequence[str], sizes: Sequence[int]
                ) -> tuple[str, list[Value | None]]:
        """Unpublished host ranges for values of ``sizes`` under ``keys`` (None where one cannot
        fit), held for the client to fill until :meth:`commit` or the TTL; the reservation id
        and the ranges."""
        values = [self.host.reserve(n) for n in sizes]
        return self.host.hold_reservation(list(zip(keys, values, strict=True))), values

    async def commit(self, res_id: str) -> list[bool] | None:
        """Publish a filled reservation; per key whether host memory took it. Redis gets the
        values in the background (or, past ``WRITE_BEHIND_BYTES`` in flight, before this
        returns). None when the reservation is unknown or expired (nothing is published)."""
        items = self.host.take_reservation(res_id)
        if items is None:
            return None
        done = [(k, v) for k, v in items if v is not None]
        for key, value in done:
            self.host.publish(key, value)
        self.sets += len(done)
        if done and self.remote is not None:
            for _, value in done:  # pinned now: nothing may reuse them before the write runs
                self.host.pin(value)
            self._behind_bytes += sum(v.length for _, v in done)
            write = self._write_behind(done)
            if self._behind_bytes > WRITE_BEHIND_BYTES:
                await write
            else:
                task = asyncio.ensure_future(write)
                self._behind.add(task)
                task.add_done_callback(self._behind.discard)
        return [v is not None for _, v in items]

    def abort(self, res_id: str) -> bool:
        """Return a reservation's ranges unpublished; False when unknown or expired."""
        items = self.host.take_reservation(res_id)
        for _, value in items or []:
            if value is not None:
                self.host.abandon(value)
        return items is not None

    async def _write_behind(self, items: list[tuple[str, Value]]) -> None:
        """Write pinned values to Redis, then unpin them."""
        try:
            await self._remote_put([k for k, _ in items], [self.host.view(v) for _, v in items])
        finally:
            self._behind_bytes -= sum(v.length for _, v in items)
            for _, value in items:
                self.host.unpin(value)

    async def flush(self) -> None:
        """Wait for every background Redis write."""
        while self._behind:
            await asyncio.gather(*list(self._behind), return_exceptions=True)

    async def aclose(self) -> None:
        """Finish background writes, close Redis and unlink the shared segment."""
        await self.flush()
        if self.remote is not None:
            await self.remote.aclose()
        self.host.close()

    def stats(self) -> dict[str, int]:
        return {**self.host.stats(), "sets": self.sets, "redis_behind_bytes": self._behind_bytes,
                **{f"hits_{k}": v for k, v in self.hits.items()}}

    async def _remote_put(self, keys: Sequence[str], values: Sequence[bytes | memoryview]
                          ) -> list[bool]:
        assert self.remote is not None
        try:
            return await self.remote.put_many(
                [(self.remote.raw_key(k), v) for k, v in zip(keys, values, strict=True)])
        except RemoteTierError as exc:
            log.warning("redis put failed: %s", exc)
            return [False] * len(keys)

    async def _remote_get(self, keys: Sequence[str]) -> list[memoryview | None]:
        assert self.remote is not None
        try:
            return await self.remote.get_many([self.remote.raw_key(k) for k in keys])
        except RemoteTierError as exc:
            log.warning("redis get failed: %s", exc)
            return [None] * len(keys)


def _fill(host: HostValues, items: list[tuple[Value, bytes]]) -> None:
    for value, data in items:
        host.tensor(value).numpy()[:] = np.frombuffer(data, np.uint8)
