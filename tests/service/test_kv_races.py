"""The storage API's Redis fill path against puts and deletes of the same key: a read whose
Redis answer is older than a change must not publish those bytes into host memory (undoing a
put, or bringing a deleted key back). A real valkey-server on loopback; the Redis calls are
held (not faked) to fix the interleaving."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest

from remote_tier import RedisTier, RemoteTierConfig
from tierstore.service.kv import KeyValueStore
from tierstore.testing.redis_server import RedisServer

SECRET = b"kv-races-test-deployment-secret-0123456789"


def data(n: int, size: int, seed: int) -> list[bytes]:
    g = np.random.default_rng(seed)
    return [g.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


async def store(redis_server: RedisServer) -> KeyValueStore:
    """A store with host memory and Redis (its own key prefix: tests share the server)."""
    kv = KeyValueStore(1 << 20, None, shared=False)
    kv.remote = await RedisTier.connect(RemoteTierConfig(
        url=redis_server.url, key_prefix=f"race{secrets.token_hex(4)}", mac_key=SECRET))
    return kv


def held_after(fn: Callable[..., Awaitable[Any]], entered: asyncio.Event,
               gate: asyncio.Event) -> Callable[..., Awaitable[Any]]:
    """``fn`` whose answer, once Redis gave it, waits for ``gate`` (Redis answered before the
    change; the caller sees it after)."""
    async def held(*args: Any) -> Any:
        got = await fn(*args)
        entered.set()
        await gate.wait()
        return got
    return held


@pytest.mark.parametrize("change", ["put", "delete"])
def test_a_put_or_delete_during_a_redis_read_is_not_undone_by_it(
        redis_server: RedisServer, change: str) -> None:
    """A read that got the old value from Redis, then saw a put (or delete) of the key run to
    the end before it went on, must not put the old value back into host memory."""
    old, new = data(2, 3000, seed=1)

    async def scenario() -> None:
        kv = await store(redis_server)
        try:
            assert kv.remote is not None
            assert (await kv.batch_set(["a"], [old]))[0] == [True]
            assert kv.host.drop("a")  # only Redis has it now
            entered, gate = asyncio.Event(), asyncio.Event()
            slow = kv.remote.get_many
            kv.remote.get_many = held_after(  # type: ignore[method-assign,assignment]
                slow, entered, gate)
            reading = asyncio.ensure_future(kv.batch_get(["a"]))
            await entered.wait()
            if change == "put":
                assert (await kv.batch_set(["a"], [new]))[0] == [True]
            else:
                assert await kv.delete(["a"]) == 1
            gate.set()
            assert (await reading)[0] in (old, None)  # as of before the change, or a miss
            kv.remote.get_many = slow  # type: ignore[method-assign]
            want = new if change == "put" else None
            assert await kv.batch_get(["a"]) == [want]
            kv.host.drop("a")
            assert await kv.batch_get(["a"]) == [want]  # and Redis agrees
            kv.host.check_integrity()
            kv._changes.check_integrity()
            assert len(kv._changes) == 0
        finally:
            gate.set()
            await kv.aclose()

    asyncio.run(scenario())


def test_a_redis_read_during_a_delete_in_flight_does_not_resurrect_the_key(
        redis_server: RedisServer) -> None:
    """A read that begins while a delete is dropping the key from Redis (host memory already
    dropped it) gets the old value from Redis, and must not publish it: the delete lands
    after, and host memory would keep serving a deleted key."""
    (old,) = data(1, 3000, seed=2)

    async def scenario() -> None:
        kv = await store(redis_server)
        gate, entered = asyncio.Event(), asyncio.Event()
        try:
            assert kv.remote is not None
            assert (await kv.batch_set(["a"], [old]))[0] == [True]
            slow_delete = kv.remote.delete_many

            async def held_delete(keys: Sequence[str]) -> int:
                entered.set()
                await gate.wait()
                return await slow_delete(keys)

            kv.remote.delete_many = held_delete  # type: ignore[method-assign]
            deleting = asyncio.ensure_future(kv.delete(["a"]))
            await entered.wait()
            assert "a" not in kv.host
            assert (await kv.batch_get(["a"]))[0] in (old, None)  # Redis still has it
            gate.set()
            assert await deleting == 1
            assert await kv.batch_get(["a"]) == [None]
            kv.host.check_integrity()
            assert len(kv._changes) == 0
        finally:
            gate.set()
            await kv.aclose()

    asyncio.run(scenario())


def test_a_redis_read_of_an_unchanged_key_still_fills_host_memory(
        redis_server: RedisServer) -> None:
    """The guard does not cost hits: a Redis read with no change of its keys publishes them,
    and a later read hits host memory."""
    values = data(3, 3000, seed=3)

    async def scenario() -> None:
        kv = await store(redis_server)
        try:
            keys = ["x", "y", "z"]
            assert (await kv.batch_set(keys, values))[0] == [True] * 3
            for k in keys:
                assert kv.host.drop(k)
            assert await kv.batch_get(keys) == values
            assert kv.hits["redis"] == 3
            assert await kv.batch_get(keys) == values
            assert kv.hits["host"] == 3
        finally:
            await kv.aclose()

    asyncio.run(scenario())
