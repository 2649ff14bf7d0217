"""Where each key lives, and the admin commands that go through redis-py.

``StandaloneTopology`` is one server. ``ClusterTopology`` keeps redis-py's
``redis.asyncio.RedisCluster`` for slot discovery (``CLUSTER SLOTS``), refreshes after a
``MOVED`` reply, and for ``SCAN`` over every primary. Bulk data never goes through redis-py
(see ``resp.py``); its errors are translated here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import redis.asyncio as aredis
from redis.exceptions import RedisError

from remote_tier.config import RemoteTierConfig
from remote_tier.errors import RemoteUnavailable, translate
from remote_tier.keys import key_slot

log = logging.getLogger(__name__)

Address = tuple[str, int]


class StandaloneTopology:
    """A single Redis server: every key lives at the URL's host and port (or unix socket:
    the address is then ``(path, 0)``)."""

    is_cluster = False

    def __init__(self, config: RemoteTierConfig) -> None:
        ep = config.endpoint()
        self._address: Address = (ep.host, ep.port)
        self._client = aredis.Redis(
            host=ep.host,
            port=ep.port,
            unix_socket_path=ep.path,  # None: TCP
            db=ep.db,
            username=ep.username,
            password=ep.password,
            socket_timeout=config.op_timeout_s,
            socket_connect_timeout=config.op_timeout_s,
        )

    @property
    def ready(self) -> bool:
        """Always true: there is nothing to discover."""
        return True

    async def refresh(self) -> None:
        """Nothing to refresh for one server."""

    def address_of(self, key: bytes) -> Address:
        """The server holding ``key``."""
        return self._address

    async def scan(self, pattern: str, count: int) -> AsyncIterator[str]:
        """Every key matching ``pattern`` (``SCAN``; may repeat keys, never misses one)."""
        try:
            async for key in self._client.scan_iter(match=pattern, count=count):
                yield key.decode()
        except RedisError as exc:
            raise translate(exc) from None

    async def aclose(self) -> None:
        """Close redis-py's connections."""
        await self._client.aclose()


class ClusterTopology:
    """A Redis Cluster: slot → primary map from redis-py, refreshed on demand."""

    is_cluster = True

    def __init__(self, config: RemoteTierConfig) -> None:
        ep = config.endpoint()
        self._client = aredis.RedisCluster(
            host=ep.host,
            port=ep.port,
            username=ep.username,
            password=ep.password,
            socket_timeout=config.op_timeout_s,
            socket_connect_timeout=config.op_timeout_s,
        )
        self._timeout_s = config.op_timeout_s
        self._ready = False
        self._refreshing: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        """Whether a slot map has been loaded."""
        return self._ready

    async def refresh(self) -> None:
        """Reload the slot map (one reload at a time; concurrent callers share it);
        ``RemoteUnavailable`` if no node answers."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._reload())
        await asyncio.shield(self._refreshing)

    async def _reload(self) -> None:
        try:
            if self._ready:
                await asyncio.wait_for(self._client.nodes_manager.initialize(), self._timeout_s)
            else:
                await asyncio.wait_for(self._client.initialize(), 3 * self._timeout_s)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise translate(exc) from None
        self._ready = True
        log.info("cluster slot map loaded: %d primaries", len(self._client.get_primaries()))

    def address_of(self, key: bytes) -> Address:
        """The primary holding ``key``'s slot; ``RemoteUnavailable`` if none is known."""
        if not self._ready:
            raise RemoteUnavailable("topology", "cluster slot map not loaded")
        try:
            node = self._client.nodes_manager.get_node_from_slot(key_slot(key))
        except RedisError as exc:
            raise translate(exc) from None
        return str(node.host), int(node.port)

    async def scan(self, pattern: str, count: int) -> AsyncIterator[str]:
        """Every key matching ``pattern`` on every primary."""
        if not self._ready:
            await self.refresh()
        try:
            async for key in self._client.scan_iter(match=pattern, count=count):
                yield key.decode()
        except RedisError as exc:
            raise translate(exc) from None

    async def aclose(self) -> None:
        """Close redis-py's connections."""
        if self._refreshing is not None and not self._refreshing.done():
            self._refreshing.cancel()
        await self._client.aclose()


Topology = StandaloneTopology | ClusterTopology
