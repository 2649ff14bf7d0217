"""Fixtures shared by every test folder: one private redis-server per test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tierstore.testing.redis_server import RedisServer, RedisUnavailableError, redis_binary


@pytest.fixture(scope="session")
def redis_bin() -> str:
    """The redis-server binary (installed with apt when missing and running as root)."""
    try:
        return redis_binary()
    except RedisUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def redis_server(redis_bin: str) -> Iterator[RedisServer]:
    """A private redis-server on a free loopback port for this test session."""
    with RedisServer() as server:
        yield server
