"""RedisTier on a 3-node Redis Cluster on loopback: keys spread over slots and nodes,
slot-grouped batches, probes, corruption, clear, and recovery from a stale slot map."""

from __future__ import annotations

import os

import pytest
import redis
from redis.crc import key_slot

from remote_tier import wire
from remote_tier.config import RemoteTierConfig
from remote_tier.keys import envelope_key, part_key
from remote_tier.store import RedisTier
from tierstore.testing.redis_server import RedisCluster


def _key(i: int, kind: str = "kv") -> str:
    return envelope_key("c", "fp", f"{i:016x}", kind)


def _config(cluster: RedisCluster, **kwargs: object) -> RemoteTierConfig:
    return RemoteTierConfig(url=cluster.url, mode="cluster", key_prefix="c", **kwargs)  # type: ignore[arg-type]


def _owner(cluster: RedisCluster, key: str) -> int:
    """Which node owns ``key``'s slot."""
    client = redis.Redis(host="127.0.0.1", port=cluster.nodes[0].port)
    slot = key_slot(key.encode())
    for start, end, primary, *_ in client.cluster("SLOTS"):
        if start <= slot <= end:
            return next(i for i, n in enumerate(cluster.nodes) if n.port == primary[1])
    raise AssertionError(f"slot {slot} is not covered")


def _node_of(cluster: RedisCluster, key: str) -> int:
    """The node holding ``key``, or -1."""
    node = _owner(cluster, key)
    return node if redis.Redis(host="127.0.0.1", port=cluster.nodes[node].port).exists(key) else -1


async def test_round_trip_across_slots_and_nodes(cluster: RedisCluster) -> None:
    payloads = [os.urandom(n) for n in [1, 1000, 70_000, 300_000, 1 << 20] * 8]
    keys = [_key(i, ("kv", "swa", "state")[i % 3]) for i in range(len(payloads))]
    async with RedisTier(_config(cluster, batch_keys=4)) as tier:
        assert await tier.put_many(list(zip(keys, payloads, strict=False))) == [True] * len(keys)
        got = await tier.get_many(keys)
        assert [g.tobytes() if g is not None else None for g in got] == payloads
        outs = [bytearray(len(p)) for p in payloads]
        got = await tier.get_many(keys, outs)
        assert [bytes(o) for o in outs] == payloads
        assert len({key_slot(k.encode()) for k in keys}) == len(keys)
        assert {_node_of(cluster, k) for k in keys} == {0, 1, 2}
        assert len(tier.stats().breakers) == 3
        assert await tier.ping()
        tier.check_integrity()


async def test_exists_prefix_and_delete_across_nodes(cluster: RedisCluster) -> None:
    keys = [_key(i) for i in range(30)]
    async with RedisTier(_config(cluster, batch_keys=7)) as tier:
        await tier.put_many([(k, b"v") for k in keys[:17] + keys[18:]])
        assert await tier.exists_prefix(keys) == 17
        assert await tier.exists_many(keys) == [i != 17 for i in range(30)]
        assert await tier.delete_many(keys[:5]) == 5
        assert await tier.exists_prefix(keys) == 0
        assert await tier.exists_prefix(keys[5:]) == 12


async def test_unordered_puts_and_clear(cluster: RedisCluster) -> None:
    keys = [_key(i) for i in range(200)]
    foreign = redis.Redis(host="127.0.0.1", port=cluster.nodes[0].port)
    async with RedisTier(_config(cluster, ordered_writes=False)) as tier:
        assert all(await tier.put_many([(k, k.encode()) for k in keys]))
        got = await tier.get_many(keys)
        assert [g.tobytes() if g else None for g in got] == [k.encode() for k in keys]
        keep = next(f"foreign{i}" for i in range(100) if _owner(cluster, f"foreign{i}") == 0)
        foreign.set(keep, b"keep")
        assert await tier.clear() == 200
        assert foreign.get(keep) == b"keep"


async def test_corrupt_value_on_a_cluster_node_is_deleted(cluster: RedisCluster) -> None:
    async with RedisTier(_config(cluster)) as tier:
        await tier.put_many([(_key(1), b"good"), (_key(2), b"good")])
        node = _node_of(cluster, _key(2))
        redis.Redis(host="127.0.0.1", port=cluster.nodes[node].port).set(_key(2), b"\xc1bad")
        got = await tier.get_many([_key(1), _key(2)])
        assert got[0] is not None and got[0].tobytes() == b"good" and got[1] is None
        assert _node_of(cluster, _key(2)) == -1
        assert tier.stats().num_corrupt_deleted == 1


async def test_stale_slot_map_is_refreshed_after_moved(cluster: RedisCluster) -> None:
    async with RedisTier(_config(cluster)) as tier:
        keys = [_key(i) for i in range(40)]
        topology = tier._router.topology
        real_address_of = topology.address_of
        wrong = ("127.0.0.1", cluster.nodes[0].port)
        stale = {"on": True}

        def stale_address_of(key: bytes) -> tuple[str, int]:
            return wrong if stale["on"] else real_address_of(key)

        real_refresh = topology.refresh

        async def refresh() -> None:
            stale["on"] = False
            await real_refresh()

        topology.address_of = stale_address_of  # type: ignore[method-assign]
        topology.refresh = refresh  # type: ignore[method-assign]
        assert all(await tier.put_many([(k, b"v") for k in keys]))
        assert tier.stats().errors["moved"] >= 1
        stale["on"] = True
        got = await tier.get_many(keys)
        assert all(g is not None and g.tobytes() == b"v" for g in got), (got, tier.stats())
        stale["on"] = True
        assert await tier.exists_prefix(keys) == 40
        stale["on"] = True
        assert await tier.delete_many(keys) == 40


# -- values split over several keys (chunk_bytes) -------------------------------------------------

C = 4096


def _split(cluster: RedisCluster, **kwargs: object) -> RemoteTierConfig:
    return _config(cluster, chunk_bytes=C, **kwargs)


def _part_keys(key: str, size: int) -> list[str]:
    return [part_key(key.encode(), i).decode() for i in range(wire.num_parts(size, C))]


async def test_split_values_round_trip_over_slots_and_nodes(cluster: RedisCluster) -> None:
    sizes = [100, C, C + 1, 4 * C, 4 * C + 1, 30 * C + 5] * 2
    payloads = [os.urandom(n) for n in sizes]
    keys = [_key(i) for i in range(len(sizes))]
    async with RedisTier(_split(cluster, batch_keys=4)) as tier:
        assert all(await tier.put_many(list(zip(keys, payloads, strict=True))))
        got = await tier.get_many(keys)
        assert [g.tobytes() if g is not None else None for g in got] == payloads
        outs = [bytearray(n) for n in sizes]
        await tier.get_many(keys, outs)
        assert [bytes(o) for o in outs] == payloads
        parts = _part_keys(keys[5], sizes[5])
        assert len(parts) == 31 and {_node_of(cluster, k) for k in parts} == {0, 1, 2}
        stored = {k for n in cluster.nodes for k in redis.Redis(port=n.port).keys("*")}
        want = {k for key, n in zip(keys, sizes, strict=True) for k in _part_keys(key, n)}
        assert stored == {k.encode() for k in want}
        assert tier.stats().errors == {}
        tier.check_integrity()


async def test_split_values_missing_part_delete_and_clear(cluster: RedisCluster) -> None:
    keys = [_key(i) for i in range(4)]
    payloads = [os.urandom(5 * C) for _ in keys]
    async with RedisTier(_split(cluster)) as tier:
        assert all(await tier.put_many(list(zip(keys, payloads, strict=True))))
        victim = _part_keys(keys[0], 5 * C)[2]
        redis.Redis(port=cluster.nodes[_node_of(cluster, victim)].port).delete(victim)
        got = await tier.get_many(keys, [bytearray(5 * C) for _ in keys])
        assert got[0] is None and [g.tobytes() for g in got[1:] if g] == payloads[1:]
        assert {_node_of(cluster, k) for k in _part_keys(keys[0], 5 * C)} == {-1}
        assert tier.stats().errors == {"incomplete": 1}
        assert await tier.delete_many(keys[:2]) == 1
        assert {_node_of(cluster, k) for k in _part_keys(keys[1], 5 * C)} == {-1}
        assert await tier.clear() == 2
        assert sum(redis.Redis(port=n.port).dbsize() for n in cluster.nodes) == 0


@pytest.mark.parametrize("into", [False, True])
async def test_split_values_after_moved(cluster: RedisCluster, into: bool) -> None:
    async with RedisTier(_split(cluster)) as tier:
        keys = [_key(i) for i in range(6)]
        payloads = [os.urandom(3 * C + i) for i in range(6)]
        topology = tier._router.topology
        real_address_of, real_refresh = topology.address_of, topology.refresh
        wrong = ("127.0.0.1", cluster.nodes[0].port)
        stale = {"on": True}

        def stale_address_of(key: bytes) -> tuple[str, int]:
            return wrong if stale["on"] else real_address_of(key)

        async def refresh() -> None:
            stale["on"] = False
            await real_refresh()

        topology.address_of = stale_address_of  # type: ignore[method-assign]
        topology.refresh = refresh  # type: ignore[method-assign]
        assert all(await tier.put_many(list(zip(keys, payloads, strict=True))))
        assert tier.stats().errors["moved"] >= 1
        stale["on"] = True
        outs = [bytearray(len(p)) for p in payloads] if into else None
        got = await tier.get_many(keys, outs)
        assert [g.tobytes() if g is not None else None for g in got] == payloads
        stale["on"] = True
        assert await tier.delete_many(keys) == 6
        stored = sum(redis.Redis(port=n.port).dbsize() for n in cluster.nodes)
        assert stored == 0
