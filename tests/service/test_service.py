"""End to end through the real HTTP server (and a real redis-server behind the storage API)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch

from remote_tier import RemoteTierConfig, RemoteUnavailable
from tierstore.client import AsyncClient, Client, ServiceError
from tierstore.config import StoreConfig
from tierstore.service.config import ServiceConfig
from tierstore.store import TierStore
from tierstore.testing.redis_server import RedisServer
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

LAYOUT = tiny_layout(page_size=4)
UNITS = {k: e.nbytes for k, e in LAYOUT.envelopes().items()}
TOKEN = "s3cret-token"


def new_store(**kwargs: object) -> TierStore:
    return TierStore(LAYOUT, StoreConfig(capacity_bytes=1 << 20, **kwargs))  # type: ignore[arg-type]


@pytest.fixture
def svc(redis_server: RedisServer) -> Iterator[RunningService]:
    redis_server.command("FLUSHALL")
    config = ServiceConfig(port=free_port(), max_tokens=4096, max_batch=64,
                           max_body_bytes=4 << 20, lease_ttl_s=0.5, kv_host_bytes=4096)
    kv_remote = RemoteTierConfig(url=redis_server.url, key_prefix="tskv")
    with RunningService(new_store(host_capacity_bytes=1 << 20), config, kv_remote) as running:
        yield running


@pytest.fixture
def client(svc: RunningService) -> Iterator[Client]:
    with Client(svc.url, retries=0) as c:
        yield c


def envelopes(seed: int, pages: int = 4) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)

    def blobs(kind: str, n: int) -> list[bytes]:
        return [torch.randint(0, 256, (UNITS[kind],), dtype=torch.uint8, generator=g)
                .numpy().tobytes() for _ in range(n)]

    return {"kv": blobs("kv", pages), "swa": blobs("swa", 2), "state": blobs("state", 1)[0]}


def prompt(i: int, n: int = 16) -> list[int]:
    return list(range(1000 * i, 1000 * i + n))


def raw_post(url: str, path: str, body: bytes, content_type: str = "application/msgpack",
             token: str | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=body, method="POST",
                                     headers={"Content-Type": content_type})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ------------------------------------------------------------------ prefix API
def test_insert_match_fetch_bytes_identical(client: Client) -> None:
    data = envelopes(1)
    result = client.insert(prompt(1), kv=data["kv"], swa=data["swa"], state=data["state"])
    assert result["stored"] and result["new_pages"] == 4 and result["checkpoint"]
    m = client.match(prompt(1) + [5])
    assert m["matched_tokens"] == 16 and m["checkpoint"] == 16 and m["tiers"]["l1"] == 16
    got = client.fetch(prompt(1) + [5])
    assert got["kv"] == data["kv"]
    assert got["swa"][2:] == data["swa"] and got["swa"][:2] == [None, None]
    assert got["state"] == data["state"]
    assert client.fetch(prompt(1) + [5], "other-tenant")["matched_tokens"] == 0


def test_json_bodies_and_token_lists_work(svc: RunningService) -> None:
    status, body = raw_post(svc.url, "/v1/match", json.dumps(
        {"tokens": prompt(3), "namespace": "default"}).encode(), "application/json")
    assert status == 200 and body["matched_tokens"] == 0


def test_leases_lock_until_released_or_expired(client: Client, svc: RunningService) -> None:
    data = envelopes(2)
    client.insert(prompt(2), kv=data["kv"], swa=data["swa"], state=data["state"])
    m = client.match(prompt(2) + [1], lock=True)
    assert m["lease"] is not None and client.stats()["service"]["leases"] == 1
    client.release(m["lease"])
    with pytest.raises(ServiceError) as err:
        client.release(m["lease"])
    assert err.value.status == 404
    m = client.match(prompt(2) + [1], lock=True)
    deadline = time.monotonic() + 5
    while client.stats()["service"]["leases"]:
        assert time.monotonic() < deadline, "lease never expired"
        time.sleep(0.1)
    svc.service.store.check_integrity()


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("path", "body", "status", "error"),
    [
        ("/v1/match", b"\xc1\xc1not msgpack", 400, "malformed_body"),
        ("/v1/match", msgpack.packb({"namespace": "x"}), 400, "missing_field"),
        ("/v1/match", msgpack.packb({"tokens": ["a", "b"]}), 400, "bad_tokens"),
        ("/v1/match", msgpack.packb({"tokens": [1, 2], "namespace": "bad ns"}), 400,
         "bad_namespace"),
        ("/v1/match", msgpack.packb({"tokens": list(range(5000))}), 413, "too_many_tokens"),
        ("/v1/insert", msgpack.packb({"tokens": list(range(8)), "kv": [b"x" * 10, b"y" * 10]}),
         422, "wrong_shape"),
        ("/v1/insert", msgpack.packb({"tokens": list(range(8)), "kv": [b"\0" * UNITS["kv"]]}),
         422, "wrong_shape"),
        ("/v1/release", msgpack.packb({"lease": "not-a-lease"}), 404, "unknown_lease"),
        ("/v1/release", msgpack.packb({"lease": 12345}), 400, "bad_field"),
        ("/v1/storage/batch_set", msgpack.packb({"keys": ["a"] * 65, "values": [b"v"] * 65}),
         413, "batch_too_large"),
        ("/v1/storage/batch_set", msgpack.packb({"keys": ["a b"], "values": [b"v"]}), 400,
         "bad_key"),
        ("/v1/storage/batch_set", msgpack.packb({"keys": ["a", "b"], "values": [b"v"]}), 422,
         "wrong_shape"),
        ("/v1/storage/batch_exists", msgpack.packb({"keys": ["a"], "each": "yes"}), 400,
         "bad_field"),
        ("/v1/nope", msgpack.packb({}), 404, "not_found"),
    ],
)
def test_errors_are_json_and_change_nothing(svc: RunningService, path: str, body: bytes,
                                            status: int, error: str) -> None:
    store = svc.service.store
    before = (store.index.num_pages, {k: store.arena.num_live(k) for k in store.kinds},
              svc.service.kv.stats()["host_keys"])
    got_status, got = raw_post(svc.url, path, body)
    assert (got_status, got["error"]) == (status, error), got
    assert got["detail"]
    after = (store.index.num_pages, {k: store.arena.num_live(k) for k in store.kinds},
             svc.service.kv.stats()["host_keys"])
    assert before == after


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        ("/v1/match", {"tokens": list(range(5000))}, "too_many_tokens"),  # decoder's check
        ("/v1/storage/batch_set", {"keys": ["a"] * 65, "values": [b"v"] * 65},
         "batch_too_large"),
        ("/v1/storage/batch_get", {"keys": ["a"] * 65}, "batch_too_large"),
    ],
)
def test_too_many_items_says_the_limit(svc: RunningService, client: Client, path: str,
                                       body: dict[str, Any], error: str) -> None:
    """A 413 for too many items carries the route's limit as a field (clients split to it),
    and the client's ServiceError exposes it."""
    status, got = raw_post(svc.url, path, msgpack.packb(body))
    assert (status, got["error"]) == (413, error), got
    limit = got["limit"]
    assert type(limit) is int and 0 < limit < max(len(v) for v in body.values())
    assert str(limit) in got["detail"]
    with pytest.raises(ServiceError) as err:
        client.call_nowait(path, body).result(timeout=30)
    assert (err.value.status, err.value.limit) == (413, limit)


def test_other_errors_carry_no_limit(svc: RunningService) -> None:
    status, got = raw_post(svc.url, "/v1/release", msgpack.packb({"lease": "not-a-lease"}))
    assert status == 404 and "limit" not in got


def test_body_over_the_limit_is_413(svc: RunningService) -> None:
    status, body = raw_post(svc.url, "/v1/storage/batch_set",
                            msgpack.packb({"keys": ["k"], "values": [b"x" * (5 << 20)]}))
    assert status == 413 and body["error"] == "body_too_large"


def test_unsupported_media_type_is_400(svc: RunningService) -> None:
    status, body = raw_post(svc.url, "/v1/match", b"tokens=1", "text/plain")
    assert status == 400 and body["error"] == "unsupported_media_type"


def test_tier_unavailable_is_503_and_the_client_retries(svc: RunningService,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def down(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RemoteUnavailable("redis 127.0.0.1:1: connection refused")

    monkeypatch.setattr(svc.service.store, "match", down)
    status, body = raw_post(svc.url, "/v1/match", msgpack.packb({"tokens": [1, 2]}))
    assert status == 503 and body["error"] == "tier_unavailable"
    with Client(svc.url, retries=2, backoff_s=0.01) as c, pytest.raises(ServiceError):
        c.match([1, 2])
    assert len(calls) == 1 + 3  # the raw post, then the client's first try and two retries


def test_auth_token_required_everywhere_but_healthz() -> None:
    config = ServiceConfig(port=free_port(), auth_token=TOKEN, kv_host_bytes=1 << 20)
    with RunningService(new_store(), config) as svc:
        status, body = raw_post(svc.url, "/v1/match", msgpack.packb({"tokens": [1]}))
        assert status == 401 and body["error"] == "unauthorized"
        status, _ = raw_post(svc.url, "/v1/match", msgpack.packb({"tokens": [1]}),
                             token="wrong")
        assert status == 401
        with urllib.request.urlopen(svc.url + "/healthz", timeout=5) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(svc.url + "/metrics", timeout=5)
        assert err.value.code == 401
        with Client(svc.url, token=TOKEN) as c:
            assert c.match([1, 2, 3])["matched_tokens"] == 0
            assert c.stats()["requests"] == 1


# ------------------------------------------------------------------ storage API
def test_storage_api_round_trip_prefix_exists_and_redis_backing(client: Client,
                                                                svc: RunningService) -> None:
    keys = [f"page-{i}" for i in range(6)]
    values = [bytes([i]) * 1500 for i in range(6)]  # 9 KB > the 4 KB host copy: Redis holds it
    assert client.batch_set(keys[:4], values[:4]) == [True] * 4
    assert client.batch_exists(keys) == 4
    assert client.batch_exists(["page-0", "page-9", "page-1"]) == 1
    # Per key, past gaps: host copies and Redis-only values alike.
    assert client.exists_each(["page-0", "page-9", "page-3", "page-5"]) == \
        [True, False, True, False]
    assert client.batch_get(keys[:5]) == [*values[:4], None]
    assert client.batch_get(keys[:2], namespace="other") == [None, None]
    assert client.batch_exists(keys, namespace="other") == 0
    assert client.delete(keys[:2]) == 2
    assert client.batch_exists(keys) == 0
    assert client.batch_get(keys[2:4]) == values[2:4]


# ------------------------------------------------------------------ concurrency, metrics
def test_concurrent_clients(svc: RunningService) -> None:
    async def worker(i: int) -> None:
        async with AsyncClient(svc.url) as c:
            data = envelopes(100 + i)
            await c.insert(prompt(100 + i), kv=data["kv"], swa=data["swa"],  # type: ignore[arg-type]
                           state=data["state"])  # type: ignore[arg-type]
            for _ in range(5):
                got = await c.fetch(prompt(100 + i) + [9])
                assert got["kv"] == data["kv"] and got["state"] == data["state"]
                await c.batch_set([f"w{i}-{_}"], [b"x" * 10])

    async def main() -> None:
        await asyncio.gather(*(worker(i) for i in range(8)))

    asyncio.run(main())
    stats = Client(svc.url).stats()
    assert stats["requests_hit"] >= 40
    svc.service.store.check_integrity()


def test_metrics_openapi_and_stats(client: Client, svc: RunningService) -> None:
    data = envelopes(7)
    client.insert(prompt(7), kv=data["kv"], swa=data["swa"], state=data["state"])
    client.match(prompt(7) + [1])
    with urllib.request.urlopen(svc.url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    for name in ("tierstore_hit_tokens_total", "tierstore_hit_rate", "tierstore_moved_bytes",
                 "tierstore_arena_bytes", "tierstore_arena_band_edge_bytes",
                 "tierstore_compaction_moves", "tierstore_evictions",
                 "tierstore_request_seconds_bucket", "tierstore_leases_active"):
        assert name in text, name
    assert 'tierstore_hit_tokens_total{tier="l1"} 16.0' in text
    with urllib.request.urlopen(svc.url + "/openapi.json", timeout=5) as r:
        spec = json.loads(r.read())
    assert "/v1/match" in spec["paths"] and "/v1/storage/batch_exists" in spec["paths"]
    stats = client.stats()
    assert stats["hit_tokens"]["l1"] == 16 and stats["service"]["model"] == "tiny-hybrid"


async def _drop_first_release_reply(service_port: int) -> tuple[asyncio.AbstractServer, int]:
    """A loopback TCP proxy to the service that forwards everything but closes the client's
    connection instead of relaying the reply to the first ``/v1/release`` (the release still
    reaches the service): a reply lost on the way back."""
    dropped = False

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal dropped
        up_r, up_w = await asyncio.open_connection("127.0.0.1", service_port)
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                up_w.write(head + body)
                reply_head = await up_r.readuntil(b"\r\n\r\n")
                n = next(int(line.split(b":")[1]) for line in reply_head.split(b"\r\n")
                         if line.lower().startswith(b"content-length:"))
                reply = reply_head + await up_r.readexactly(n)
                if b"/v1/release" in head.split(b"\r\n")[0] and not dropped:
                    dropped = True
                    return  # the service released it; the client never hears so
                writer.write(reply)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            up_w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_retried_release_whose_reply_was_lost_counts_as_released(
        svc: RunningService) -> None:
    port = int(svc.url.rsplit(":", 1)[1])
    proxy, proxy_port = await _drop_first_release_reply(port)
    try:
        async with AsyncClient(f"http://127.0.0.1:{proxy_port}", retries=2,
                               backoff_s=0.01) as c:
            await c.insert(prompt(7), **envelopes(7))  # type: ignore[arg-type]
            lease = (await c.match(prompt(7), lock=True))["lease"]
            await c.release(lease)  # first reply lost, the retry finds it released: no error
            with pytest.raises(ServiceError) as err:  # a release that never happened still is
                await c.release(lease)
            assert err.value.status == 404 and err.value.attempts == 1
    finally:
        proxy.close()
        await proxy.wait_closed()
