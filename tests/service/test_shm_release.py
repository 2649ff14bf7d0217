"""Read leases ended without a request of their own: named in the next ``shm_get``
(``release``) or in one batched ``shm_release`` (``leases``), as the vLLM tier's load threads
send them; and the transport's own per-thread connections for its data calls. A real service
(in-process, Redis behind it)."""

from __future__ import annotations

import gc
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from host_tier import shm
from remote_tier import RemoteTierConfig
from tierstore.client import Client, ServiceError
from tierstore.config import StoreConfig
from tierstore.service.config import ServiceConfig
from tierstore.shm_client import SegmentChanged, SharedMemoryTransport
from tierstore.store import TierStore
from tierstore.testing.redis_server import RedisServer
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

pytestmark = pytest.mark.skipif(not shm.available(16 << 20), reason="no usable /dev/shm")
NS = "release-test"


def start(redis_server: RedisServer, port: int | None = None, max_batch: int = 4096
          ) -> RunningService:
    config = ServiceConfig(port=port or free_port(), lease_ttl_s=30.0, kv_host_bytes=1 << 20,
                           max_batch=max_batch)
    store = TierStore(tiny_layout(page_size=4), StoreConfig(capacity_bytes=1 << 20))
    return RunningService(store, config, RemoteTierConfig(url=redis_server.url,
                                                          key_prefix="rel")).start()


@pytest.fixture
def svc(redis_server: RedisServer) -> Iterator[RunningService]:
    redis_server.command("FLUSHALL")
    running = start(redis_server)
    yield running
    running.stop()


@pytest.fixture
def client(svc: RunningService) -> Iterator[Client]:
    with Client(svc.url, retries=0) as c:
        yield c


@pytest.fixture
def transport(client: Client) -> Iterator[SharedMemoryTransport]:
    made = SharedMemoryTransport.attach(client)
    yield made
    made.close()


def leases(svc: RunningService) -> int:
    return svc.service.kv.stats()["shm_leases"]


def wait_until(check: Callable[[], bool], what: str, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def copier(out: dict[int, bytes]) -> Callable[[int, torch.Tensor], bool]:
    def take(i: int, view: torch.Tensor) -> bool:
        out[i] = view.numpy().tobytes()
        return True

    return take


def test_a_deferred_lease_rides_on_the_next_read(svc: RunningService,
                                                 transport: SharedMemoryTransport) -> None:
    assert transport.release_in_get  # the service said it takes ``release`` lists
    transport.defer_release = True
    assert transport.batch_set(["a", "b"], [b"x" * 100, b"y" * 200], NS) == [True, True]
    got: dict[int, bytes] = {}
    assert transport.get_into(["a"], NS, copier(got)) == [True]
    assert got == {0: b"x" * 100}
    assert leases(svc) == 1  # copied, but not released by a request of its own
    sent: list[dict[str, Any]] = []
    call = transport._control.call

    def spy(path: str, body: dict[str, Any]) -> Any:
        reply = call(path, body)
        sent.append({"path": path, **body, "reply": reply})
        return reply

    transport._control.call = spy  # type: ignore[method-assign]
    assert transport.get_into(["b"], NS, copier(got)) == [True]
    assert got[0] == b"y" * 200
    (request,) = sent  # one request: the read, carrying the first read's lease
    assert request["path"] == "/v1/storage/shm_get" and len(request["release"]) == 1
    assert request["reply"]["released"] == 1
    assert leases(svc) == 1  # the second read's, deferred in turn
    assert transport.release_pending() == 1
    assert leases(svc) == 0
    assert transport.release_pending() == 0


def held_leases(client: Client, name: str, n: int) -> list[str]:
    """``n`` read leases of key ``a`` taken with raw requests (as deferred reads leave them)."""
    return [client.call("/v1/storage/shm_get", {"keys": ["a"], "namespace": NS,
                                                "segment": name})["lease"] for _ in range(n)]


@pytest.mark.parametrize("max_batch,pending", [(4096, 400), (4, 10)])
def test_deferred_leases_go_in_requests_the_service_takes(
        redis_server: RedisServer, max_batch: int, pending: int) -> None:
    """However many leases are deferred, each request carries no more than the service
    takes (its max_batch, said in the attach answer; at most 256): 400 at the default
    limit (256 ride on a read, the release of the other 144 was a 413 past 64 before),
    10 with a service that takes 4 keys a request."""
    redis_server.command("FLUSHALL")
    running = start(redis_server, max_batch=max_batch)
    try:
        with Client(running.url, retries=0) as client:
            transport = SharedMemoryTransport.attach(client)
            try:
                assert transport.max_batch == max_batch
                transport.defer_release = True
                keys = [f"k{i}" for i in range(9)]
                assert transport.batch_set(["a", *keys], [b"x" * 10] * 10, NS) == [True] * 10
                transport._defer(held_leases(client, transport.segment.name, pending))
                assert leases(running) == pending
                got: dict[int, bytes] = {}
                assert transport.get_into(keys, NS, copier(got)) == [True] * 9
                assert got == dict.fromkeys(range(9), b"x" * 10)
                assert leases(running) < pending  # some rode on the reads' requests
                transport.release_pending()
                assert leases(running) == 0
            finally:
                transport.close()
    finally:
        running.stop()


def test_without_deferral_every_read_ends_its_own_lease(
        svc: RunningService, transport: SharedMemoryTransport) -> None:
    assert transport.batch_set(["a"], [b"x" * 100], NS) == [True]
    for _ in range(3):
        assert transport.get_into(["a"], NS, copier({})) == [True]
    wait_until(lambda: leases(svc) == 0, "each read released its lease")
    assert transport.release_pending() == 0


def test_a_bad_release_list_is_refused_and_changes_nothing(
        svc: RunningService, client: Client, transport: SharedMemoryTransport) -> None:
    assert transport.batch_set(["a"], [b"x" * 100], NS) == [True]
    name = transport.segment.name
    held = client.call("/v1/storage/shm_get", {"keys": ["a"], "namespace": NS,
                                               "segment": name})
    hits = svc.service.kv.hits["host"]
    for bad, status in ((held["lease"], 400), ([held["lease"], 7], 400),
                        ([held["lease"]] * 5000, 413)):
        with pytest.raises(ServiceError) as err:
            client.call("/v1/storage/shm_get", {"keys": ["a"], "namespace": NS,
                                                "segment": name, "release": bad})
        assert err.value.status == status
        with pytest.raises(ServiceError) as err:
            client.call("/v1/storage/shm_release", {"leases": bad})
        assert err.value.status == status
    # A refused read ends no lease and reads nothing; so does one for another segment.
    with pytest.raises(ServiceError) as err:
        client.call("/v1/storage/shm_get", {"keys": ["a"], "namespace": NS,
                                            "segment": "other", "release": [held["lease"]]})
    assert err.value.status == 409
    assert leases(svc) == 1 and svc.service.kv.hits["host"] == hits
    assert client.call("/v1/storage/shm_release", {"leases": [held["lease"], "nope"]}) == \
        {"released": 1}
    assert leases(svc) == 0


def test_another_principals_lease_is_not_ended(tmp_path: Path) -> None:
    """Leases belong to the principal that took them, in a release list as anywhere."""
    tokens = {"alpha": "alpha-token-" + "a" * 20, "beta": "beta-token-" + "b" * 20}
    tenants = {name: {"tokens": ["sha256:" + hashlib.sha256(tok.encode()).hexdigest()],
                      "namespaces": ["*"]} for name, tok in tokens.items()}
    path = tmp_path / "principals.json"
    path.write_text(json.dumps({"tenants": tenants}))
    config = ServiceConfig(port=free_port(), kv_host_bytes=1 << 20, principals=str(path))
    store = TierStore(tiny_layout(page_size=4), StoreConfig(capacity_bytes=1 << 20))
    running = RunningService(store, config).start()
    try:
        with Client(running.url, token=tokens["alpha"], retries=0) as a, \
                Client(running.url, token=tokens["beta"], retries=0) as b:
            ta = SharedMemoryTransport.attach(a)
            assert ta.batch_set(["k"], [b"z" * 64], NS) == [True]
            held = a.call("/v1/storage/shm_get", {"keys": ["k"], "namespace": NS,
                                                  "segment": ta.segment.name})
            reply = b.call("/v1/storage/shm_get", {"keys": [], "namespace": NS,
                                                   "segment": ta.segment.name,
                                                   "release": [held["lease"]]})
            assert reply["released"] == 0
            assert b.call("/v1/storage/shm_release", {"leases": [held["lease"]]}) == \
                {"released": 0}
            assert running.service.kv.stats()["shm_leases"] == 1
            assert a.call("/v1/storage/shm_release", {"leases": [held["lease"]]}) == \
                {"released": 1}
            ta.close()
    finally:
        running.stop()


def test_reads_from_many_threads_use_one_connection_each(
        svc: RunningService, transport: SharedMemoryTransport) -> None:
    data = {f"k{i}": bytes([i]) * (1000 + i) for i in range(8)}
    assert all(transport.batch_set(list(data), list(data.values()), NS))
    transport.defer_release = True
    errors: list[BaseException] = []
    done, leave = threading.Barrier(5), threading.Event()

    def reader(seed: int) -> None:
        try:
            for j in range(20):
                key = f"k{(seed + j) % 8}"
                got: dict[int, bytes] = {}
                assert transport.get_into([key], NS, copier(got)) == [True]
                assert got[0] == data[key]
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)
        done.wait()
        leave.wait()

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    done.wait()
    # Kept alive, one per thread: the four readers' and this thread's (it wrote).
    assert len(transport._control._open) == 5
    leave.set()
    for thread in threads:
        thread.join()
    assert not errors
    gc.collect()
    assert len(transport._control._open) == 1  # a thread's connection ends with it
    transport.release_pending()
    assert leases(svc) == 0


def test_a_restart_between_reads_is_noticed_and_old_leases_change_nothing(
        redis_server: RedisServer) -> None:
    redis_server.command("FLUSHALL")
    port = free_port()
    running = start(redis_server, port)
    with Client(running.url, retries=0) as client:
        transport = SharedMemoryTransport.attach(client)
        transport.defer_release = True
        assert transport.batch_set(["a"], [b"x" * 100], NS) == [True]
        assert transport.get_into(["a"], NS, copier({})) == [True]
        running.stop()
        with pytest.raises(OSError):  # down: the kept-alive connection is gone, and so is it
            transport.get_into(["a"], NS, copier({}))
        running = start(redis_server, port)
        try:
            got: dict[int, bytes] = {}
            # Another service now (a new segment): refused, never read at old offsets; the
            # old lease rides along again and ends nothing there.
            with pytest.raises(SegmentChanged):
                transport.get_into(["a"], NS, copier(got))
            assert got == {} and running.service.kv.stats()["shm_leases"] == 0
            fresh = SharedMemoryTransport.attach(client)
            assert fresh.get_into(["a"], NS, copier(got)) == [True]  # from Redis
            assert got == {0: b"x" * 100}
            fresh.close()
            transport.close()
        finally:
            running.stop()
