"""``Router``: which node holds a key, the connections to each node, and running per-key
commands over every node at once (mechanism shared by ``RedisTier``'s reads and deletes)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from remote_tier.breaker import CircuitBreaker
from remote_tier.config import RemoteTierConfig
from remote_tier.errors import Moved, RemoteUnavailable
from remote_tier.pool import NodePool
from remote_tier.resp import Arg, BulkSink, Reply
from remote_tier.stats import Counters
from remote_tier.topology import Address, ClusterTopology, StandaloneTopology, Topology
from remote_tier.transfer import execute, group_keys

log = logging.getLogger(__name__)

_SPREAD_UNIT = 1024 * 1024


class Router:
    """The topology (standalone or cluster), one ``NodePool`` per node, and a breaker for
    loading a cluster's slot map. Bookkeeping only; one event loop."""

    def __init__(
        self,
        config: RemoteTierConfig,
        counters: Counters,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._counters = counters
        self._clock = clock
        self._endpoint = config.endpoint()
        self.topology: Topology = (
            ClusterTopology(config) if config.mode == "cluster" else StandaloneTopology(config)
        )
        self.pools: dict[Address, NodePool] = {}
        self._slot_map_breaker = CircuitBreaker(
            failures=config.breaker_failures,
            cooldown_s=config.breaker_cooldown_s,
            max_cooldown_s=config.breaker_max_cooldown_s,
            clock=clock,
            name="redis cluster slot map",
        )
        self._value_bytes = 256.0 * 1024  # typical value size, learnt from reads

    def note_values(self, num_values: int, num_bytes: int) -> None:
        """Learn the typical value size from a read (a moving average)."""
        if num_values:
            self._value_bytes += (num_bytes / num_values - self._value_bytes) / 2

    def _spread(self, num_keys: int, pool: NodePool) -> int:
        """Connections to spread one read over: one per ``_SPREAD_UNIT`` expected bytes. Small
        values gain nothing from more connections but cost a command and a wake-up each."""
        expected = num_keys * self._value_bytes
        return max(1, min(pool.size, round(expected / _SPREAD_UNIT)))

    def address_of(self, key: bytes) -> Address:
        """The node holding ``key`` (``RemoteUnavailable`` without a slot map)."""
        return self.topology.address_of(key)

    def pool(self, address: Address) -> NodePool:
        """The pool of the node at ``address`` (created on first use)."""
        pool = self.pools.get(address)
        if pool is None:
            pool = NodePool(
                address[0],
                address[1],
                config=self._config,
                endpoint=self._endpoint,
                clock=self._clock,
            )
            self.pools[address] = pool
        return pool

    async def ensure_topology(self) -> bool:
        """Whether keys can be routed; loads a cluster's slot map behind its own breaker."""
        if self.topology.ready:
            return True
        if not self._slot_map_breaker.allow():
            self._counters.error("circuit_open")
            return False
        try:
            await self.topology.refresh()
        except RemoteUnavailable as exc:
            self._slot_map_breaker.record_failure()
            self._counters.error(exc.reason)
            log.warning("redis cluster slot map unavailable: %s", exc)
            return False
        except BaseException:
            self._slot_map_breaker.abandon()
            raise
        self._slot_map_breaker.record_success()
        return True

    async def refresh(self) -> None:
        """Reload a cluster's slot map after a ``MOVED``; failures are counted, not raised."""
        try:
            await self.topology.refresh()
        except RemoteUnavailable as exc:
            self._counters.error(exc.reason)
            log.warning("redis cluster slot map refresh failed: %s", exc)

    async def run_keyed(
        self,
        command: str,
        keys_b: list[bytes],
        max_keys: int,
        sinks: list[BulkSink] | None,
        *,
        reads_values: bool = False,
        args: Sequence[Arg] = (),
    ) -> list[tuple[list[int], Reply | Exception]]:
        """Run ``command`` over ``keys_b`` in groups of at most ``max_keys`` keys per node (one
        slot per group on a cluster), nodes concurrently; after a ``MOVED``, refresh the slot
        map and rerun those groups once. One ``(key indexes, reply)`` per group; ``args``
        follow the keys in every command.

        ``reads_values``: replies carry values of about the learnt typical size, so groups
        and connections in flight are sized by bytes (``pipeline_bytes``), as writes are."""
        window = self._config.pipeline_bytes
        if reads_values:
            max_keys = max(1, min(max_keys, int(window // max(self._value_bytes, 1.0))))
        done: list[tuple[list[int], Reply | Exception]] = []
        todo = list(range(len(keys_b)))
        for attempt in range(2):
            if not await self.ensure_topology():
                return done + [([i], RemoteUnavailable("topology")) for i in todo]
            by_node: dict[Address, list[int]] = {}
            for i in todo:
                try:
                    by_node.setdefault(self.topology.address_of(keys_b[i]), []).append(i)
                except RemoteUnavailable as exc:
                    done.append(([i], exc))

            async def on_node(
                address: Address, idxs: list[int]
            ) -> list[tuple[list[int], Reply | Exception]]:
                pool = self.pool(address)
                spread = self._spread(len(idxs), pool) if reads_values else 1
                groups = group_keys(
                    keys_b,
                    idxs,
                    cluster=self.topology.is_cluster,
                    max_keys=max_keys,
                    spread=spread,
                )
                cmds: list[Sequence[Arg]] = [
                    (command, *(keys_b[i] for i in g), *args) for g in groups
                ]
                cmd_sinks = None if sinks is None else [_group_sink(sinks, g) for g in groups]
                costs = (
                    [round(len(g) * self._value_bytes) for g in groups] if reads_values else None
                )
                owns = sinks is not None
                got = await execute(
                    pool, cmds, cmd_sinks, self._counters, costs, window, spread, owns_buffers=owns
                )
                return list(zip(groups, got, strict=True))

            todo = []
            for results in await asyncio.gather(*(on_node(a, i) for a, i in by_node.items())):
                for group, reply in results:
                    if isinstance(reply, Moved) and not attempt:
                        todo += group
                    else:
                        done.append((group, reply))
            if not todo:
                break
            await self.refresh()
        return done

    async def mget(self, keys_b: list[bytes], sinks: list[BulkSink]) -> list[Reply | Exception]:
        """``MGET`` every key (values received through ``sinks``, one per key); one reply per
        key: a value, ``None`` when absent, or the exception that stopped its group."""
        replies: list[Reply | Exception] = [None] * len(keys_b)
        grouped = await self.run_keyed(
            "MGET", keys_b, self._config.batch_keys, sinks, reads_values=True
        )
        for group, reply in grouped:
            values = reply if isinstance(reply, list) and len(reply) == len(group) else None
            for pos, i in enumerate(group):
                replies[i] = reply if values is None else values[pos]
        return replies

    async def unlink(self, keys_b: list[bytes]) -> int:
        """``UNLINK`` every key; how many existed (unreachable nodes count 0)."""
        if not keys_b:
            return 0
        replies = await self.run_keyed("UNLINK", keys_b, self._config.batch_keys, None)
        return sum(r for _, r in replies if isinstance(r, int))

    async def aclose(self) -> None:
        """Close every node's connections and redis-py's."""
        pools, self.pools = list(self.pools.values()), {}
        for pool in pools:
            await pool.aclose()
        await self.topology.aclose()


def _group_sink(sinks: list[BulkSink], group: list[int]) -> BulkSink:
    """The sink of a multi-key command: reply position ``p`` belongs to key ``group[p]``."""
    return lambda position, length: sinks[group[position]](0, length)
