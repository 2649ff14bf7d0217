"""``tierstore serve --disk``: the service's store gets the disk tier, its metrics a disk row,
and a second service on the same directory (and key file) finds the cached prefixes."""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
from pathlib import Path

import pytest
import torch
from redis.exceptions import RedisClusterException

from remote_tier import RemoteTierConfig
from tierstore.client import Client
from tierstore.config import StoreConfig
from tierstore.service import server
from tierstore.service.config import ServiceConfig
from tierstore.service.metrics import StoreCollector
from tierstore.store import TierStore
from tierstore.testing.redis_server import RedisServer
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port


def build(tmp_path: Path, stack: contextlib.ExitStack) -> object:
    key = tmp_path / "mac.key"
    if not key.exists():
        key.write_bytes(b"d" * 40)
        key.chmod(0o600)
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(["--no-redis", "--device", "cpu", "--l1", "1MiB", "--l2", "0",
                              "--scale", "1/2048", "--no-shm", "--mac-key-file", str(key),
                              "--disk", str(tmp_path / "disk"), "--disk-size", "16MiB"])
    service, _ = server.build(args, stack)
    stack.callback(service.store.close)
    stack.callback(service.kv.close)
    return service


def test_serve_disk_keeps_prefixes_across_a_restart(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        store = build(tmp_path, stack).store  # type: ignore[attr-defined]
        assert store.disk is not None
        units = store._units
        page = store.layout.page_size
        tokens = list(range(4 * page))
        data = {k: torch.randint(0, 256, (4 if k != "state" else 1, units[k]),
                                 dtype=torch.uint8) for k in store.kinds}
        given = {k: (v[0] if k == "state" else v) for k, v in data.items()}
        assert store.insert(tokens, **given).stored
        store.demote_idle(0)
        stats = store.stats()
        assert stats.disk["used"]["kv"] == 4
        collector = StoreCollector()
        collector.snapshot = stats
        names = {m.name for m in collector.collect()}
        assert {"tierstore_disk_bytes", "tierstore_disk_slots"} <= names
    with contextlib.ExitStack() as stack:
        store = build(tmp_path, stack).store  # type: ignore[attr-defined]
        m = store.match(tokens + [1])
        assert m.tokens == 4 * page and m.tiers["disk"] == 4 * page
        assert torch.equal(store.arena.read("kv", m.kv), data["kv"])
        store.release(m.lease)


def test_a_service_whose_redis_fails_at_start_closes_its_disk_copies(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """A start that fails on Redis (here: cluster mode against a standalone server) releases
    what the service opened, the storage API's disk copy and the store's disk tier: their
    threads, files and directory locks; a second start on the same directories works."""
    secret = b"s" * 40

    def parts() -> tuple[TierStore, ServiceConfig]:
        store = TierStore(tiny_layout(page_size=4), StoreConfig(
            capacity_bytes=1 << 20, disk_path=str(tmp_path / "prefix"),
            disk_size_bytes=4 << 20, disk_mac_key=secret))
        config = ServiceConfig(port=free_port(), kv_host_bytes=1 << 20, shm=False,
                               kv_disk_path=str(tmp_path / "storage"), kv_disk_bytes=1 << 20,
                               kv_disk_chunk_bytes=8 << 10, kv_disk_mac_key=secret)
        return store, config

    def disk_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if "disk" in t.name]

    fds = len(os.listdir("/proc/self/fd"))
    store, config = parts()
    bad = RemoteTierConfig(url=redis_server.url, key_prefix="tskv", mode="cluster")
    running = RunningService(store, config, bad)
    with pytest.raises(RedisClusterException):
        running.start()
    running.stop()
    kv_disk = running.service.kv.disk
    assert kv_disk is not None and store.disk is not None
    assert kv_disk.tier._lock == -1 and not kv_disk.tier.files  # closed, lock dropped
    assert not disk_threads()
    assert len(os.listdir("/proc/self/fd")) <= fds
    store, config = parts()  # the same directories: their locks are free
    with RunningService(store, config) as svc:
        client = Client(svc.url)
        try:
            assert client.batch_set(["k"], [b"v" * 100]) == [True]
            assert client.batch_get(["k"]) == [b"v" * 100]
        finally:
            client.close()
    assert not disk_threads()
