"""Issue 19: no single request stalls or bloats the service. A huge declared body holds only
the bytes that came, an array over its route's limit is refused at its header, a large body
is checked off the loop, JSON is bounded before it is parsed, and names with a trailing
newline are refused. Raw sockets, to send what a client library would not."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest

from tierstore.client import Client, ServiceError
from tierstore.config import StoreConfig
from tierstore.service.codec import BODY_LIMITS, BodyLimits
from tierstore.service.config import ServiceConfig
from tierstore.store import TierStore
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

LAYOUT = tiny_layout(page_size=4)
SLOW_BODY = 256 << 20  # declared by each slow sender; sent: 16 bytes


def _service(**kwargs: object) -> RunningService:
    base: dict[str, object] = {"port": free_port(), "max_tokens": 4096, "max_batch": 64,
                               "max_body_bytes": 64 << 20, "kv_host_bytes": 1 << 20,
                               "body_timeout_s": 30.0, "header_timeout_s": 30.0,
                               "shm": False}
    base.update(kwargs)
    store = TierStore(LAYOUT, StoreConfig(capacity_bytes=1 << 20))
    return RunningService(store, ServiceConfig(**base))  # type: ignore[arg-type]


def _limits(svc: RunningService) -> BodyLimits:
    assert svc._runner is not None
    return svc._runner.app[BODY_LIMITS]


def _rss_bytes() -> int:
    """This process's resident set (the service under test runs in it)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _head(path: str, length: int, content_type: str = "application/msgpack") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: "
            f"{content_type}\r\nContent-Length: {length}\r\n\r\n").encode()


def _answer(sock: socket.socket) -> tuple[int, dict]:
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _silent(sock: socket.socket) -> bool:
    """Whether ``sock`` is open and nothing was answered on it yet."""
    sock.setblocking(False)
    try:
        return not sock.recv(1, socket.MSG_PEEK)  # b"": closed
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)


@contextmanager
def _slow_senders() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        yield socks
    finally:  # before the service stops: it waits for their requests
        for sock in socks:
            sock.close()


def test_huge_declared_bodies_hold_only_what_came_and_block_no_one() -> None:
    """Two senders declare 256 MiB and send 16 bytes. Before: each body was allocated from
    Content-Length (RSS +512 MiB) and took the whole in-flight budget, so a 1 KiB batch_set
    waited until the slow ones timed out."""
    with _service(max_body_bytes=SLOW_BODY) as svc, _slow_senders() as slow_senders:
        budget = _limits(svc).budget
        before = _rss_bytes()
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", svc.config.port), timeout=30)
            sock.sendall(_head("/v1/storage/batch_set", SLOW_BODY) + b"\x82\xa4keys\x91\xa1k" +
                         b"\xa6values")
            slow_senders.append(sock)
        while budget.used < 32:  # both bodies have begun to arrive
            threading.Event().wait(0.01)
        grown = _rss_bytes() - before
        assert budget.used == 32, budget.used
        assert grown < 64 << 20, f"RSS grew {grown >> 20} MiB for 32 bytes received"
        with Client(svc.url, retries=0, timeout_s=10) as c:
            assert c.batch_set(["small"], [b"v" * 1024]) == [True]
            assert c.batch_get(["small"]) == [b"v" * 1024]
        assert all(_silent(sock) for sock in slow_senders), "the slow senders were answered"


def test_an_array_over_the_limit_is_refused_at_its_header() -> None:
    """Only the first 64 KiB of a 10**7-token body are sent: the 413 comes from the array's
    header, not after the body (before: the body was read whole, so this waited for a 408)."""
    body = msgpack.packb({"tokens": [1] * 10**7})
    with _service() as svc, \
            socket.create_connection(("127.0.0.1", svc.config.port), timeout=30) as sock:
        sock.sendall(_head("/v1/insert", len(body)) + body[:64 << 10])
        status, error = _answer(sock)
    assert status == 413 and error["error"] == "too_many_items", error
    assert "max_array_len" in error["detail"]


@pytest.mark.parametrize(("path", "declared"), [("/v1/match", 1 << 20),
                                               ("/v1/release", 1 << 20),
                                               ("/v1/storage/batch_get", 8 << 20)])
def test_a_declared_length_over_the_routes_limit_is_refused_unread(path: str,
                                                                   declared: int) -> None:
    """Nothing of the body is sent; each route bounds its body by what its fields can need
    (before: one limit, max_body_bytes, for every route)."""
    with _service() as svc, \
            socket.create_connection(("127.0.0.1", svc.config.port), timeout=30) as sock:
        sock.sendall(_head(path, declared))
        status, error = _answer(sock)
    assert (status, error["error"]) == (413, "body_too_large"), error


def test_healthz_answers_while_a_large_body_is_checked() -> None:
    """10**6 token ids and a string at the end: decoded as they arrive, then checked on a
    worker thread. /healthz, sent with the body's last byte, is answered before that body's
    400 (before: the body was decoded and checked on the loop, and /healthz waited)."""
    body = msgpack.packb({"tokens": [*range(10**6), "x"]})
    with _service(max_tokens=1 << 20) as svc, \
            socket.create_connection(("127.0.0.1", svc.config.port), timeout=60) as big:
        budget = _limits(svc).budget
        big.sendall(_head("/v1/match", len(body)) + body[:-1])
        while budget.used < len(body) - 1:  # all but the last byte have arrived
            threading.Event().wait(0.01)
        threading.Event().wait(0.2)  # (the old service took all of it from the budget at once)
        with socket.create_connection(("127.0.0.1", svc.config.port), timeout=60) as probe:
            big.sendall(body[-1:])
            probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            assert _answer(probe) == (200, {"status": "ok"})
        assert _silent(big), "the large request was answered before /healthz"
        status, answer = _answer(big)
    assert (status, answer["error"]) == (400, "bad_tokens"), answer


def test_a_json_body_is_bounded_before_parsing() -> None:
    """JSON is parsed in one call that holds the GIL: a 2 MiB JSON body is refused unparsed
    (before: parsed and answered, however long it took)."""
    body = json.dumps({"tokens": list(range(300_000))}).encode()
    assert len(body) > 1 << 20
    with _service(max_tokens=10**6) as svc, \
            socket.create_connection(("127.0.0.1", svc.config.port), timeout=30) as sock:
        sock.sendall(_head("/v1/match", len(body), "application/json") + body)
        status, error = _answer(sock)
    assert (status, error["error"]) == (413, "body_too_large"), error
    assert "application/msgpack" in error["detail"]


@pytest.mark.parametrize("name", ["tenantB\n", "tenantB\r\n", "\ntenantB"])
def test_names_with_a_newline_are_400(name: str) -> None:
    """``$`` also matched before a trailing newline: "tenantB\\n" was a valid namespace and
    "k\\n" a valid storage key."""
    with _service() as svc, Client(svc.url, retries=0) as c:
        with pytest.raises(ServiceError) as err:
            c.match([1, 2, 3, 4], namespace=name)
        assert (err.value.status, err.value.error) == (400, "bad_namespace")
        with pytest.raises(ServiceError) as err:
            c.batch_set(["k"], [b"v"], namespace=name)
        assert (err.value.status, err.value.error) == (400, "bad_namespace")
        with pytest.raises(ServiceError) as err:
            c.batch_set([name], [b"v"])
        assert (err.value.status, err.value.error) == (400, "bad_key")
        assert c.batch_exists(["tenantB"]) == 0


def test_a_large_batch_set_still_goes_through_the_host_segment() -> None:
    """A 12 MiB batch (over the 4 MiB that kv copies off the loop into reserved ranges of the
    host segment, then publishes) streamed in chunks reads back byte for byte."""
    values = [bytes([i]) * (3 << 20) + bytes(range(256)) for i in range(4)]
    with _service(kv_host_bytes=32 << 20, shm=True) as svc, \
            Client(svc.url, retries=0, timeout_s=60) as c:
        assert c.batch_set([f"k{i}" for i in range(4)], values) == [True] * 4
        assert c.batch_get([f"k{i}" for i in range(4)]) == values
        assert _limits(svc).budget.used == 0
        svc.service.kv.host.check_integrity()


@pytest.mark.parametrize("step", [1, 3, 7, 4096])
def test_msgpack_decoded_from_any_chunking_is_the_same(step: int) -> None:
    """The streaming decoder resumes where each chunk ended: any split of a body decodes to
    what ``unpackb`` gives, and bytes after the object are refused."""
    from tierstore.service.body import HTTPError, RouteLimits, _MsgpackStream

    raw = msgpack.packb({"keys": ["a", "bé" * 40], "values": [b"\x00" * 300, b""],
                         "n": [2**40, -1, 1.5, None, True], "m": {"x": {"y": [1]}}})
    stream = _MsgpackStream(RouteLimits(1 << 20, 1 << 20, max_array=8))
    for start in range(0, len(raw), step):
        stream.feed(raw[start:start + step])
    assert stream.result() == msgpack.unpackb(raw)
    with pytest.raises(HTTPError) as err:
        stream.feed(b"\x01")
    assert (err.value.status, err.value.error) == (400, "malformed_body")
