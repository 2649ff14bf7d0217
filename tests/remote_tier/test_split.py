"""Payloads over ``chunk_bytes`` split over several Redis keys, against a real redis-server:
round trips at every boundary, the keys and TTLs written, missing / corrupt / mixed parts,
readers with another ``chunk_bytes``, ordered writes that fail midway, deletes and limits."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import redis

from remote_tier import split, wire
from remote_tier.config import RemoteTierConfig
from remote_tier.errors import ValueTooLarge
from remote_tier.keys import KeyParts, envelope_key, part_key
from remote_tier.mac import Mac
from remote_tier.store import RedisTier
from remote_tier.writes import SetBatch
from tierstore.testing.redis_server import RedisServer

C = 4096  # chunk_bytes of most tests
SIZES = [0, 100, C, C + 1, 3 * C, 3 * C + 1, 40 * C + 123]


def _key(i: int, *, fp: str = "fp1") -> str:
    return envelope_key("t", fp, f"{i:016x}", "kv")


def _parts(key: str, size: int, chunk: int = C) -> list[bytes]:
    """Every Redis key of a ``size``-byte value, head first."""
    return [part_key(key.encode(), i) for i in range(wire.num_parts(size, chunk))]


def _sync(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port)


def _config(server: RedisServer, **kwargs: object) -> RemoteTierConfig:
    base: dict[str, object] = dict(url=server.url, key_prefix="t", chunk_bytes=C)
    return RemoteTierConfig(**{**base, **kwargs})  # type: ignore[arg-type]


@pytest.fixture
async def tier(server: RedisServer) -> AsyncIterator[RedisTier]:
    async with RedisTier(_config(server)) as t:
        yield t
        t.check_integrity()


def _payloads(sizes: list[int], seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def _bytes(got: list[memoryview | None]) -> list[bytes | None]:
    return [g.tobytes() if g is not None else None for g in got]


async def test_round_trips_at_every_boundary(tier: RedisTier, server: RedisServer) -> None:
    payloads = _payloads(SIZES)
    keys = [_key(i) for i in range(len(SIZES))]
    assert await tier.put_many(list(zip(keys, payloads, strict=True))) == [True] * len(keys)
    want = {k for key, p in zip(keys, payloads, strict=True) for k in _parts(key, len(p))}
    assert set(_sync(server).keys("*")) == want
    assert len(want) == 1 + 1 + 1 + 2 + 3 + 4 + 41
    assert _bytes(await tier.get_many(keys)) == payloads
    outs = [np.zeros(n, dtype=np.uint8) for n in SIZES]
    got = await tier.get_many(keys, outs)
    assert [o.tobytes() for o in outs] == payloads
    assert all(g is not None and g.obj is o for g, o in zip(got, outs, strict=True))  # type: ignore[union-attr]
    stats = tier.stats()
    assert (stats.num_hits, stats.num_misses, stats.errors) == (2 * len(SIZES), 0, {})
    assert stats.bytes_out == sum(SIZES) and stats.bytes_in == 2 * sum(SIZES)


async def test_part_sizes_headers_and_ttl(server: RedisServer) -> None:
    async with RedisTier(_config(server, ttl_s=30.0)) as tier:
        payload = os.urandom(3 * C + 1)
        assert await tier.put_many([(_key(1), payload)]) == [True]
    client = _sync(server)
    keys = _parts(_key(1), len(payload))
    assert len(keys) == 4
    spans = [wire.part_span(len(payload), 4, i) for i in range(4)]
    assert [hi - lo for lo, hi in spans] == [3073, 3073, 3073, 3070]  # ceil(T / n), remainder
    for i, key in enumerate(keys):
        value = memoryview(client.get(key))
        header, size = wire.read_header(value)
        digest = wire.tag(tier.mac, _key(1).encode(), "kv", "fp1", payload, 4)
        version = wire.SPLIT_FORMAT_VERSION
        assert header == wire.Header(version, "kv", "fp1", len(payload), digest, i, 4)
        assert size == wire.part_header_size("kv", "fp1", len(payload), i, 4)
        assert value[size:].tobytes() == payload[spans[i][0] : spans[i][1]]
        assert 0 < client.pttl(key) <= 30_000


def test_parts_reference_the_payload_never_copy_it() -> None:
    payload = bytearray(os.urandom(3 * C + 1))
    config = RemoteTierConfig(key_prefix="t", chunk_bytes=C)
    batch = SetBatch(())
    mac = Mac(b"split-test-secret-" * 2)
    batch.add(split.values_of(_key(1), KeyParts("kv", "fp1"), memoryview(payload), config, mac))
    assert batch.keys_b == _parts(_key(1), len(payload))[1:] + [_key(1).encode()]
    assert batch.heads == [3] and batch.payload_sizes == [len(payload)]
    for command in batch.commands:
        _, _, (header, body) = command
        assert isinstance(body, memoryview) and body.obj is payload
        assert len(header) + len(body) <= config.max_value_bytes


async def test_raw_key_values_split_too(tier: RedisTier) -> None:
    key = tier.raw_key("engine@chunk@0")
    payload = os.urandom(5 * C)
    assert await tier.put_many([(key, payload)]) == [True]
    assert _bytes(await tier.get_many([key])) == [payload]
    assert await tier.delete_many([key]) == 1
    assert await tier.get_many([key]) == [None]


@pytest.mark.parametrize("into", [False, True])
async def test_missing_part_is_a_miss_and_cleaned(
    tier: RedisTier, server: RedisServer, into: bool
) -> None:
    payloads = _payloads([5 * C, 5 * C])
    keys = [_key(1), _key(2)]
    await tier.put_many(list(zip(keys, payloads, strict=True)))
    client = _sync(server)
    client.delete(_parts(keys[0], 5 * C)[3])
    outs = [bytearray(5 * C) for _ in keys] if into else None
    assert _bytes(await tier.get_many(keys, outs)) == [None, payloads[1]]
    assert sum(client.exists(k) for k in _parts(keys[0], 5 * C)) == 0, "head and parts go"
    assert client.exists(*_parts(keys[1], 5 * C)) == 5
    stats = tier.stats()
    assert stats.errors == {"incomplete": 1} and stats.num_corrupt_deleted == 0


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("where", ["payload", "header", "truncated", "head_garbage"])
async def test_corrupt_part_is_a_miss_and_deleted(
    tier: RedisTier, server: RedisServer, into: bool, where: str
) -> None:
    payload = os.urandom(4 * C)
    await tier.put_many([(_key(1), payload)])
    client = _sync(server)
    keys = _parts(_key(1), len(payload))
    target = keys[0] if where == "head_garbage" else keys[2]
    value = bytearray(client.get(target))
    if where == "payload":
        value[-5] ^= 0xFF
    elif where == "header":
        value[3] ^= 0x01  # a byte of the kind string
    elif where == "truncated":
        del value[-1]
    else:
        value[0] = 0xC1  # never valid msgpack
    client.set(target, bytes(value))
    outs = [bytearray(len(payload))] if into else None
    assert await tier.get_many([_key(1)], outs) == [None]
    left = sum(client.exists(k) for k in keys)
    # a garbled head tells nothing of its parts: only a reader expecting them removes them
    assert left == (3 if where == "head_garbage" and not into else 0)
    stats = tier.stats()
    assert stats.errors == {"corrupt": 1} and stats.num_corrupt_deleted == 1


@pytest.mark.parametrize("into", [False, True])
async def test_parts_of_two_writes_are_never_mixed(
    tier: RedisTier, server: RedisServer, into: bool
) -> None:
    size = 3 * C + 7
    a, b = _payloads([size, size], seed=5)
    client = _sync(server)
    keys = _parts(_key(1), size)
    await tier.put_many([(_key(1), a)])
    part_of_a = client.get(keys[1])
    await tier.put_many([(_key(1), b)])
    client.set(keys[1], part_of_a)  # right size, right index, another write's checksum
    outs = [bytearray(size)] if into else None
    assert await tier.get_many([_key(1)], outs) == [None]
    assert sum(client.exists(k) for k in keys) == 0
    assert tier.stats().errors == {"corrupt": 1}


@pytest.mark.parametrize(
    ("writer", "reader"), [(C, 2 * C), (2 * C, C), (0, C), (C, 0), (C, 3 * C + 5000)]
)
async def test_reader_with_another_chunk_size(
    server: RedisServer, writer: int, reader: int
) -> None:
    sizes = [C - 1, C + 1, 2 * C, 2 * C + 1, 7 * C + 3]
    payloads = _payloads(sizes, seed=writer + reader)
    keys = [_key(i) for i in range(len(sizes))]
    async with RedisTier(_config(server, chunk_bytes=writer)) as w:
        assert all(await w.put_many(list(zip(keys, payloads, strict=True))))
    async with RedisTier(_config(server, chunk_bytes=reader)) as r:
        for _ in range(2):
            assert _bytes(await r.get_many(keys)) == payloads
            outs = [bytearray(n) for n in sizes]
            assert _bytes(await r.get_many(keys, outs)) == payloads
            assert [bytes(o) for o in outs] == payloads
        assert r.stats().errors == {} and r.stats().num_hits == 4 * len(keys)
        r.check_integrity()


async def test_split_value_into_a_wrong_sized_buffer(tier: RedisTier, server: RedisServer) -> None:
    payload = os.urandom(3 * C)
    await tier.put_many([(_key(1), payload)])
    for size in (3 * C - 1, 3 * C + 1, 100):
        assert await tier.get_many([_key(1)], [bytearray(size)]) == [None]
    assert tier.stats().errors == {"size_mismatch": 3}
    assert _sync(server).exists(*_parts(_key(1), 3 * C)) == 3


async def test_round_trips_per_read(tier: RedisTier) -> None:
    """A reader with the writer's chunk size reads into ``out`` in one batch; without
    ``out`` the parts after the heads take one more."""
    payloads = _payloads([3 * C, 50, 9 * C])
    keys = [_key(i) for i in range(3)]
    await tier.put_many(list(zip(keys, payloads, strict=True)))
    router = tier._router
    calls: list[int] = []
    real = router.mget

    async def counted(keys_b: list[bytes], sinks: list) -> list:  # type: ignore[type-arg]
        calls.append(len(keys_b))
        return await real(keys_b, sinks)

    router.mget = counted  # type: ignore[method-assign]
    await tier.get_many(keys, [bytearray(len(p)) for p in payloads])
    assert calls == [3 + 2 + 8]
    calls.clear()
    assert _bytes(await tier.get_many(keys)) == payloads
    assert calls == [3, 2 + 8]


async def test_delete_many_and_clear_remove_parts(tier: RedisTier, server: RedisServer) -> None:
    client = _sync(server)
    client.set("foreign", b"keep")
    payloads = _payloads([5 * C, 10, 2 * C + 1, 3 * C])
    keys = [_key(0), _key(1), _key(2), _key(3, fp="fp2")]
    await tier.put_many(list(zip(keys, payloads, strict=True)))
    assert await tier.delete_many([keys[0], keys[1], _key(99)]) == 2
    assert set(client.keys("t:*")) == {*_parts(keys[2], 2 * C + 1), *_parts(keys[3], 3 * C)}
    client.delete(keys[2])  # parts left without a head are deleted but not counted
    assert await tier.clear(layout_fp="fp2") == 1
    assert await tier.clear() == 0
    assert client.keys("*") == [b"foreign"]
    assert tier.stats().num_deleted == 3


async def test_exists_sees_only_complete_values(tier: RedisTier, server: RedisServer) -> None:
    keys = [_key(i) for i in range(3)]
    await tier.put_many([(k, os.urandom(3 * C)) for k in keys])
    _sync(server).delete(keys[1])  # as if the head was not written yet
    assert await tier.exists_prefix(keys) == 1
    assert await tier.exists_many(keys) == [True, False, True]


async def test_too_large_values_raise_before_any_write(server: RedisServer) -> None:
    async with RedisTier(_config(server, chunk_bytes=0, max_value_bytes=8192)) as tier:
        with pytest.raises(ValueTooLarge, match="max_value_bytes is 8192"):
            await tier.put_many([(_key(1), b"small"), (_key(2), bytes(8192))])
    async with RedisTier(_config(server)) as tier:
        with pytest.raises(ValueTooLarge, match="4097 parts"):
            await tier.put_many([(_key(1), b"small"), (_key(2), bytes(4096 * C + 1))])
        assert await tier.put_many([(_key(3), bytes(4096 * C))]) == [True]
    assert _sync(server).exists(_key(1), _key(2)) == 0


@pytest.fixture
def limited_url(server: RedisServer) -> Iterator[str]:
    """A user that may write every key of items 0, 1, 3 and 4, and item 2's parts but not its
    head (so they land and must be taken back)."""
    client = _sync(server)
    client.acl_setuser(
        "limited",
        enabled=True,
        passwords=["+s3cret"],
        keys=["t:fp1:000000000000000[0134]:kv*", "t:fp1:0000000000000002:kv?#*"],
        commands=["+@all"],
    )
    try:
        yield f"redis://limited:s3cret@127.0.0.1:{server.port}/0"
    finally:
        client.acl_deluser("limited")


@pytest.mark.parametrize("ordered", [True, False])
async def test_failed_item_leaves_no_head_and_no_parts(
    limited_url: str, server: RedisServer, ordered: bool
) -> None:
    payloads = _payloads([3 * C, 10, 3 * C, 3 * C, 20])
    keys = [_key(i) for i in range(5)]
    config = RemoteTierConfig(url=limited_url, key_prefix="t", chunk_bytes=C)
    async with RedisTier(config if ordered else _unordered(config)) as tier:
        ok = await tier.put_many(list(zip(keys, payloads, strict=True)))
        assert tier.stats().errors["server"] >= 1
    written = [0, 1] if ordered else [0, 1, 3, 4]
    assert ok == [i in written for i in range(5)]
    want = {k for i in written for k in _parts(keys[i], len(payloads[i]))}
    assert set(_sync(server).keys("*")) == want, "no head or part of a failed item is left"


def _unordered(config: RemoteTierConfig) -> RemoteTierConfig:
    return RemoteTierConfig(**{**config.__dict__, "ordered_writes": False})


@pytest.mark.parametrize("ordered", [True, False])
async def test_out_of_memory_midway_leaves_no_orphans(server: RedisServer, ordered: bool) -> None:
    client = _sync(server)
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 600_000)
    payloads = _payloads([16 * C + i for i in range(40)])
    keys = [_key(i) for i in range(40)]
    async with RedisTier(_config(server, pipeline_bytes=C, ordered_writes=ordered)) as tier:
        ok = await tier.put_many(list(zip(keys, payloads, strict=True)))
        assert sum(ok) < 40
        if ordered:  # unordered, every item's parts compete for the memory left
            assert sum(ok) > 0 and ok == sorted(ok, reverse=True), "a prefix, then nothing"
        assert tier.stats().errors["server"] >= 1
        good = [i for i in range(40) if ok[i]]
        want = {k for i in good for k in _parts(keys[i], len(payloads[i]))}
        assert set(client.keys("*")) == want
        client.config_set("maxmemory", 0)
        got = await tier.get_many(keys)
        assert _bytes(got) == [p if ok[i] else None for i, p in enumerate(payloads)]
