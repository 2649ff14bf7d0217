"""The storage API over shared memory: a real service (in-process, Redis behind it) and clients
that map its segment — in this process and in subprocesses (one of them SIGKILLed mid-write)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from host_tier import shm
from remote_tier import RemoteTierConfig
from tierstore.client import Client, ServiceError
from tierstore.config import StoreConfig
from tierstore.service import server
from tierstore.service.config import ServiceConfig
from tierstore.service.kv import COPY_ON_LOOP_BYTES
from tierstore.shm_client import (
    LeaseExpired,
    SegmentChanged,
    SharedMemoryTransport,
    ShmUnavailable,
    open_transport,
)
from tierstore.store import TierStore
from tierstore.testing.redis_server import RedisServer
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

pytestmark = pytest.mark.skipif(not shm.available(16 << 20), reason="no usable /dev/shm")
TTL = 0.6
NS = "shm-test"


def start(redis_server: RedisServer | None, **config: object) -> RunningService:
    settings = {"port": free_port(), "lease_ttl_s": TTL, "kv_host_bytes": 1 << 20, **config}
    store = TierStore(tiny_layout(page_size=4), StoreConfig(capacity_bytes=1 << 20))
    remote = None if redis_server is None else RemoteTierConfig(url=redis_server.url,
                                                                key_prefix="shm")
    return RunningService(store, ServiceConfig(**settings), remote).start()  # type: ignore[arg-type]


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
def shm_of(client: Client) -> Iterator[Callable[[], SharedMemoryTransport]]:
    made: list[SharedMemoryTransport] = []

    def make() -> SharedMemoryTransport:
        made.append(SharedMemoryTransport.attach(client))
        return made[-1]

    yield make
    for t in made:
        t.close()


def values(n: int, size: int, seed: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes()
            for _ in range(n)]


def wait_until(check: Callable[[], bool], what: str, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def kv_stats(svc: RunningService) -> dict[str, int]:
    return svc.service.kv.stats()


# ------------------------------------------------------------------ reads and writes
def test_shm_writes_read_back_by_shm_and_http(client: Client,
                                              shm_of: Callable[[], SharedMemoryTransport],
                                              svc: RunningService) -> None:
    transport = shm_of()
    keys, data = [f"k{i}" for i in range(6)], values(6, 3000, seed=1)
    assert transport.batch_set(keys, data, NS) == [True] * 6
    assert transport.batch_get([*keys, "absent"], NS) == [*data, None]
    assert client.batch_get(keys, NS) == data  # HTTP reads what shared memory wrote
    assert client.batch_exists(keys, NS) == 6
    http_keys = ["h0", "h1"]
    client.batch_set(http_keys, data[:2], NS)
    assert transport.batch_get(http_keys, NS) == data[:2]  # and the other way round
    assert transport.batch_get(keys, "other-namespace") == [None] * 6
    wait_until(lambda: kv_stats(svc)["shm_leases"] == 0, "the releases (sent without "
               "waiting) arrived")
    assert kv_stats(svc)["shm_reservations"] == 0
    svc.service.kv.host.check_integrity()


def test_commits_reach_redis_and_a_restarted_service_serves_them(
        redis_server: RedisServer, svc: RunningService,
        shm_of: Callable[[], SharedMemoryTransport]) -> None:
    keys, data = ["r0", "r1", "r2"], values(3, 5000, seed=2)
    assert shm_of().batch_set(keys, data, NS) == [True] * 3
    svc.stop()  # flushes the background Redis writes
    second = start(redis_server)
    try:
        with Client(second.url, retries=0) as c:
            t = SharedMemoryTransport.attach(c)
            assert t.batch_get(keys, NS) == data  # from Redis, into the new segment
            assert second.service.kv.stats()["hits_redis"] == 3
            t.close()
    finally:
        second.stop()


def test_values_larger_than_host_memory_fall_back_per_key(
        shm_of: Callable[[], SharedMemoryTransport], client: Client) -> None:
    transport = shm_of()
    big, small = values(1, (1 << 20) + 1, seed=3)[0], values(1, 100, seed=4)[0]
    assert transport.batch_set(["big", "small"], [big, small], NS) == [False, True]
    client.batch_set(["big"], [big], NS)  # the caller sends it over HTTP: Redis takes it
    assert transport.batch_get(["big", "small"], NS) == [big, small]  # big comes inline


def test_a_second_process_reads_what_the_first_wrote(svc: RunningService,
                                                     shm_of: Callable[[], SharedMemoryTransport]
                                                     ) -> None:
    keys, data = [f"p{i}" for i in range(4)], values(4, 4096, seed=5)
    assert shm_of().batch_set(keys, data, NS) == [True] * 4
    code = textwrap.dedent(f"""
        import hashlib, sys
        from tierstore.client import Client
        from tierstore.shm_client import SharedMemoryTransport
        with Client({svc.url!r}, retries=0) as c:
            t = SharedMemoryTransport.attach(c)
            got = t.batch_get({keys!r}, {NS!r})
            print(" ".join(hashlib.sha256(v).hexdigest() for v in got))
            t.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == [hashlib.sha256(v).hexdigest() for v in data]


# ------------------------------------------------------------------ crash, leases, aborts
def test_a_client_killed_mid_write_leaves_nothing(svc: RunningService, client: Client) -> None:
    before = kv_stats(svc)
    code = textwrap.dedent(f"""
        import sys, time
        from tierstore.client import Client
        from tierstore.shm_client import SharedMemoryTransport
        c = Client({svc.url!r}, retries=0)
        t = SharedMemoryTransport.attach(c)
        reply = c.call("/v1/storage/shm_reserve", {{"keys": ["victim"], "sizes": [8192],
                       "namespace": {NS!r}, "segment": t.segment.name}})
        start, length = reply["slots"][0]
        t.segment.tensor[start:start + length // 2].fill_(7)  # half written
        print("reserved", flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "reserved"
        assert kv_stats(svc)["shm_reservations"] == 1
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert client.batch_exists(["victim"], NS) == 0
    assert client.batch_get(["victim"], NS) == [None]
    wait_until(lambda: kv_stats(svc)["shm_reservations"] == 0, "the reservation expired")
    after = kv_stats(svc)
    assert after["host_used_bytes"] == before["host_used_bytes"]  # nothing leaked
    assert after["host_keys"] == before["host_keys"]
    svc.service.kv.host.check_integrity()


def test_read_leases_expire_and_expired_copies_are_refused(
        svc: RunningService, client: Client,
        shm_of: Callable[[], SharedMemoryTransport]) -> None:
    transport = shm_of()
    assert transport.batch_set(["a"], [b"x" * 1000], NS) == [True]
    held = client.call("/v1/storage/shm_get", {"keys": ["a"], "namespace": NS,
                                               "segment": transport.segment.name})
    assert kv_stats(svc)["shm_leases"] == 1
    transport.batch_set(["a"], [b"y" * 1000], NS)  # replaced while leased: the old bytes stay
    start, length = held["values"][0]
    assert transport.segment.tensor[start:start + length].numpy().tobytes() == b"x" * 1000
    wait_until(lambda: kv_stats(svc)["shm_leases"] == 0, "the lease expired")
    assert client.call("/v1/storage/shm_release", {"lease": held["lease"]}) == \
        {"released": False}
    assert kv_stats(svc)["host_used_bytes"] == 1024  # the old range came back

    def slow(i: int, view: torch.Tensor) -> bool:
        wait_until(lambda: kv_stats(svc)["shm_leases"] == 0, "the lease expired mid-copy")
        return True

    with pytest.raises(LeaseExpired):
        transport.get_into(["a"], NS, slow)


def test_a_failing_writer_aborts_and_a_commit_sent_again_answers_the_same(
        svc: RunningService, client: Client,
        shm_of: Callable[[], SharedMemoryTransport]) -> None:
    transport = shm_of()

    def broken(i: int, view: torch.Tensor) -> None:
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        transport.put_from(["z"], [64], NS, broken)
    stats = kv_stats(svc)
    assert (stats["shm_reservations"], stats["host_used_bytes"], stats["host_keys"]) == (0, 0, 0)
    name = transport.segment.name
    reply = client.call("/v1/storage/shm_reserve", {"keys": ["z"], "sizes": [64],
                                                    "namespace": NS, "segment": name})
    assert client.call("/v1/storage/shm_commit", {"reservation": reply["reservation"]}) == \
        {"stored": [True]}
    # Its answer lost, a client sends it again: the same answer (tests/service/
    # test_shm_commit.py); it cannot be aborted any more.
    assert client.call("/v1/storage/shm_commit", {"reservation": reply["reservation"]}) == \
        {"stored": [True]}
    assert client.call("/v1/storage/shm_abort", {"reservation": reply["reservation"]}) == \
        {"aborted": False}
    with pytest.raises(ServiceError) as err:
        client.call("/v1/storage/shm_reserve", {"keys": ["a", "b"], "sizes": [1],
                                                "namespace": NS, "segment": name})
    assert err.value.status == 422


def test_eviction_never_reuses_bytes_a_reader_holds(
        svc: RunningService, shm_of: Callable[[], SharedMemoryTransport]) -> None:
    """Threads write and read distinct keys through 1 MiB of host memory (constant eviction);
    every value read is the one written (or a miss: another thread's write may evict it
    before Redis has it)."""
    transport = shm_of()
    wrong: list[str] = []
    hits: list[int] = []

    def worker(n: int) -> None:
        for r in range(15):
            keys = [f"w{n}-{r}-{i}" for i in range(4)]
            data = values(4, 40_000, seed=1000 * n + r)
            transport.batch_set(keys, data, NS)
            got = transport.batch_get(keys, NS)
            wrong.extend(k for k, g, d in zip(keys, got, data, strict=True)
                         if g is not None and g != d)
            hits.append(sum(g is not None for g in got))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert wrong == [] and not any(t.is_alive() for t in threads)
    # Enough reads hit for the check above to mean something. How many hit depends on how the
    # four threads interleave (2.1-3.3 of 4 per round measured, at this commit and at a09ca14):
    # more than one of four on average, not more than two (that failed once in a fresh clone).
    assert kv_stats(svc)["host_evictions"] > 0 and sum(hits) > len(hits)
    svc.service.kv.host.check_integrity()


# ------------------------------------------------------------------ fallback and security
def test_no_shared_memory_means_http(redis_server: RedisServer) -> None:
    private = start(None, shm=False)
    try:
        with Client(private.url, retries=0) as c:
            assert open_transport(c, "auto") is None
            assert open_transport(c, "http") is None
            with pytest.raises(ShmUnavailable, match="refused"):
                open_transport(c, "shm")
    finally:
        private.stop()


def test_a_client_that_cannot_map_the_segment_uses_http(
        client: Client, monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))  # as on another host: no such name
    assert open_transport(client, "auto") is None
    with pytest.raises(ShmUnavailable, match="cannot map"):
        open_transport(client, "shm")


def test_attach_needs_the_token(redis_server: RedisServer) -> None:
    guarded = start(redis_server, auth_token="tok")
    try:
        with Client(guarded.url, retries=0) as anonymous:
            with pytest.raises(ServiceError) as err:
                anonymous.call("/v1/shm/attach", {})
            assert err.value.status == 401
            assert open_transport(anonymous, "auto") is None
        with Client(guarded.url, retries=0, token="tok") as c:
            transport = open_transport(c, "shm")
            assert transport is not None
            name = transport.segment.name
            mode = os.stat(os.path.join(shm.SHM_DIR, name)).st_mode & 0o777
            assert mode == 0o600
            transport.close()
    finally:
        guarded.stop()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))  # unlinked with the service


def test_a_restarted_service_is_noticed_not_misread(redis_server: RedisServer,
                                                    svc: RunningService) -> None:
    with Client(svc.url, retries=0) as c:
        transport = SharedMemoryTransport.attach(c)
        assert transport.batch_set(["s"], [b"old" * 100], NS) == [True]
        svc.stop()
        again = start(redis_server, port=svc.config.port)  # same URL, a new segment
        try:
            with pytest.raises(SegmentChanged):
                transport.batch_get(["s"], NS)
            with pytest.raises(SegmentChanged):
                transport.batch_set(["s"], [b"new"], NS)
            fresh = SharedMemoryTransport.attach(c)
            assert fresh.segment.name != transport.segment.name
            assert fresh.batch_get(["s"], NS) == [b"old" * 100]  # via Redis
            fresh.close()
        finally:
            again.stop()
        transport.close()


# ------------------------------------------------------------------ prefix fetch
def prefix_data(seed: int, pages: int = 4) -> dict[str, object]:
    units = {k: e.nbytes for k, e in tiny_layout(page_size=4).envelopes().items()}
    kv, swa, state = (values(n, units[kind], seed + i) for i, (kind, n) in
                      enumerate((("kv", pages), ("swa", 2), ("state", 1))))
    return {"kv": kv, "swa": swa, "state": state[0]}


def test_prefix_fetch_through_the_segment_matches_http(
        svc: RunningService, client: Client,
        shm_of: Callable[[], SharedMemoryTransport]) -> None:
    transport, tokens = shm_of(), list(range(500, 516))
    data = prefix_data(20)
    client.insert(tokens, kv=data["kv"], swa=data["swa"], state=data["state"])
    over_http = client.fetch([*tokens, 1])
    got = transport.fetch([*tokens, 1])
    assert got["kv"] == data["kv"] == over_http["kv"]
    assert got["swa"] == [None, None, *data["swa"]] == over_http["swa"]
    assert got["state"] == data["state"] == over_http["state"]
    assert (got["matched_tokens"], got["checkpoint"]) == (16, 16)
    wait_until(lambda: kv_stats(svc)["shm_leases"] == 0, "the fetch lease was released")
    assert kv_stats(svc)["host_used_bytes"] == 0  # staged rows are freed with the lease
    empty = transport.fetch(list(range(9000, 9016)))
    assert (empty["matched_tokens"], empty["kv"], empty["state"]) == (0, [], None)
    svc.service.kv.host.check_integrity()


def test_prefix_fetch_falls_back_to_http_when_rows_do_not_fit(
        redis_server: RedisServer) -> None:
    small = start(None, kv_host_bytes=4096)
    try:
        with Client(small.url, retries=0) as c:
            transport = SharedMemoryTransport.attach(c)
            tokens, data = list(range(700, 716)), prefix_data(30)
            c.insert(tokens, kv=data["kv"], swa=data["swa"], state=data["state"])
            assert transport.fetch_into([*tokens, 1], "default", lambda *_: None) is None
            assert transport.fetch([*tokens, 1])["kv"] == data["kv"]  # over HTTP
            assert small.service.kv.stats()["host_used_bytes"] == 0
            transport.close()
    finally:
        small.stop()


def test_large_http_sets_are_copied_off_the_loop() -> None:
    big = values(2, COPY_ON_LOOP_BYTES // 2 + 1, seed=40)  # over the threshold together
    local = start(None, kv_host_bytes=COPY_ON_LOOP_BYTES + (1 << 20), max_body_bytes=16 << 20)
    try:
        with Client(local.url, retries=0) as c:
            assert c.batch_set(["b0", "b1"], big) == [True, True]
            assert c.batch_get(["b0", "b1"]) == big
            local.service.kv.host.check_integrity()
    finally:
        local.stop()


def test_serve_flags_size_or_turn_off_the_segment() -> None:
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    common = ["--no-redis", "--device", "cpu", "--l1", "1MiB", "--l2", "0", "--scale", "1/2048"]
    for extra, shared in ((["--kv-host", "2MiB"], True), (["--no-shm"], False)):
        with contextlib.ExitStack() as stack:
            service, config = server.build(parser.parse_args(common + extra), stack)
            try:
                assert config.shm is shared
                assert (service.kv.host.segment is not None) is shared
                if shared:
                    assert service.kv.host.segment.nbytes == 2 << 20
            finally:
                service.kv.host.close()
                service.store.close()
