"""The L3 MAC: tags, secrets and key files, and a real server's forged or foreign values
(never served: misses, deleted and counted)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import blake3
import msgpack
import numpy as np
import pytest
import redis

from remote_tier import wire
from remote_tier.config import RemoteTierConfig
from remote_tier.errors import ValueTooLarge
from remote_tier.keys import envelope_key
from remote_tier.mac import (
    MIN_SECRET_BYTES,
    TAG_BYTES,
    Mac,
    MacKeyError,
    load_secret_file,
    user_key_file,
    user_secret,
)
from remote_tier.store import RedisTier
from tierstore import settings
from tierstore.testing.l3_forger import foreign_value, old_checksum_value
from tierstore.testing.redis_server import RedisServer

SECRET = b"test-deployment-secret-0123456789abcdef"


def _key(i: int) -> str:
    return envelope_key("t", "fp1", f"{i:016x}", "kv")


def _key_file(path: Path, content: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(content)
    path.chmod(mode)
    return path


# -- tags ---------------------------------------------------------------------------------------


def test_tags_depend_on_the_secret_key_header_and_body() -> None:
    mac = Mac(SECRET)
    tag = mac.sign(b"k", b"h", b"body")
    assert len(tag) == TAG_BYTES and tag == Mac(SECRET).sign(b"k", b"h", b"body")
    others = {
        Mac(SECRET + b"!").sign(b"k", b"h", b"body"),
        mac.sign(b"K", b"h", b"body"),
        mac.sign(b"k", b"H", b"body"),
        mac.sign(b"k", b"h", b"bodY"),
        mac.sign(b"kh", b"", b"body"),  # bytes moved between fields
    }
    assert tag not in others and len(others) == 5
    assert mac.verify(b"k", b"h", b"body", tag)
    assert not mac.verify(b"k", b"h", b"body", bytes(TAG_BYTES))


def test_the_key_is_derived_never_the_raw_secret() -> None:
    raw = blake3.blake3(key=SECRET[:32])
    raw.update(b"body")
    assert Mac(SECRET).sign(b"", b"", b"body") != raw.digest(TAG_BYTES)
    assert SECRET.hex() not in repr(Mac(SECRET)) and "hidden" in repr(Mac(SECRET))


def test_any_buffer_is_hashed_in_place() -> None:
    arr = np.arange(1 << 16, dtype=np.uint32)
    mac = Mac(SECRET)
    assert mac.sign(b"k", b"h", arr) == mac.sign(b"k", b"h", arr.tobytes())
    assert mac.sign(b"k", b"h", memoryview(arr)) == mac.sign(b"k", b"h", bytearray(arr))


def test_short_secrets_are_refused() -> None:
    with pytest.raises(MacKeyError, match=f"at least {MIN_SECRET_BYTES}"):
        Mac(b"x" * (MIN_SECRET_BYTES - 1))
    with pytest.raises(ValueError, match="at least"):
        RemoteTierConfig(mac_key=b"short")
    config = RemoteTierConfig(mac_key=SECRET)
    assert SECRET.decode() not in repr(config) and "mac_key" not in repr(config)


# -- key files ----------------------------------------------------------------------------------


def test_a_key_file_is_read_with_trailing_newlines_stripped(tmp_path: Path) -> None:
    path = _key_file(tmp_path / "mac.key", SECRET + b"\n")
    assert load_secret_file(path) == SECRET


@pytest.mark.parametrize(
    ("content", "mode", "reason"),
    [
        (SECRET, 0o644, r"open to group/others \(mode 0644\); run `chmod 600"),
        (SECRET, 0o640, "open to group/others"),
        (SECRET, 0o602, "open to group/others"),
        (b"too short\n", 0o600, f"at least {MIN_SECRET_BYTES}"),
        (b"", 0o400, "is 0 bytes"),
    ],
)
def test_bad_key_files_are_refused_clearly(
    tmp_path: Path, content: bytes, mode: int, reason: str
) -> None:
    path = _key_file(tmp_path / "mac.key", content, mode)
    with pytest.raises(MacKeyError, match=reason) as err:
        load_secret_file(path)
    assert str(path) in str(err.value)
    assert content[:8].decode() not in str(err.value) or not content  # the secret is not shown


def test_missing_or_odd_key_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(MacKeyError, match=r"cannot open .*No such file"):
        load_secret_file(tmp_path / "absent.key")
    (tmp_path / "dir.key").mkdir(mode=0o700)
    with pytest.raises(MacKeyError, match="not a regular file"):
        load_secret_file(tmp_path / "dir.key")


def test_the_user_key_file_is_created_private_once_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = user_key_file(tmp_path / "config")
    assert path == tmp_path / "config" / "tierstore" / "mac.key"
    with caplog.at_level(logging.INFO, logger="remote_tier.mac"):
        first = user_secret(path)
        assert user_secret(path) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(first) == 64 and bytes.fromhex(first.decode())
    lines = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(lines) == 1 and "created now" in lines[0] and first.decode() not in lines[0]
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_settings_pick_flag_then_env_file_then_env_key_then_user_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = _key_file(tmp_path / "flag.key", b"f" * 32)
    env_file = _key_file(tmp_path / "env.key", b"e" * 32)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TIERSTORE_MAC_KEY_FILE", str(env_file))
    monkeypatch.setenv("TIERSTORE_MAC_KEY", "k" * 32)
    assert settings.mac_secret(str(flag)) == b"f" * 32
    assert settings.mac_secret() == b"e" * 32
    monkeypatch.delenv("TIERSTORE_MAC_KEY_FILE")
    assert settings.mac_secret() == b"k" * 32
    assert "k" * 32 not in repr(settings.environment())
    monkeypatch.setenv("TIERSTORE_MAC_KEY", "short")
    with pytest.raises(MacKeyError, match=r"TIERSTORE_MAC_KEY: .*at least 32"):
        settings.mac_secret()
    monkeypatch.delenv("TIERSTORE_MAC_KEY")
    assert settings.mac_secret() == (tmp_path / "xdg/tierstore/mac.key").read_bytes().strip()
    env_file.chmod(0o644)
    monkeypatch.setenv("TIERSTORE_MAC_KEY_FILE", str(env_file))
    with pytest.raises(MacKeyError, match="group/others"):
        settings.mac_secret()


# -- a real server ------------------------------------------------------------------------------

# small (tag checked on the loop), over the hashing threads' threshold, split in two parts
SIZES = [100, 300_000, (1 << 20) + 5000]


def _config(server: RedisServer, secret: bytes) -> RemoteTierConfig:
    return RemoteTierConfig(url=server.url, key_prefix="t", chunk_bytes=1 << 20, mac_key=secret)


def _sync(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port)


@pytest.mark.parametrize("into", [False, True])
async def test_same_key_file_shares_values_another_key_misses(
    server: RedisServer, tmp_path: Path, into: bool
) -> None:
    shared = load_secret_file(_key_file(tmp_path / "a.key", os.urandom(32).hex().encode()))
    other = load_secret_file(_key_file(tmp_path / "b.key", os.urandom(32).hex().encode()))
    payloads = [os.urandom(n) for n in SIZES]
    keys = [_key(i) for i in range(len(SIZES))]
    outs = [bytearray(n) for n in SIZES] if into else None
    async with RedisTier(_config(server, shared)) as writer:
        assert await writer.put_many(list(zip(keys, payloads, strict=True))) == [True] * 3
    async with RedisTier(_config(server, shared)) as reader:
        got = await reader.get_many(keys, outs)
        assert [g.tobytes() if g is not None else None for g in got] == payloads
    async with RedisTier(_config(server, other)) as stranger:
        assert await stranger.get_many(keys, outs) == [None] * 3
        stats = stranger.stats()
        assert stats.num_mac_failures == 3 and stats.errors == {"corrupt": 3}
        assert stats.num_corrupt_deleted == 3 and stats.num_hits == 0
    assert _sync(server).dbsize() == 0, "values that fail the MAC are deleted, with every part"


@pytest.mark.parametrize("forge", [old_checksum_value, foreign_value])
@pytest.mark.parametrize("into", [False, True])
async def test_forged_values_are_never_served(
    server: RedisServer, forge: object, into: bool
) -> None:
    """Issue 19 (1): a Redis writer without the secret overwrites real values with forged
    bytes that carry a correct unkeyed checksum (format 3) or a tag of its own secret."""
    assert callable(forge)
    payloads = [os.urandom(n) for n in SIZES[:2]]
    keys = [_key(i) for i in range(2)]
    client = _sync(server)
    async with RedisTier(_config(server, SECRET)) as tier:
        assert await tier.put_many(list(zip(keys, payloads, strict=True))) == [True, True]
        for key, payload in zip(keys, payloads, strict=True):
            client.set(key, forge(key, bytes(len(payload))))  # zeros instead of the payload
        outs = [bytearray(len(p)) for p in payloads] if into else None
        assert await tier.get_many(keys, outs) == [None, None]
        stats = tier.stats()
    assert client.exists(*keys) == 0
    assert stats.num_corrupt_deleted == 2 and stats.num_hits == 0
    if forge is old_checksum_value:
        assert stats.errors == {"old_format": 2} and stats.num_mac_failures == 0
    else:
        assert stats.errors == {"corrupt": 2} and stats.num_mac_failures == 2


async def test_a_real_header_on_other_bytes_fails_the_mac(server: RedisServer) -> None:
    payload = os.urandom(300_000)
    client = _sync(server)
    async with RedisTier(_config(server, SECRET)) as tier:
        await tier.put_many([(_key(1), payload)])
        value = client.get(_key(1))
        size = wire.header_size("kv", "fp1", len(payload))
        client.set(_key(1), value[:size] + bytes(len(payload)))
        assert await tier.get_many([_key(1)]) == [None]
        assert tier.stats().num_mac_failures == 1 and client.exists(_key(1)) == 0


async def test_a_value_too_large_raises_from_the_hashing_threads(server: RedisServer) -> None:
    config = RemoteTierConfig(url=server.url, key_prefix="t", max_value_bytes=1 << 18,
                              chunk_bytes=0, mac_key=SECRET)
    async with RedisTier(config) as tier:
        with pytest.raises(ValueTooLarge, match="max_value_bytes is 262144"):
            await tier.put_many([(_key(1), b"small"), (_key(2), os.urandom(300_000))])
    assert _sync(server).dbsize() == 0


async def test_an_old_split_value_goes_with_all_its_parts(server: RedisServer) -> None:
    """A format-4 split value (unkeyed checksum) is a miss; its head and parts are deleted."""
    client = _sync(server)
    key = _key(1)
    for i in range(3):
        header = msgpack.packb([4, "kv", "fp1", 3000, bytes(8), i, 3], use_bin_type=True)
        client.set(key if i == 0 else f"{key} #{i}", header + bytes(1000))
    async with RedisTier(_config(server, SECRET)) as tier:
        assert await tier.get_many([key]) == [None]
        assert tier.stats().errors == {"old_format": 1}
    assert client.dbsize() == 0
