"""Issue 14: malformed requests are clean JSON 4xx, slow and idle connections are cut, bodies
are refused before they are read, tenants' keys never alias, leases belong to who took them,
and Redis values of the wrong type are counted. Raw sockets where a client library would
refuse to send what an attacker sends."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import redis

from remote_tier import RemoteTierConfig
from tierstore.client import Client
from tierstore.config import StoreConfig
from tierstore.service.codec import BodyBudget
from tierstore.service.config import ServiceConfig
from tierstore.service.kv import KeyValueStore
from tierstore.service.leases import LeaseTable
from tierstore.store import TierStore
from tierstore.testing.redis_server import RedisServer
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

TOKEN = "hardening-token"
MAX_BODY = 64 << 10
MAX_CONNECTIONS = 16
LAYOUT = tiny_layout(page_size=4)
UNITS = {k: e.nbytes for k, e in LAYOUT.envelopes().items()}


def tiny_store() -> TierStore:
    return TierStore(LAYOUT, StoreConfig(capacity_bytes=1 << 20))


def _config(**kwargs: object) -> ServiceConfig:
    base: dict[str, object] = {
        "port": free_port(), "auth_token": TOKEN, "max_tokens": 4096, "max_batch": 64,
        "max_body_bytes": MAX_BODY, "kv_host_bytes": 4096, "header_timeout_s": 0.5,
        "body_timeout_s": 0.5, "keepalive_timeout_s": 60.0, "max_connections": MAX_CONNECTIONS}
    base.update(kwargs)
    return ServiceConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def svc(redis_server: RedisServer) -> Iterator[RunningService]:
    redis_server.command("FLUSHALL")
    kv_remote = RemoteTierConfig(url=redis_server.url, key_prefix="tskv")
    with RunningService(tiny_store(), _config(), kv_remote) as running:
        yield running


def _exchange(port: int, data: bytes, *, source: str = "127.0.0.1") -> tuple[int, dict, bytes]:
    """Send ``data`` on a fresh connection; the status, headers and body of the answer (the
    server closes: every request here says ``Connection: close`` or is refused)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10,
                                  source_address=(source, 0)) as sock:
        sock.sendall(data)
        return _parse(_read_all(sock))


def _read_all(sock: socket.socket) -> bytes:
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def _parse(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _request(path: str, body: bytes, *, content_type: str = "application/msgpack",
             auth: bytes = b"Bearer " + TOKEN.encode(), extra: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
            b"Authorization: " + auth + b"\r\nContent-Type: " + content_type.encode() +
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


def _assert_json_error(status: int, headers: dict, body: bytes, want: int | tuple[int, ...]
                       ) -> dict:
    assert status in ((want,) if isinstance(want, int) else want), (status, body[:300])
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)
    assert set(error) == {"error", "detail"} and isinstance(error["error"], str), error
    return error


_DEEP_JSON = b'{"tokens": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
_DEEP_MSGPACK = b"\x81\xa6tokens" + b"\x91" * 60_000 + b"\x90"
_MAP_KEY_MAP = b"\x82\xa6tokens\xc4\x00" + b"\x81\xa1a\x01" + b"\x01"  # {"tokens", {"a":1}: 1}

MALFORMED = {
    "json_token_beyond_int64": ("/v1/match", b'{"tokens": [1, 100000000000000000000000]}',
                                "application/json", 400),
    "msgpack_token_uint64": ("/v1/fetch", msgpack.packb({"tokens": [2**64 - 1]}), None, 400),
    "msgpack_token_negative": ("/v1/match", msgpack.packb({"tokens": [-(2**63)]}), None, 400),
    "priority_uint64": ("/v1/match", msgpack.packb({"tokens": b"", "priority": 2**64 - 1}),
                        None, 400),
    "json_float_token": ("/v1/match", b'{"tokens": [1.5]}', "application/json", 400),
    "msgpack_array_map_key": ("/v1/match", msgpack.packb({"tokens": b"", (1, 2): 3}), None, 400),
    "msgpack_map_map_key": ("/v1/storage/batch_get", _MAP_KEY_MAP, None, 400),
    "json_deeply_nested": ("/v1/match", _DEEP_JSON, "application/json", 400),
    "msgpack_deeply_nested": ("/v1/insert", _DEEP_MSGPACK, None, 400),
    "json_huge_int_literal": ("/v1/match", b'{"tokens": [' + b"9" * 5000 + b"]}",
                              "application/json", 400),
    "lease_as_map": ("/v1/release", msgpack.packb({"lease": {"a": 1}}), None, 400),
    "keys_as_ints": ("/v1/storage/delete", msgpack.packb({"keys": [1, 2]}), None, 400),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_bodies_are_json_4xx(svc: RunningService, case: str) -> None:
    path, body, content_type, want = MALFORMED[case]
    raw = _request(path, body, content_type=content_type or "application/msgpack")
    _assert_json_error(*_exchange(svc.config.port, raw), want)


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n",
    b"POST /v1/match HTTP/1.1\r\nHost: t\r\nContent-Length: nope\r\n\r\n",
    b"POST /v1/match HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
], ids=["request_line", "header_too_long", "bad_content_length", "bad_chunk"])
def test_parser_errors_are_json(svc: RunningService, raw: bytes) -> None:
    _assert_json_error(*_exchange(svc.config.port, raw), (400, 413, 431))


@pytest.mark.parametrize("auth", [b"Bearer \xe9t\xe9", b"Bearer \xff\xfe", b"\xc3\x28"])
def test_non_ascii_bearer_tokens_are_401(svc: RunningService, auth: bytes) -> None:
    raw = _request("/v1/stats", b"{}", content_type="application/json", auth=auth)
    _assert_json_error(*_exchange(svc.config.port, raw), 401)


def test_oversize_body_is_refused_from_content_length_before_reading(
        svc: RunningService) -> None:
    """No body is sent: the 413 can only come from Content-Length (before: aiohttp waited
    to read it)."""
    raw = (b"POST /v1/insert HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + TOKEN.encode() +
           b"\r\nContent-Type: application/msgpack\r\nContent-Length: 1200000000\r\n\r\n")
    error = _assert_json_error(*_exchange(svc.config.port, raw), 413)
    assert error["error"] == "body_too_large"


def test_oversize_chunked_body_is_refused_while_streaming(svc: RunningService) -> None:
    chunk = b"x" * 16384
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(MAX_BODY // 16384 + 2))
    raw = (b"POST /v1/insert HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + TOKEN.encode() +
           b"\r\nContent-Type: application/msgpack\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    try:
        status, headers, answer = _exchange(svc.config.port, raw)
    except ConnectionResetError:
        pytest.fail("the server reset the connection instead of answering 413")
    assert _assert_json_error(status, headers, answer, 413)["error"] == "body_too_large"


def test_slowloris_headers_get_408_and_close(svc: RunningService) -> None:
    with socket.create_connection(("127.0.0.1", svc.config.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/match HTTP/1.1\r\nHost: t\r\nX-Slow: ")  # and never more
        status, headers, body = _parse(_read_all(sock))
    assert _assert_json_error(status, headers, body, 408)["error"] == "header_timeout"


def test_stalled_body_gets_408_and_close(svc: RunningService) -> None:
    raw = (b"POST /v1/match HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + TOKEN.encode() +
           b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"tok")
    error = _assert_json_error(*_exchange(svc.config.port, raw), 408)
    assert error["error"] == "body_timeout"


def test_idle_connections_are_capped_and_healthz_still_answers(svc: RunningService) -> None:
    port = svc.config.port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10)
            for _ in range(3 * MAX_CONNECTIONS)]
    try:
        status, _, body = _exchange(port, b"GET /healthz HTTP/1.1\r\nHost: t\r\n"
                                          b"Connection: close\r\n\r\n")
        assert status == 200 and json.loads(body) == {"status": "ok"}
        # the oldest idle connections were closed to admit newer ones
        for sock in idle[:MAX_CONNECTIONS]:
            assert _read_all(sock) == b""
    finally:
        for sock in idle:
            sock.close()


async def test_body_budget_waits_then_refuses() -> None:
    budget = BodyBudget(100)
    assert budget.try_take(60) and not budget.try_take(60)
    assert not await budget.take(60, 0.01)  # nothing released: refused after the wait
    waiter = asyncio.ensure_future(budget.take(60, 10.0))
    await asyncio.sleep(0)
    budget.give(60)
    assert await waiter and budget.used == 60


# ------------------------------------------------------------------ tenants, keys, leases
def test_storage_namespaces_do_not_alias(svc: RunningService) -> None:
    assert KeyValueStore.key("a/b", "c") != KeyValueStore.key("a", "b/c")
    with Client(svc.url, token=TOKEN, retries=0) as c:
        assert c.batch_set(["c"], [b"tenant-ab"], namespace="a/b") == [True]
        assert c.batch_get(["b/c"], namespace="a") == [None]
        assert c.batch_exists(["b/c"], namespace="a") == 0
        assert c.delete(["b/c"], namespace="a") == 0
        c.batch_set(["b/c"], [b"tenant-a"], namespace="a")
        assert c.batch_get(["c"], namespace="a/b") == [b"tenant-ab"]
        assert c.batch_get(["b/c"], namespace="a") == [b"tenant-a"]


def test_a_storage_value_copied_under_another_key_is_a_miss(
        svc: RunningService, redis_server: RedisServer) -> None:
    value = bytes(range(256)) * 40  # over kv_host_bytes: only Redis holds it
    src, dst = "tskv:raw:" + KeyValueStore.key("a", "x"), "tskv:raw:" + KeyValueStore.key("a", "y")
    r = redis.Redis(host="127.0.0.1", port=redis_server.port)
    with Client(svc.url, token=TOKEN, retries=0) as c:
        c.batch_set(["x"], [value], namespace="a")
        r.set(dst, r.get(src))
        assert c.batch_get(["y", "x"], namespace="a") == [None, value]


def test_wrong_type_redis_values_are_counted(svc: RunningService,
                                             redis_server: RedisServer) -> None:
    r = redis.Redis(host="127.0.0.1", port=redis_server.port)
    r.rpush("tskv:raw:" + KeyValueStore.key("t", "k"), b"x")
    with Client(svc.url, token=TOKEN, retries=0) as c:
        assert c.batch_get(["k"], namespace="t") == [None]
    conn = http.client.HTTPConnection("127.0.0.1", svc.config.port, timeout=10)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    text = conn.getresponse().read().decode()
    assert 'tierstore_redis_errors_total{kind="wrongtype"} 1.0' in text


def test_lease_table_ids_are_unguessable_and_owned() -> None:
    table = LeaseTable(60.0)
    lease = object()
    ids = {table.add(lease, "alice") for _ in range(100)}  # type: ignore[arg-type]
    assert len(ids) == 100 and all(isinstance(i, str) and len(i) >= 20 for i in ids)
    some = next(iter(ids))
    assert table.pop(some, "mallory") is None and len(table) == 100
    assert table.pop(some, "alice") is lease and len(table) == 99


def _post(port: int, path: str, body: dict, source: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10,
                                      source_address=(source, 0))
    conn.request("POST", path, body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_only_the_principal_that_took_a_lease_releases_it() -> None:
    """Without auth the principal is the peer address: 127.0.0.2 cannot release a lease
    127.0.0.1 took (404, as for a lease that never existed), and the lease stays held."""
    with RunningService(tiny_store(), _config(auth_token=None)) as svc, \
            Client(svc.url, retries=0) as c:
        port = svc.config.port
        c.insert(list(range(8)), kv=[bytes(UNITS["kv"])] * 2, swa=[bytes(UNITS["swa"])] * 2,
                 state=bytes(UNITS["state"]))
        status, m = _post(port, "/v1/match", {"tokens": list(range(9)), "lock": True},
                          "127.0.0.1")
        lease = m["lease"]
        assert status == 200 and isinstance(lease, str) and len(lease) >= 20, m
        stranger = _post(port, "/v1/release", {"lease": lease}, "127.0.0.2")
        unknown = _post(port, "/v1/release", {"lease": "x" * len(lease)}, "127.0.0.2")
        assert stranger[0] == unknown[0] == 404
        assert stranger[1]["error"] == unknown[1]["error"] == "unknown_lease"
        assert len(svc.service.leases) == 1
        assert _post(port, "/v1/release", {"lease": lease}, "127.0.0.1") == (
            200, {"released": True})
        assert len(svc.service.leases) == 0


def test_longest_namespace_and_key_reach_redis(svc: RunningService) -> None:
    """A 128-character namespace and a 400-character key still make a valid Redis key
    (the length prefix adds characters; a value over kv_host_bytes lives in Redis only)."""
    namespace, key, value = "n" * 128, "k" * 400, bytes(range(256)) * 40
    with Client(svc.url, token=TOKEN, retries=0) as c:
        assert c.batch_set([key], [value], namespace=namespace) == [True]
        assert c.batch_get([key], namespace=namespace) == [value]


def test_a_body_cut_short_is_a_4xx_not_a_500(svc: RunningService) -> None:
    raw = (b"POST /v1/match HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + TOKEN.encode() +
           b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"tokens\": [1]}")
    with socket.create_connection(("127.0.0.1", svc.config.port), timeout=10) as sock:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)  # and never the rest
        _read_all(sock)
    conn = http.client.HTTPConnection("127.0.0.1", svc.config.port, timeout=10)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    text = conn.getresponse().read().decode()
    assert 'endpoint="/v1/match",status="400"' in text
    assert 'status="500"' not in text


_BODY = msgpack.packb({"tokens": [1, 2, 3, 4]})
_HEAD = _request("/v1/match", _BODY)[:-len(_BODY)]


@pytest.mark.parametrize("when", ["serving", "queued"])
def test_a_body_that_arrives_after_shutdown_began_is_still_read(when: str) -> None:
    """aiohttp drops what a connection sends once shutdown begins, even the rest of the body
    of a request whose headers came before: one it is serving, or one parsed and not yet
    started. Without ``GuardedHandler._drain`` that request waits out ``body_timeout_s`` and
    holds the shutdown as long (CI saw 30 s stalls)."""
    running = RunningService(tiny_store(), _config(body_timeout_s=60.0)).start()
    runner = running._runner
    assert runner is not None and runner.server is not None
    server = runner.server
    with socket.create_connection(("127.0.0.1", running.config.port), timeout=10) as sock:
        if when == "serving":
            sock.sendall(_HEAD)
            handler = _wait_for(lambda: next(
                (h for h in server.connections if h._request_in_progress), None))
            cleanup = asyncio.run_coroutine_threadsafe(runner.cleanup(), running._loop)
            _wait_for(lambda: handler._draining)
            sock.sendall(_BODY)
        else:  # the headers, cleanup's first step (close) and the body in one loop turn
            handler = _wait_for(lambda: next(iter(server.connections), None))

            async def race() -> None:
                handler.data_received(_HEAD)  # parsed and queued: not started yet
                assert not handler._request_in_progress
                server.pre_shutdown()  # what the runner's cleanup does first: close() each
                handler.data_received(_BODY)

            asyncio.run_coroutine_threadsafe(race(), running._loop).result(10)
            cleanup = asyncio.run_coroutine_threadsafe(runner.cleanup(), running._loop)
        status, _, answer = _parse(_read_all(sock))
        cleanup.result(10)  # without the drain: body_timeout_s (60 s) first
    running._runner = None
    running.stop()
    assert status == 200 and json.loads(answer)["lost"] == {"cold": 4}


def _wait_for(probe: Callable[[], Any], within_s: float = 10.0) -> Any:
    deadline = time.monotonic() + within_s
    while not (value := probe()):
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)
    return value
