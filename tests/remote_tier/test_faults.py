"""A Redis that dies, hangs or comes back: misses and counters, never exceptions; the breaker
makes a dead server cheap; the tier recovers on its own."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest

from remote_tier.config import RemoteTierConfig
from remote_tier.keys import envelope_key
from remote_tier.store import RedisTier
from tierstore.testing.redis_server import RedisServer


class FakeClock:
    """A monotonic clock for the breakers that only moves when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _key(i: int) -> str:
    return envelope_key("f", "fp", f"{i:016x}", "kv")


@pytest.fixture
def own_server(redis_bin: str) -> Iterator[RedisServer]:
    """A server this test may kill."""
    with RedisServer() as server:
        yield server


def _config(server: RedisServer, **kwargs: object) -> RemoteTierConfig:
    base: dict[str, object] = dict(
        url=server.url,
        key_prefix="f",
        op_timeout_s=0.5,
        breaker_failures=2,
        breaker_cooldown_s=1.0,
        breaker_max_cooldown_s=8.0,
    )
    return RemoteTierConfig(**{**base, **kwargs})  # type: ignore[arg-type]


async def test_killed_server_means_misses_then_open_breaker_then_recovery(
    own_server: RedisServer, clock: FakeClock
) -> None:
    async with RedisTier(_config(own_server), clock=clock) as tier:
        assert await tier.put_many([(_key(1), b"one")]) == [True]
        address = f"127.0.0.1:{own_server.port}"

        own_server.kill()
        assert await tier.get_many([_key(1), _key(2)]) == [None, None]
        assert await tier.put_many([(_key(3), b"x")]) == [False]
        stats = tier.stats()
        assert stats.errors["connection"] == 2
        assert stats.breakers[address] == "open"

        # open: no I/O at all, so a call costs microseconds (asserted loosely: CI is noisy)
        start = time.perf_counter()
        for _ in range(100):
            assert await tier.get_many([_key(1)]) == [None]
        per_call = (time.perf_counter() - start) / 100
        assert per_call < 0.05, f"{per_call * 1e6:.0f} us per call with the breaker open"
        assert await tier.exists_prefix([_key(1)]) == 0
        assert tier.stats().errors["circuit_open"] >= 101

        # cooldown over but still down: the probe fails and the cooldown doubles
        clock.advance(1.0)
        assert tier.stats().breakers[address] == "half_open"
        assert await tier.get_many([_key(1)]) == [None]
        assert tier.stats().breakers[address] == "open"
        clock.advance(1.5)
        assert tier.stats().breakers[address] == "open"

        own_server.start()  # same port, empty
        clock.advance(0.5)
        assert await tier.get_many([_key(1)]) == [None]  # the probe succeeds: a plain miss
        assert tier.stats().breakers[address] == "closed"
        assert await tier.put_many([(_key(1), b"back")]) == [True]
        got = await tier.get_many([_key(1)])
        assert got[0] is not None and got[0].tobytes() == b"back"
        tier.check_integrity()


@pytest.mark.parametrize("chunk", [16 << 20, 64 << 10])
async def test_kill_during_large_transfers_never_returns_wrong_bytes(
    own_server: RedisServer, chunk: int
) -> None:
    payloads = [os.urandom(1 << 20) for _ in range(48)]
    keys = [_key(i) for i in range(48)]
    async with RedisTier(_config(own_server, chunk_bytes=chunk)) as tier:
        assert all(await tier.put_many(list(zip(keys, payloads, strict=False))))
        outs = [bytearray(1 << 20) for _ in keys]
        gets = [
            asyncio.ensure_future(tier.get_many(keys, outs if i % 2 else None)) for i in range(4)
        ]
        puts = asyncio.ensure_future(
            tier.put_many([(_key(100 + i), p) for i, p in enumerate(payloads)])
        )
        await asyncio.sleep(0.005)
        own_server.kill()
        for task in gets:
            for got, want in zip(await task, payloads, strict=False):
                assert got is None or got.tobytes() == want
        ok = await puts
        assert ok == sorted(ok, reverse=True), "ordered puts: a prefix succeeded, then nothing"
        errors = tier.stats().errors
        assert errors["connection"] + errors.get("circuit_open", 0) >= 1


async def test_hung_server_times_out_as_a_miss(own_server: RedisServer) -> None:
    config = _config(own_server, op_timeout_s=0.2)
    async with RedisTier(config) as tier:
        await tier.put_many([(_key(1), b"v")])
        own_server.pause()
        try:
            start = time.perf_counter()
            assert await tier.get_many([_key(1)]) == [None]
            elapsed = time.perf_counter() - start
            assert 0.15 < elapsed < 2.0
            assert tier.stats().errors["timeout"] == 1
        finally:
            own_server.resume()
        got = await tier.get_many([_key(1)])
        assert got[0] is not None and got[0].tobytes() == b"v"


async def test_server_down_at_start(redis_bin: str, clock: FakeClock) -> None:
    server = RedisServer()  # never started: nothing listens on its port
    try:
        async with RedisTier(_config(server), clock=clock) as tier:
            assert await tier.get_many([_key(1)]) == [None]
            assert await tier.put_many([(_key(1), b"v")]) == [False]
            assert not await tier.ping()
            server.start()
            clock.advance(60)
            assert await tier.ping()
            assert await tier.put_many([(_key(1), b"v")]) == [True]
    finally:
        server.close()
