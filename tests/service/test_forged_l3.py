"""Issue 19 (1): whoever can write to the L3 Valkey but lacks the deployment's MAC secret
cannot make the service serve their bytes — through the storage API or the prefix path —
and ``tierstore serve`` refuses a bad key file before it starts anything."""

from __future__ import annotations

import argparse
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis
import torch

from remote_tier import RemoteTierConfig
from tierstore.client import Client
from tierstore.config import StoreConfig
from tierstore.service import server
from tierstore.service.config import ServiceConfig
from tierstore.store import TierStore
from tierstore.testing.l3_forger import foreign_value, old_checksum_value
from tierstore.testing.redis_server import RedisServer
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

LAYOUT = tiny_layout(page_size=4)
UNITS = {k: e.nbytes for k, e in LAYOUT.envelopes().items()}
ONE = 4 * UNITS["kv"] + 2 * UNITS["swa"] + UNITS["state"]  # bytes one 16-token prefix holds
SECRET = b"forged-l3-test-deployment-secret-0123456789"
FORGERS = [old_checksum_value, foreign_value]
Forger = Callable[[str, bytes], bytes]


@pytest.fixture
def svc(redis_server: RedisServer) -> Iterator[RunningService]:
    """L1 holds one prefix (no L2: the next one pushes it to L3); the storage API's host copy
    holds 4 KiB (larger values live in L3 only)."""
    redis_server.command("FLUSHALL")
    remote = RemoteTierConfig(url=redis_server.url, key_prefix="ts", mac_key=SECRET)
    store = TierStore(LAYOUT, StoreConfig(capacity_bytes=ONE + 512, remote=remote))
    config = ServiceConfig(port=free_port(), max_body_bytes=4 << 20, kv_host_bytes=4096)
    kv_remote = RemoteTierConfig(url=redis_server.url, key_prefix="tskv", mac_key=SECRET)
    with RunningService(store, config, kv_remote) as running:
        yield running


def _valkey(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port)


def _keys(client: redis.Redis, pattern: str, *, at_least: int = 1) -> list[str]:
    deadline = time.monotonic() + 5
    while len(keys := sorted(k.decode() for k in client.keys(pattern))) < at_least:
        assert time.monotonic() < deadline, f"no {pattern} keys in Valkey"
        time.sleep(0.02)
    return keys


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as reply:
        return str(reply.read().decode())


@pytest.mark.parametrize("forge", FORGERS)
def test_storage_api_never_serves_a_forged_value(
    svc: RunningService, redis_server: RedisServer, forge: Forger
) -> None:
    value = bytes(range(256)) * 36  # 9 KiB: over the host copy, so Valkey holds it alone
    forged = b"\xee" * len(value)
    valkey = _valkey(redis_server)
    with Client(svc.url, retries=0) as client:
        assert client.batch_set(["page-0"], [value]) == [True]
        (key,) = _keys(valkey, "tskv:raw:*")
        valkey.set(key, forge(key, forged))
        assert client.batch_get(["page-0"]) == [None]
        assert valkey.exists(key) == 0, "a value that fails its check is deleted"
        stats = svc.service.kv.remote.stats()  # type: ignore[union-attr]
        assert stats.num_corrupt_deleted == 1 and stats.num_hits == 0
        kind = "old_format" if forge is old_checksum_value else "corrupt"
        assert stats.errors == {kind: 1}
        assert stats.num_mac_failures == (kind == "corrupt")
        assert f'tierstore_redis_errors_total{{kind="{kind}"}} 1.0' in _metrics(svc.url)
        assert client.batch_set(["page-0"], [value]) == [True]  # written again: served again
        assert client.batch_get(["page-0"]) == [value]


def _envelopes(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)

    def blobs(kind: str, n: int) -> list[bytes]:
        return [torch.randint(0, 256, (UNITS[kind],), dtype=torch.uint8, generator=g)
                .numpy().tobytes() for _ in range(n)]

    return {"kv": blobs("kv", 4), "swa": blobs("swa", 2), "state": blobs("state", 1)[0]}


def _prompt(i: int) -> list[int]:
    return list(range(1000 * i, 1000 * i + 16))


@pytest.mark.parametrize("forge", FORGERS)
def test_prefix_path_never_serves_a_forged_kv_page(
    svc: RunningService, redis_server: RedisServer, forge: Forger
) -> None:
    valkey = _valkey(redis_server)
    first, second = _envelopes(1), _envelopes(2)
    with Client(svc.url, retries=0) as client:
        client.insert(_prompt(1), kv=first["kv"], swa=first["swa"], state=first["state"])  # type: ignore[arg-type]
        client.insert(_prompt(2), kv=second["kv"], swa=second["swa"], state=second["state"])  # type: ignore[arg-type]
        keys = _keys(valkey, "ts:*:kv", at_least=4)  # prefix 1 now lives in L3 only
        forged = b"\xee" * UNITS["kv"]
        for key in keys:
            valkey.set(key, forge(key, forged))
        got = client.fetch(_prompt(1) + [7])
        assert forged not in got["kv"], "forged KV bytes were served"
        assert got["matched_tokens"] == 0  # its only true copy is gone: a miss, to recompute
        remote = svc.service.store.stats().remote
        assert remote is not None and remote["num_corrupt_deleted"] >= 1
        kind = "old_format" if forge is old_checksum_value else "corrupt"
        assert remote["errors"].get(kind, 0) >= 1
        assert remote["num_mac_failures"] == (remote["errors"].get("corrupt", 0))
        assert valkey.exists(*keys) < len(keys), "the forged pages read are deleted"
        # recompute and insert, as an engine would: then it is served, byte for byte
        client.insert(_prompt(1), kv=first["kv"], swa=first["swa"], state=first["state"])  # type: ignore[arg-type]
        again = client.fetch(_prompt(1) + [7])
        assert again["matched_tokens"] == 16 and again["kv"] == first["kv"]
    svc.service.store.check_integrity()


@pytest.mark.parametrize(
    ("content", "mode", "reason"),
    [(b"s" * 40, 0o644, "open to group/others"), (b"short", 0o600, "at least 32")],
)
def test_serve_refuses_a_bad_key_file_before_starting(
    tmp_path: Path, content: bytes, mode: int, reason: str
) -> None:
    key_file = tmp_path / "mac.key"
    key_file.write_bytes(content)
    key_file.chmod(mode)
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(["--mac-key-file", str(key_file), "--device", "cpu",
                              "--l1", "1MiB", "--l2", "0", "--no-shm"])
    with ExitStack() as stack, pytest.raises(SystemExit, match=reason) as err:
        server.build(args, stack)
    assert str(key_file) in str(err.value.code) and "tierstore serve" in str(err.value.code)
