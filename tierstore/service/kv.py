"""Key-addressed storage: the shape of an engine's L3 backend (e.g. SGLang HiCache storage).

Values are opaque bytes under engine-supplied keys. A bounded LRU copy lives in host memory; when
Redis is configured every value is also written there (shared across instances and restarts).
Runs on the service's event loop: host bookkeeping is plain dict work, Redis I/O is awaited.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Sequence

from remote_tier import RedisTier, RemoteTierError

log = logging.getLogger(__name__)
_KEY = re.compile(r"^[\x21-\x7e]{1,400}$")


class BadKeyError(ValueError):
    """A key that is empty, too long or not printable ASCII."""


class KeyValueStore:
    """Engine-keyed values in host memory (LRU, ``capacity_bytes``) and Redis."""

    def __init__(self, capacity_bytes: int, remote: RedisTier | None) -> None:
        self.capacity_bytes = capacity_bytes
        self.remote = remote
        self._host: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self.hits = {"host": 0, "redis": 0, "miss": 0}
        self.sets = 0

    @staticmethod
    def key(namespace: str, key: object) -> str:
        """The stored key of ``key`` in ``namespace``; BadKeyError when malformed."""
        if not isinstance(key, str) or not _KEY.match(key):
            raise BadKeyError(f"keys must be 1-400 printable ASCII characters, got {key!r:.60}")
        return f"{namespace}/{key}"

    async def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        """Store values (in the order given: parent first); True where some tier took it."""
        stored = [self._put_host(k, v) for k, v in zip(keys, values, strict=True)]
        if self.remote is not None:
            acked = await self._remote_put(keys, values)
            stored = [a or b for a, b in zip(stored, acked, strict=True)]
        self.sets += len(keys)
        return stored

    async def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` (None where no tier has one)."""
        out: list[bytes | None] = []
        missing = []
        for i, k in enumerate(keys):
            value = self._host.get(k)
            if value is not None:
                self._host.move_to_end(k)
                self.hits["host"] += 1
            else:
                missing.append(i)
            out.append(value)
        if missing and self.remote is not None:
            fetched = await self._remote_get([keys[i] for i in missing])
            for i, view in zip(missing, fetched, strict=True):
                if view is not None:
                    value = bytes(view)
                    out[i] = value
                    self._put_host(keys[i], value)
                    self.hits["redis"] += 1
        self.hits["miss"] += sum(v is None for v in out)
        return out

    async def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, some tier holds."""
        count = 0
        while count < len(keys) and keys[count] in self._host:
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
        present = [k in self._host for k in keys]
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
        deleted = set()
        for k in keys:
            value = self._host.pop(k, None)
            if value is not None:
                self._bytes -= len(value)
                deleted.add(k)
        in_redis = 0
        if self.remote is not None:
            try:
                in_redis = await self.remote.delete_many([self.remote.raw_key(k) for k in keys])
            except RemoteTierError as exc:
                log.warning("redis delete failed: %s", exc)
        return max(len(deleted), in_redis)  # Redis holds every value that host memory holds

    def stats(self) -> dict[str, int]:
        return {"host_keys": len(self._host), "host_bytes": self._bytes, "sets": self.sets,
                **{f"hits_{k}": v for k, v in self.hits.items()}}

    def _put_host(self, key: str, value: bytes) -> bool:
        if len(value) > self.capacity_bytes:
            return False
        old = self._host.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        while self._bytes + len(value) > self.capacity_bytes and self._host:
            _, evicted = self._host.popitem(last=False)
            self._bytes -= len(evicted)
        self._host[key] = value
        self._bytes += len(value)
        return True

    async def _remote_put(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
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
