"""Where the storage API copies what it read from disk or Redis: never a whole value on the
event loop. A hit host memory can take is copied into it (a large batch by a worker thread);
one it cannot take is handed on as a view of the bytes read, not copied again. A real
valkey-server on loopback and a real disk tier in a temporary directory."""

from __future__ import annotations

import asyncio
import secrets
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from remote_tier import RedisTier, RemoteTierConfig
from remote_tier.mac import Mac
from tierstore.service import kv as kv_module
from tierstore.service.kv import KeyValueStore
from tierstore.service.kv_disk import DiskValues
from tierstore.testing.redis_server import RedisServer

SECRET = b"kv-copies-test-deployment-secret-0123456789"
CHUNK = 8 << 10


def data(n: int, size: int, seed: int) -> list[bytes]:
    g = np.random.default_rng(seed)
    return [g.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


async def with_redis(kv: KeyValueStore, redis_server: RedisServer) -> KeyValueStore:
    kv.remote = await RedisTier.connect(RemoteTierConfig(
        url=redis_server.url, key_prefix=f"copies{secrets.token_hex(4)}", mac_key=SECRET))
    return kv


def test_a_large_redis_fill_is_copied_into_host_memory_by_a_worker_thread(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_module, "COPY_ON_LOOP_BYTES", 1000)  # two 3000-byte values pass it
    values = data(2, 3000, seed=1)
    threads: list[str] = []
    fill = kv_module._fill

    def recorded(*args: Any) -> None:
        threads.append(threading.current_thread().name)
        fill(*args)

    async def scenario() -> None:
        kv = await with_redis(KeyValueStore(1 << 20, None, shared=False), redis_server)
        try:
            assert (await kv.batch_set(["a", "b"], values))[0] == [True, True]
            for key in ("a", "b"):
                assert kv.host.drop(key)
            monkeypatch.setattr(kv_module, "_fill", recorded)
            loop_thread = threading.current_thread().name
            assert await kv.batch_get(["a", "b"]) == values
            assert threads and loop_thread not in threads  # copied, off the loop
            assert kv.hits["redis"] == 2 and "a" in kv.host and "b" in kv.host
            assert await kv.batch_get(["a", "b"]) == values  # from host memory now
            assert kv.hits["host"] == 2
            kv.host.check_integrity()
        finally:
            await kv.aclose()

    asyncio.run(scenario())


def test_a_redis_hit_too_large_for_host_memory_is_handed_on_uncopied(
        redis_server: RedisServer) -> None:
    (value,) = data(1, 20_000, seed=2)

    async def scenario() -> None:
        kv = await with_redis(KeyValueStore(1 << 20, None, shared=False), redis_server)
        small = KeyValueStore(4096, kv.remote, shared=False)  # host memory of 4 KiB
        try:
            assert (await kv.batch_set(["big"], [value]))[0] == [True]
            views, release = await small.read(["big"])
            try:
                assert isinstance(views[0], memoryview)  # the bytes Redis sent, no copy
                assert bytes(views[0]) == value
            finally:
                release()
            assert small.hits["redis"] == 1 and "big" not in small.host
            small.host.check_integrity()
        finally:
            small.close()
            await kv.aclose()

    asyncio.run(scenario())


def test_a_disk_hit_too_large_for_host_memory_is_handed_on_uncopied(tmp_path: Path) -> None:
    (value,) = data(1, 3 * CHUNK, seed=3)

    async def scenario() -> None:
        disk = DiskValues(tmp_path, 16 * (CHUNK + 4096), Mac(SECRET), chunk_bytes=CHUNK,
                          io_threads=2)
        kv = KeyValueStore(4096, None, shared=False, disk=disk)  # the value never fits
        try:
            assert (await kv.batch_set(["big"], [value]))[0] == [True]
            assert "big" not in kv.host
            views, release = await kv.read(["big"])
            try:
                assert isinstance(views[0], memoryview)  # the buffer the disk filled
                assert bytes(views[0]) == value
            finally:
                release()
            assert kv.hits["disk"] == 1
            assert await kv.batch_get(["big"]) == [value]
        finally:
            await kv.aclose()

    asyncio.run(scenario())


def test_a_put_while_a_redis_fill_is_copied_in_off_the_loop_is_not_undone(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy into host memory is a new await in the Redis read: a put of the key while
    the worker copies must win over the older bytes being copied."""
    monkeypatch.setattr(kv_module, "COPY_ON_LOOP_BYTES", 0)
    old, new = data(2, 3000, seed=4)
    gate, copying = threading.Event(), threading.Event()
    fill = kv_module._fill

    def held(*args: Any) -> None:
        copying.set()
        gate.wait(30)
        fill(*args)

    async def scenario() -> None:
        kv = await with_redis(KeyValueStore(1 << 20, None, shared=False), redis_server)
        try:
            assert (await kv.batch_set(["a"], [old]))[0] == [True]
            assert kv.host.drop("a")
            monkeypatch.setattr(kv_module, "_fill", held)
            reading = asyncio.ensure_future(kv.batch_get(["a"]))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, copying.wait, 30)
            monkeypatch.setattr(kv_module, "_fill", fill)  # the put copies unheld
            assert (await kv.batch_set(["a"], [new]))[0] == [True]
            gate.set()
            assert (await reading)[0] in (old, None)
            assert await kv.batch_get(["a"]) == [new]
            kv.host.check_integrity()
            assert len(kv._changes) == 0
        finally:
            gate.set()
            await kv.aclose()

    asyncio.run(scenario())
