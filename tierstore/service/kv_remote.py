"""The storage API's Redis copy: the I/O edge of :class:`~.kv.KeyValueStore` to Redis.

Writes go through (awaited, with why a value was refused) or behind (a committed shared-memory
write: its host ranges stay pinned until Redis has them, and its keys count as changing until
then, :mod:`.kv_changes`). A Redis error never fails a call: a read is a miss, a probe says
absent, a write says not stored. Runs on the service's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Literal

from remote_tier import RedisTier, RemoteTierError
from tierstore.service.kv_changes import Changes
from tierstore.service.kv_host import HostValues, Value

log = logging.getLogger(__name__)

# Committed shared-memory writes reach Redis in the background; beyond this many bytes in
# flight a commit waits for its own write (back-pressure).
WRITE_BEHIND_BYTES = 256 << 20
# Why a value was not stored: over the tenant's quota, Redis answered the write with an error
# (e.g. OOM at maxmemory), Redis could not be reached and host memory had no room, or (no
# Redis) host memory had no room.
Reason = Literal["quota", "l3_refused", "l3_unavailable", "no_room"]


class RemoteCopy:
    """Values under stored keys in Redis (``tier``: None until the service connects it, or
    without Redis), written behind from pinned ``host`` ranges."""

    def __init__(self, host: HostValues, changes: Changes, tier: RedisTier | None = None
                 ) -> None:
        self.tier = tier
        self.host = host
        self.changes = changes
        self.behind_bytes = 0
        self._behind: set[asyncio.Task[None]] = set()

    async def put(self, keys: Sequence[str], values: Sequence[bytes | memoryview]
                  ) -> tuple[list[bool], Reason]:
        """Per key whether Redis acknowledged the write, and why the others failed: an error
        reply seen during the call (``l3_refused``, e.g. OOM at maxmemory) or not
        (``l3_unavailable``). Attribution is per call: concurrent calls share the counter."""
        assert self.tier is not None
        refusals = self.tier.stats().errors.get("server", 0)
        try:
            acked = await self.tier.put_many(
                [(self.tier.raw_key(k), v) for k, v in zip(keys, values, strict=True)])
        except RemoteTierError as exc:
            log.warning("redis put failed: %s", exc)
            acked = [False] * len(keys)
        refused = self.tier.stats().errors.get("server", 0) > refusals
        return acked, "l3_refused" if refused else "l3_unavailable"

    async def get(self, keys: Sequence[str]) -> list[memoryview | None]:
        """Per key the bytes Redis holds (verified), or None (also when Redis failed)."""
        assert self.tier is not None
        try:
            return await self.tier.get_many([self.tier.raw_key(k) for k in keys])
        except RemoteTierError as exc:
            log.warning("redis get failed: %s", exc)
            return [None] * len(keys)

    async def count(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, Redis holds (0 when it failed)."""
        assert self.tier is not None
        try:
            return await self.tier.exists_prefix([self.tier.raw_key(k) for k in keys])
        except RemoteTierError as exc:
            log.warning("redis exists failed: %s", exc)
            return 0

    async def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether Redis holds each of ``keys`` (absent where it failed)."""
        assert self.tier is not None
        try:
            return await self.tier.exists_many([self.tier.raw_key(k) for k in keys])
        except RemoteTierError as exc:
            log.warning("redis exists failed: %s", exc)
            return [False] * len(keys)

    async def delete(self, keys: Sequence[str]) -> int:
        """Delete ``keys``; how many Redis held (0 when it failed)."""
        assert self.tier is not None
        try:
            return await self.tier.delete_many([self.tier.raw_key(k) for k in keys])
        except RemoteTierError as exc:
            log.warning("redis delete failed: %s", exc)
            return 0

    async def write_behind(self, items: list[tuple[str, Value]]) -> None:
        """Write published host values to Redis in the background (pinned, and their keys
        changing, until written); past ``WRITE_BEHIND_BYTES`` in flight, before returning."""
        for _, value in items:  # pinned now: nothing may reuse them before the write runs
            self.host.pin(value)
        self.changes.opened([k for k, _ in items])
        self.behind_bytes += sum(v.length for _, v in items)
        write = self._write(items)
        if self.behind_bytes > WRITE_BEHIND_BYTES:
            await write
        else:
            task = asyncio.ensure_future(write)
            self._behind.add(task)
            task.add_done_callback(self._behind.discard)

    async def _write(self, items: list[tuple[str, Value]]) -> None:
        try:
            await self.put([k for k, _ in items], [self.host.view(v) for _, v in items])
        finally:
            self.behind_bytes -= sum(v.length for _, v in items)
            self.changes.settled([k for k, _ in items])
            for _, value in items:
                self.host.unpin(value)

    async def flush(self) -> None:
        """Wait for every background write."""
        while self._behind:
            await asyncio.gather(*self._behind, return_exceptions=True)

    async def aclose(self) -> None:
        """Finish the background writes and close the connections."""
        await self.flush()
        if self.tier is not None:
            await self.tier.aclose()
