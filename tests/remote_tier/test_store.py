"""RedisTier against a real redis-server: round trips, batching, probes, TTL, limits,
corruption handling and namespace isolation."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import redis

from remote_tier import wire
from remote_tier.config import RemoteTierConfig
from remote_tier.errors import BadKey, ValueTooLarge
from remote_tier.keys import envelope_key
from remote_tier.mac import Mac
from remote_tier.store import RedisTier
from tierstore.testing.redis_server import RedisServer


def _key(i: int, *, prefix: str = "t", fp: str = "fp1", kind: str = "kv") -> str:
    return envelope_key(prefix, fp, f"{i:016x}", kind)


def _sync(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port)


SIZES = [1, 100, 4095, 65536, 256 << 10, 1 << 20, 4 << 20]


async def test_round_trip_bytes_identical(tier: RedisTier) -> None:
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in SIZES]
    keys = [
        _key(i, kind=k) for i, k in zip(range(len(SIZES)), ["kv", "swa", "state"] * 3, strict=False)
    ]
    assert await tier.put_many(list(zip(keys, payloads, strict=False))) == [True] * len(SIZES)
    got = await tier.get_many(keys)
    assert [g.tobytes() if g is not None else None for g in got] == payloads
    # received straight into caller buffers (numpy arrays standing in for pinned slots)
    outs = [np.zeros(n, dtype=np.uint8) for n in SIZES]
    got = await tier.get_many(keys, outs)
    for g, out, p in zip(got, outs, payloads, strict=False):
        assert g is not None and g.tobytes() == p and out.tobytes() == p
    stats = tier.stats()
    assert stats.num_hits == 2 * len(SIZES) and stats.num_misses == 0
    assert stats.bytes_in == 2 * sum(SIZES) and stats.bytes_out == sum(SIZES)


@pytest.mark.parametrize("ordered", [True, False])
async def test_one_call_moves_many_large_values_in_order(
    server: RedisServer, ordered: bool
) -> None:
    config = RemoteTierConfig(url=server.url, key_prefix="t", ordered_writes=ordered)
    payloads = [os.urandom((i % 5 + 1) * 300_000) for i in range(40)]
    keys = [_key(i) for i in range(40)]
    async with RedisTier(config) as tier:
        assert await tier.put_many(list(zip(keys, payloads, strict=True))) == [True] * 40
        for _ in range(2):  # the second read is sized by the value size learnt in the first
            got = await tier.get_many(keys)
            assert [g.tobytes() if g is not None else None for g in got] == payloads
        outs = [bytearray(len(p)) for p in payloads]
        await tier.get_many(keys, outs)
        assert [bytes(o) for o in outs] == payloads
        tier.check_integrity()


async def test_put_accepts_buffers_without_copy_semantics_leaking(tier: RedisTier) -> None:
    arr = np.arange(1000, dtype=np.float32)
    buf = bytearray(b"abc" * 10)
    assert await tier.put_many([(_key(1), arr), (_key(2), memoryview(buf)), (_key(3), b"")])
    buf[0] = ord("X")  # changing the caller's buffer after put changes nothing stored
    got = await tier.get_many([_key(1), _key(2), _key(3)])
    assert got[0] is not None and got[0].tobytes() == arr.tobytes()
    assert got[1] is not None and got[1].tobytes() == b"abc" * 10
    assert got[2] is not None and len(got[2]) == 0


async def test_batch_order_and_misses_line_up(tier: RedisTier) -> None:
    items = [(_key(i), f"value-{i}".encode()) for i in range(0, 40, 2)]
    assert all(await tier.put_many(items))
    order = list(range(40))
    np.random.default_rng(1).shuffle(order)
    got = await tier.get_many([_key(i) for i in order])
    for i, g in zip(order, got, strict=False):
        assert (g.tobytes() if g is not None else None) == (
            f"value-{i}".encode() if i % 2 == 0 else None
        )
    assert tier.stats().num_misses == 20


async def test_results_held_by_the_caller_are_never_overwritten(tier: RedisTier) -> None:
    payloads = [os.urandom(200_000) for _ in range(8)]
    keys = [_key(i) for i in range(8)]
    await tier.put_many(list(zip(keys, payloads, strict=True)))
    held = [g for _ in range(5) for g in await tier.get_many(keys[:4])]
    for _ in range(5):
        await tier.get_many(keys[4:])
    assert [h.tobytes() if h is not None else None for h in held] == payloads[:4] * 5


async def test_dropped_results_free_their_receive_buffer_at_once(tier: RedisTier) -> None:
    """Regression: a read's bookkeeping must not keep pooled buffers busy until a garbage
    collection (a reference cycle did, and every get then allocated afresh)."""
    key = envelope_key("t", "fp", "ab" * 8, "kv")
    assert await tier.put_many([(key, os.urandom(256 << 10))]) == [True]
    gc.disable()
    try:
        for _ in range(4):
            (got,) = await tier.get_many([key])
            assert got is not None
            del got
    finally:
        gc.enable()
    assert tier._buffers.num_reused == 3 and tier._buffers.num_bytes < 2 * (256 << 10)


async def test_get_into_wrong_sized_buffer_is_a_miss_not_deleted(
    tier: RedisTier, server: RedisServer
) -> None:
    await tier.put_many([(_key(1), b"x" * 100)])
    out = bytearray(99)
    assert await tier.get_many([_key(1)], [out]) == [None]
    assert tier.stats().errors["size_mismatch"] == 1
    assert _sync(server).exists(_key(1)) == 1
    with pytest.raises(ValueError, match="writable"):
        await tier.get_many([_key(1)], [b"x" * 100])
    with pytest.raises(ValueError, match="output buffers"):
        await tier.get_many([_key(1)], [])


async def test_exists_prefix_stops_at_first_miss(server: RedisServer) -> None:
    config = RemoteTierConfig(url=server.url, key_prefix="t", batch_keys=3)
    async with RedisTier(config) as tier:
        keys = [_key(i) for i in range(10)]
        assert await tier.exists_prefix(keys) == 0
        assert await tier.exists_prefix([]) == 0
        await tier.put_many([(k, b"v") for k in keys[:5] + keys[6:]])
        assert await tier.exists_prefix(keys) == 5
        assert await tier.exists_prefix(keys[6:]) == 4
        await tier.put_many([(keys[5], b"v")])
        assert await tier.exists_prefix(keys) == 10
        await tier.delete_many([keys[2], keys[7]])
        assert await tier.exists_many(keys) == [i not in (2, 7) for i in range(10)]
        assert await tier.exists_many([]) == []


async def test_ttl_is_applied(server: RedisServer) -> None:
    config = RemoteTierConfig(url=server.url, key_prefix="t", ttl_s=30.0)
    async with RedisTier(config) as tier:
        await tier.put_many([(_key(1), b"v")])
    assert 0 < _sync(server).pttl(_key(1)) <= 30_000
    async with RedisTier(RemoteTierConfig(url=server.url, key_prefix="t")) as tier:
        await tier.put_many([(_key(2), b"v")])
    assert _sync(server).pttl(_key(2)) == -1


async def test_max_value_size_raises_and_writes_nothing(server: RedisServer) -> None:
    config = RemoteTierConfig(url=server.url, key_prefix="t", max_value_bytes=4096, chunk_bytes=0)
    async with RedisTier(config) as tier:
        with pytest.raises(ValueTooLarge, match="max_value_bytes is 4096"):
            await tier.put_many([(_key(1), b"small"), (_key(2), b"x" * 4096)])
        assert _sync(server).dbsize() == 0
        limit = 4096 - wire.header_size("kv", "fp1", 4000)
        assert await tier.put_many([(_key(3), b"x" * (4000 + limit - 4000))])


async def test_misuse_raises_named_errors(tier: RedisTier) -> None:
    with pytest.raises(BadKey):
        await tier.get_many(["other:fp1:0123456789abcdef:kv"])
    with pytest.raises(BadKey):
        await tier.put_many([("t:bad key", b"v")])
    with pytest.raises(BadKey):
        await tier.exists_prefix(["nope"])


def _corruptions(mac: Mac, payload: bytes, key: str) -> dict[str, bytes]:
    key_b = key.encode()
    good = wire.encode(mac, key_b, "kv", "fp1", payload)
    size = wire.header_size("kv", "fp1", len(payload))
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    digest = wire.tag(mac, key_b, "kv", "fp1", payload)
    return {
        "garbage_header": b"\xc1\xc1" + good[2:],
        "truncated_header": good[:3],
        "truncated_payload": good[:-7],
        "extra_bytes": good + b"!",
        "bad_checksum": bytes(flipped),
        "wrong_layout_fp": wire.encode(mac, key_b, "kv", "fp2", payload),
        "wrong_kind": wire.encode(mac, key_b, "swa", "fp1", payload),
        "wrong_version": msgpack.packb([9, "kv", "fp1", len(payload), digest]) + payload,
        "empty": b"",
        "header_only": good[:size],
        "another_keys_value": wire.encode(mac, b"t:fp1:00000000000000ff:kv", "kv", "fp1",
                                          payload),
    }


@pytest.mark.parametrize("into", [False, True])
async def test_corrupt_values_are_misses_and_deleted(
    tier: RedisTier, server: RedisServer, into: bool
) -> None:
    payload = os.urandom(300_000)
    names = list(_corruptions(tier.mac, b"", _key(0)))
    keys = [_key(i) for i in range(len(names))]
    client = _sync(server)
    for key, name in zip(keys, names, strict=True):
        client.set(key, _corruptions(tier.mac, payload, key)[name])
    good_key = _key(99)
    await tier.put_many([(good_key, payload)])
    outs = [bytearray(len(payload)) for _ in range(len(keys) + 1)] if into else None
    got = await tier.get_many([*keys, good_key], outs)
    assert got[:-1] == [None] * len(names)
    assert got[-1] is not None and got[-1].tobytes() == payload
    assert sum(client.exists(k) for k in keys) == 0, "corrupt values must be deleted"
    assert client.exists(good_key) == 1
    stats = tier.stats()
    assert stats.num_corrupt_deleted == len(names)
    assert stats.errors["corrupt"] == len(names)
    assert stats.num_mac_failures == 2  # bad_checksum, another_keys_value


@pytest.mark.parametrize("size", [1000, 5 * 4096 + 3])
async def test_a_value_copied_under_another_key_is_a_miss(server: RedisServer, size: int) -> None:
    """Issue 14 (4): whole and split values, envelope and raw keys, copied byte for byte
    (every part) under another key are misses there and deleted; the original still reads."""
    config = RemoteTierConfig(url=server.url, key_prefix="t", chunk_bytes=4096)
    client = _sync(server)
    payload = os.urandom(size)
    for src, dst in [(_key(1), _key(2)), ("t:raw:a/x", "t:raw:b/x")]:
        async with RedisTier(config) as tier:
            assert await tier.put_many([(src, payload)]) == [True]
            num = wire.num_parts(size, 4096)
            for i in range(num):
                suffix = "" if i == 0 else f" #{i}"
                client.set(dst + suffix, client.get(src + suffix))
            assert await tier.get_many([dst]) == [None]
            (got,) = await tier.get_many([src])
            assert got is not None and got.tobytes() == payload
            assert client.exists(dst) == 0
            assert tier.stats().errors["corrupt"] == 1


async def test_values_in_the_old_format_are_misses(tier: RedisTier, server: RedisServer) -> None:
    old = msgpack.packb([1, "kv", "fp1", 5, bytes(8)], use_bin_type=True) + b"hello"
    _sync(server).set(_key(1), old)
    assert await tier.get_many([_key(1)]) == [None]
    assert tier.stats().errors == {"old_format": 1}
    assert _sync(server).exists(_key(1)) == 0


async def test_wrong_redis_types_are_counted_logged_and_deleted(
    tier: RedisTier, server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 14 (7): a LIST / HASH at a key of the tier was a silent miss."""
    client = _sync(server)
    client.rpush(_key(1), b"x")
    client.hset(_key(2), "f", b"v")
    client.rpush("t:raw:k", b"x")
    await tier.put_many([(_key(3), b"fine")])
    with caplog.at_level("WARNING", logger="remote_tier.stats"):
        got = await tier.get_many([_key(1), _key(2), _key(3), _key(4), "t:raw:k"])
        assert [g if g is None else g.tobytes() for g in got] == [None, None, b"fine", None, None]
        assert tier.stats().errors == {"wrongtype": 3}
        await tier.get_many([_key(1)])  # deleted: a plain miss now
    assert tier.stats().errors == {"wrongtype": 3}
    lines = [r.getMessage() for r in caplog.records if "wrongtype" in r.getMessage()]
    assert len(lines) == 2, lines  # once per key class (kv, raw), not once per key
    assert client.exists(_key(1), _key(2), "t:raw:k") == 0


async def test_prefixes_and_layouts_are_isolated(server: RedisServer) -> None:
    url = server.url
    async with (
        RedisTier(RemoteTierConfig(url=url, key_prefix="a")) as a,
        RedisTier(RemoteTierConfig(url=url, key_prefix="b")) as b,
    ):
        await a.put_many([(_key(1, prefix="a"), b"A1"), (_key(1, prefix="a", fp="fp2"), b"A2")])
        await b.put_many([(_key(1, prefix="b"), b"B1")])
        got = await a.get_many([_key(1, prefix="a"), _key(1, prefix="a", fp="fp2")])
        assert [g.tobytes() if g else None for g in got] == [b"A1", b"A2"]
        assert (await b.get_many([_key(1, prefix="b", fp="fp2")])) == [None]
        with pytest.raises(BadKey):
            await b.get_many([_key(1, prefix="a")])
        assert await a.clear(layout_fp="fp2") == 1
        assert await a.exists_prefix([_key(1, prefix="a")]) == 1
        assert await a.clear() == 1
        got_b = await b.get_many([_key(1, prefix="b")])
        assert got_b[0] is not None and got_b[0].tobytes() == b"B1"


async def test_raw_keys(tier: RedisTier) -> None:
    key = tier.raw_key("vllm@m@0@deadbeef")
    assert await tier.put_many([(key, b"engine-bytes")]) == [True]
    got = await tier.get_many([key])
    assert got[0] is not None and got[0].tobytes() == b"engine-bytes"
    assert await tier.exists_prefix([key]) == 1
    assert await tier.delete_many([key, tier.raw_key("missing")]) == 1
    assert await tier.get_many([key]) == [None]


async def test_delete_and_clear(tier: RedisTier, server: RedisServer) -> None:
    _sync(server).set("foreign", b"keep")
    keys = [_key(i) for i in range(2500)]
    await tier.put_many([(k, b"v") for k in keys])
    assert await tier.delete_many(keys[:10]) == 10
    assert await tier.clear() == 2490
    assert _sync(server).get("foreign") == b"keep"
    assert tier.stats().num_deleted == 2500


@pytest.fixture
def limited_url(server: RedisServer) -> Iterator[str]:
    """A user that may write every test key but ``_key(2)`` (its SET fails with NOPERM)."""
    client = _sync(server)
    client.acl_setuser(
        "limited",
        enabled=True,
        passwords=["+s3cret"],
        keys=["t:fp1:000000000000000[013]:kv"],
        commands=["+@all"],
    )
    try:
        yield f"redis://limited:s3cret@127.0.0.1:{server.port}/0"
    finally:
        client.acl_deluser("limited")


ITEMS = [(_key(0), b"a"), (_key(1), b"b"), (_key(2), b"c" * 300_000), (_key(3), b"d")]


async def test_ordered_put_stops_at_first_failure(limited_url: str, server: RedisServer) -> None:
    async with RedisTier(RemoteTierConfig(url=limited_url, key_prefix="t")) as tier:
        assert await tier.put_many(ITEMS) == [True, True, False, False]
        assert tier.stats().errors["server"] >= 1
    assert _sync(server).exists(_key(3)) == 0, "a child must not outlive a failed parent"


async def test_unordered_put_reports_each_item(limited_url: str, server: RedisServer) -> None:
    config = RemoteTierConfig(url=limited_url, key_prefix="t", ordered_writes=False)
    async with RedisTier(config) as tier:
        assert await tier.put_many(ITEMS) == [True, True, False, True]
    assert _sync(server).exists(_key(3)) == 1


async def test_wrong_password_is_unavailable_not_raised(server: RedisServer) -> None:
    url = f"redis://nobody:wrong@127.0.0.1:{server.port}/0"
    async with RedisTier(RemoteTierConfig(url=url, key_prefix="t")) as tier:
        assert await tier.put_many([(_key(0), b"a")]) == [False]
        assert await tier.get_many([_key(0)]) == [None]
        assert tier.stats().errors["auth"] == 2


async def test_callers_outnumbering_connections_take_turns(tier: RedisTier) -> None:
    payloads = {i: os.urandom(50_000 + i) for i in range(64)}

    async def caller(lo: int) -> None:
        items = [(_key(i), payloads[i]) for i in range(lo, lo + 8)]
        assert all(await tier.put_many(items))
        got = await tier.get_many([k for k, _ in items])
        assert [g.tobytes() if g else None for g in got] == [p for _, p in items]

    await asyncio.gather(*(caller(lo) for lo in range(0, 64, 8)))
    assert await tier.ping()


async def test_cancelled_get_into_leaves_the_tier_usable(tier: RedisTier) -> None:
    payload = os.urandom(4 << 20)
    keys = [_key(i) for i in range(16)]
    await tier.put_many([(k, payload) for k in keys])
    outs = [bytearray(len(payload)) for _ in keys]
    task = asyncio.ensure_future(tier.get_many(keys, outs))
    await asyncio.sleep(0.002)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    got = await tier.get_many(keys[:2])
    assert all(g is not None and g.tobytes() == payload for g in got)
    tier.check_integrity()


async def test_closed_tier_refuses_calls(config: RemoteTierConfig) -> None:
    tier = await RedisTier.connect(config)
    await tier.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await tier.get_many([_key(1)])
