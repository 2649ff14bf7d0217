"""Key-addressed storage: the shape of an engine's L3 backend (e.g. SGLang HiCache storage).

Values are opaque bytes under engine-supplied keys. A bounded LRU copy lives in host memory — a
shared segment that same-host clients read and fill themselves (:mod:`.kv_host`); with a disk
tier (``serve --disk``) every value is also written to its slots (:mod:`.kv_disk`: a larger LRU
that survives restarts, MAC-verified when read), and when Redis is configured to Redis too
(shared across instances and restarts). A read looks in host memory, then on disk (a hit is
copied back into host memory), then in Redis (:mod:`.kv_remote`); a disk or Redis read that
may have raced a put or delete of its key is a miss, never older bytes published
(:mod:`.kv_changes`). Runs on the service's event loop: host bookkeeping is dict work, Redis
I/O is awaited, disk calls run on one thread of their own (their I/O on the disk tier's
workers), and bulk copies happen in the client (shared memory), in worker threads, or while a
range is pinned.

Keys carry their tenant (:meth:`KeyValueStore.key`), so two tenants never share a value; a
tenant with a byte quota loses its own oldest values first (:mod:`.quotas`). A write answers
per value whether it is stored and, when not, why (``Reason``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from remote_tier import RedisTier
from tierstore.errors import UsageError
from tierstore.service.kv_changes import Changes
from tierstore.service.kv_commits import CommitLog
from tierstore.service.kv_disk import DiskValues, digest
from tierstore.service.kv_disk_copy import DiskCopy, Found
from tierstore.service.kv_host import HostValues, Value, tenant_of
from tierstore.service.kv_remote import WRITE_BEHIND_BYTES, Reason, RemoteCopy
from tierstore.service.quotas import ValueQuota

log = logging.getLogger(__name__)
_KEY = re.compile(r"^[\x21-\x7e]{1,400}$")
# Batches of more bytes than this are copied into host memory off the loop.
COPY_ON_LOOP_BYTES = 4 << 20
T = TypeVar("T")
__all__ = ["WRITE_BEHIND_BYTES", "BadKeyError", "KeyValueStore", "Reason"]


class BadKeyError(UsageError):
    """A key that is empty, too long or not printable ASCII."""


class KeyValueStore:
    """Engine-keyed values in host memory (LRU, ``capacity_bytes``), on ``disk`` (when given;
    closed with this store) and in Redis."""

    def __init__(self, capacity_bytes: int, remote: RedisTier | None, *, ttl_s: float = 30.0,
                 shared: bool = True, reservation_ttl_s: float | None = None,
                 disk: DiskValues | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.disk = disk
        # Puts and deletes a disk or Redis read may have raced: it must not publish its
        # older bytes over them.
        self._changes = Changes()
        self._commits = CommitLog(self._changes, ttl_s)  # answers for retried commits
        self.host = HostValues(capacity_bytes, ttl_s, shared=shared,
                               reservation_ttl_s=reservation_ttl_s)
        self.disk_copy = None if disk is None else DiskCopy(disk, self.host, self._changes)
        self.quota = ValueQuota()
        self.refused: dict[str, int] = {}  # values not stored, by reason
        self.hits = {"host": 0, "disk": 0, "redis": 0, "miss": 0}
        self.sets = 0
        self.l3 = RemoteCopy(self.host, self._changes, remote)

    @property
    def remote(self) -> RedisTier | None:
        """Redis (None without it; the service connects it at start)."""
        return self.l3.tier

    @remote.setter
    def remote(self, tier: RedisTier | None) -> None:
        self.l3.tier = tier

    @staticmethod
    def key(namespace: str, key: object, tenant: str = "") -> str:
        """The stored key of ``key`` in ``tenant``'s ``namespace``:
        ``{tenant}|{len(namespace)}:{namespace}/{key}`` (without a tenant, the part from
        ``{len(namespace)}`` on), so no two (tenant, namespace, key) triples share one
        (``a/b`` + ``c`` is not ``a`` + ``b/c``; tenant names hold no ``|`` or ``:``);
        BadKeyError when malformed. (Before issue 14 it was ``{namespace}/{key}``: values
        stored then are not found under the new keys.)"""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise BadKeyError(f"keys must be 1-400 printable ASCII characters, got {key!r:.60}")
        scoped = f"{len(namespace)}:{namespace}/{key}"
        return f"{tenant}|{scoped}" if tenant else scoped

    async def batch_set(self, keys: Sequence[str], values: Sequence[bytes], *,
                        limit: int | None = None) -> tuple[list[bool], list[Reason | None]]:
        """Store values (in the order given: parent first) of one tenant (``limit``: its byte
        quota, its own oldest values deleted first to make room); per value whether it is
        stored and, if not, why. A value Redis refused is not kept in host memory either.
        Large batches are copied into host memory by a worker thread, not on the loop."""
        tenant = tenant_of(keys[0]) if keys else ""
        fits = len(keys)
        if limit is not None and keys:
            fits = await self._quota_room(tenant, limit, keys, [len(v) for v in values])
        keys, rest = keys[:fits], keys[fits:]
        values = values[:fits]
        if sum(len(v) for v in values) < COPY_ON_LOOP_BYTES:
            stored = [self.host.put(k, v) for k, v in zip(keys, values, strict=True)]
        else:
            stored = await self._put_off_loop(keys, values)
        # Now, not before an await: a read begun while the quota made room or a worker
        # copied must not publish older bytes over these; in flight until Redis has them.
        self._changes.changing(keys)
        try:
            reasons = await self._write_through(keys, values, stored)
        finally:
            self._changes.settled(keys)
        if limit is not None:
            self.quota.charge(tenant, [k for k, ok in zip(keys, stored, strict=True) if ok],
                              [len(v) for v, ok in zip(values, stored, strict=True) if ok])
        self.sets += len(keys)
        reasons += ["quota"] * len(rest)
        for reason in reasons:
            if reason is not None:
                self.refused[reason] = self.refused.get(reason, 0) + 1
        return stored + [False] * len(rest), reasons

    async def _write_through(self, keys: Sequence[str], values: Sequence[bytes],
                             stored: list[bool]) -> list[Reason | None]:
        """Write values host memory took (``stored``, updated) to disk and Redis; per value
        why it is not stored (a value Redis refused is dropped from host memory and disk)."""
        if self.disk is not None and keys:
            on_disk = await self._on_disk(self.disk.put, [digest(k) for k in keys], values)
            stored[:] = [a or b for a, b in zip(stored, on_disk, strict=True)]
        reasons: list[Reason | None] = [None if ok else "no_room" for ok in stored]
        if self.remote is not None and keys:
            acked, why = await self.l3.put(keys, values)
            for i, ok in enumerate(acked):
                if ok:
                    stored[i], reasons[i] = True, None
                elif why == "l3_refused" or not stored[i]:
                    if stored[i]:
                        self.host.drop(keys[i])
                        if self.disk is not None:
                            await self._on_disk(self.disk.delete, [digest(keys[i])])
                    stored[i], reasons[i] = False, why
        return reasons

    async def _quota_room(self, tenant: str, limit: int, keys: Sequence[str],
                          sizes: Sequence[int]) -> int:
        """Delete ``tenant``'s oldest values until as many of ``keys`` as its quota allows
        fit; how many (from the first) do."""
        fits, victims = self.quota.make_room(tenant, limit, keys, sizes)
        if victims:
            log.info("tenant %s over its %d-byte quota: deleting its %d oldest values",
                     tenant, limit, len(victims))
            await self.delete(victims)
        return fits

    async def _put_off_loop(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        ranges = [self.host.reserve(len(v)) for v in values]
        await self._copy_in([(r, v) for r, v in zip(ranges, values, strict=True)
                             if r is not None], force=True)
        for key, value in zip(keys, ranges, strict=True):
            if value is not None:
                self.host.publish(key, value)
        return [r is not None for r in ranges]

    async def _copy_in(self, items: list[tuple[Value, bytes | memoryview]], *,
                       force: bool = False) -> None:
        """Fill unpublished host ranges: on the loop when they total under
        ``COPY_ON_LOOP_BYTES``, else (or with ``force``) on a worker thread; cancelled or
        failed, the ranges are abandoned once the copy has stopped."""
        if not force and sum(memoryview(d).nbytes for _, d in items) < COPY_ON_LOOP_BYTES:
            _fill(self.host, items)
            return
        copy = asyncio.get_running_loop().run_in_executor(None, _fill, self.host, items)
        try:
            await asyncio.shield(copy)
        except BaseException:  # give the ranges back once the copy has stopped
            def give_back(_: object) -> None:
                for value, _data in items:
                    self.host.abandon(value)

            copy.add_done_callback(give_back)
            raise

    async def lookup(self, keys: Sequence[str]) -> list[Found]:
        """Per key its host value, else what the disk or Redis had (copied into host memory
        when it fits, then given as that value; else the buffer read, as a view), else None.
        Every host value returned is pinned (the caller unpins it: later puts of the same
        batch must not evict it)."""
        out: list[Found] = []
        for key in keys:
            value = self.host.get(key)
            if value is not None:
                self.host.pin(value)
            out.append(value)
        missing = [i for i, v in enumerate(out) if v is None]
        self.hits["host"] += len(keys) - len(missing)
        try:
            if missing and self.disk is not None:
                assert self.disk_copy is not None
                self.hits["disk"] += await self.disk_copy.read(keys, missing, out)
                missing = [i for i in missing if out[i] is None]
            if missing and self.remote is not None:
                await self._from_remote(keys, missing, out)
        except BaseException:  # cancelled or failed: nobody will unpin what was found
            for found in out:
                if isinstance(found, Value):
                    self.host.unpin(found)
            raise
        self.hits["miss"] += sum(v is None for v in out)
        return out

    async def _from_remote(self, keys: Sequence[str], missing: Sequence[int],
                           out: list[Found]) -> None:
        """Fill ``out[i]`` for the ``missing`` keys Redis holds: a pinned host value where one
        fits (a large batch copied in by a worker thread), else the bytes Redis sent (a view,
        not copied). A key put or deleted while Redis answered or the bytes were copied in,
        or whose change was in flight (its Redis write not landed), is a miss: the bytes may
        be older than it."""
        mark = self._changes.begin_read([keys[i] for i in missing])
        try:
            fetched = await self.l3.get(mark.keys)
            found = [(i, view) for i, view in zip(missing, fetched, strict=True)
                     if view is not None]
            ranges = [self.host.reserve(view.nbytes) for _, view in found]
            await self._copy_in([(value, view) for (_, view), value
                                 in zip(found, ranges, strict=True) if value is not None])
        finally:
            stale = self._changes.end_read(mark)
        for (i, view), value in zip(found, ranges, strict=True):
            if keys[i] in stale:
                if value is not None:
                    self.host.abandon(value)
                continue
            self.hits["redis"] += 1
            if value is None:  # host memory cannot take it
                out[i] = view
                continue
            self.host.publish(keys[i], value)
            self.host.pin(value)
            out[i] = value

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
        while count < len(keys) and (keys[count] in self.host or self._disk_has(keys[count])):
            count += 1
        if count < len(keys) and self.remote is not None:
            count += await self.l3.count(keys[count:])
        return count

    async def exists_each(self, keys: Sequence[str]) -> list[bool]:
        """Whether some tier holds each of ``keys`` (one Redis probe for those not in host
        memory; a failed probe reads absent)."""
        present = [k in self.host or self._disk_has(k) for k in keys]
        rest = [i for i, here in enumerate(present) if not here]
        if rest and self.remote is not None:
            found = await self.l3.present([keys[i] for i in rest])
            for i, here in zip(rest, found, strict=True):
                present[i] = here
        return present

    async def delete(self, keys: Sequence[str]) -> int:
        """Delete ``keys`` (of one tenant) everywhere; how many some tier held."""
        self._changes.changing(keys)  # in flight until Redis has deleted them too
        try:
            if keys:
                self.quota.forget(tenant_of(keys[0]), keys)
            deleted = sum(self.host.drop(k) for k in set(keys))
            if self.disk is not None:
                deleted = max(deleted, await self._on_disk(self.disk.delete,
                                                           [digest(k) for k in set(keys)]))
            in_redis = await self.l3.delete(keys) if self.remote is not None else 0
        finally:
            self._changes.settled(keys)
        return max(deleted, in_redis)  # Redis holds every value that host memory holds

    # ------------------------------------------------------------------ reserve -> commit
    def reserve(self, keys: Sequence[str], sizes: Sequence[int], principal: str = "", *,
                budget: int | None = None) -> tuple[str, list[Value | None]]:
        """Unpublished host ranges for values of ``sizes`` under ``keys`` (None where one cannot
        fit: only the keys' tenant's own values are evicted for them, and the ranges given
        total at most ``budget`` bytes), held for ``principal`` to fill until :meth:`commit`
        or the reservation TTL; the reservation id and the ranges."""
        owner = tenant_of(keys[0]) if keys else ""
        values: list[Value | None] = []
        left = self.capacity_bytes if budget is None else budget
        for n in sizes:
            value = self.host.reserve(n, owner=owner) if n <= left else None
            left -= 0 if value is None else n
            values.append(value)
        items = list(zip(keys, values, strict=True))
        return self.host.hold_reservation(items, principal), values

    async def commit(self, res_id: str, principal: str = "", *, limit: int | None = None
                     ) -> list[bool] | None:
        """Publish a filled reservation of ``principal``; per key whether host memory took it
        (and, with a tenant byte quota ``limit``, whether it fit: its oldest values go first).
        Redis gets the values in the background (or, past ``WRITE_BEHIND_BYTES`` in flight,
        before this returns). A retry of a commit that ran (its answer lost) gets the same
        answer (:mod:`.kv_commits`; CommitSuperseded when a key of it was put or deleted
        since). None when the reservation is unknown, expired or another principal's
        (nothing is published)."""
        items = self.host.take_reservation(res_id, principal)
        if items is None:
            return await self._commits.replay(res_id, principal)
        self._commits.begin(res_id, principal)
        stored: list[bool] | None = None
        try:
            stored = await self._publish(res_id, items, limit)
        finally:
            self._commits.end(res_id, stored)
        return stored

    async def _publish(self, res_id: str, items: list[tuple[str, Value | None]],
                       limit: int | None) -> list[bool]:
        """Publish a reservation's filled ranges (within the tenant's quota ``limit``) and
        write them behind to disk and Redis; per key whether host memory took it."""
        if limit is not None and items:
            tenant = tenant_of(items[0][0])
            filled = [(k, v) for k, v in items if v is not None]
            fits = await self._quota_room(tenant, limit, [k for k, _ in filled],
                                          [v.length for _, v in filled])
            for _, value in filled[fits:]:
                self.host.abandon(value)
            kept = {id(v) for _, v in filled[:fits]}
            items = [(k, v if v is not None and id(v) in kept else None) for k, v in items]
            self.quota.charge(tenant, [k for k, _ in filled[:fits]],
                              [v.length for _, v in filled[:fits]])
        done = [(k, v) for k, v in items if v is not None]
        keys = [k for k, _ in done]
        self._changes.changing(keys)  # its background writes keep it in flight
        self._commits.watch(res_id, keys)
        try:
            for key, value in done:
                self.host.publish(key, value)
            self.sets += len(done)
            if done and self.disk is not None:
                assert self.disk_copy is not None
                await self.disk_copy.write_behind(done, self.capacity_bytes)
            if done and self.remote is not None:
                await self.l3.write_behind(done)
        finally:
            self._changes.settled(keys)
        return [v is not None for _, v in items]

    def abort(self, res_id: str, principal: str = "") -> bool:
        """Return a reservation's ranges unpublished; False when unknown, expired or another
        principal's."""
        items = self.host.take_reservation(res_id, principal)
        for _, value in items or []:
            if value is not None:
                self.host.abandon(value)
        return items is not None

    async def flush(self) -> None:
        """Wait for every background Redis and disk write."""
        if self.disk_copy is not None:
            await self.disk_copy.flush()
        await self.l3.flush()

    async def aclose(self) -> None:
        """Finish background writes, close Redis and the disk copy (its index checkpointed)
        and unlink the shared segment."""
        await self.flush()
        await self.l3.aclose()
        self.close()

    def close(self) -> None:
        """Close the disk copy and unlink the shared segment (background writes not yet done
        are lost: :meth:`aclose` waits for them)."""
        if self.disk_copy is not None:
            self.disk_copy.close()
        self.host.close()

    def stats(self) -> dict[str, int]:
        disk = {} if self.disk_copy is None else self.disk_copy.stats()
        return {**self.host.stats(), "sets": self.sets, "redis_behind_bytes": self.l3.behind_bytes,
                **disk, **{f"hits_{k}": v for k, v in self.hits.items()},
                **{f"refused_{k}": v for k, v in self.refused.items()}}

    # ------------------------------------------------------------------ disk
    async def _on_disk(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the disk copy's thread."""
        assert self.disk_copy is not None
        return await self.disk_copy.run(fn, *args)

    def _disk_has(self, key: str) -> bool:
        return self.disk_copy is not None and self.disk_copy.has(key)

    async def drop_host_copies(self) -> int:
        """Drop the host copies of values the disk holds (after the background disk writes;
        pinned ones stay), so that the next reads come from disk; how many were dropped."""
        await self.flush()
        if self.disk is None:
            return 0
        held = [k for k in list(self.host.keys()) if self._disk_has(k)]
        return sum(self.host.drop_unpinned(k) for k in held)


def _fill(host: HostValues, items: list[tuple[Value, bytes | memoryview]]) -> None:
    for value, data in items:
        host.tensor(value).numpy()[:] = np.frombuffer(data, np.uint8)
