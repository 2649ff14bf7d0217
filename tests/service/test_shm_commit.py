"""A ``shm_commit`` sent again after its answer was lost: the same answer while its values
stand, 409 once a key of it was put or deleted since, 404 for an unknown reservation or
another principal's. Through a real service (in-process, a real valkey behind it) and the
shared-memory transport, whose connection loses the first commit's answer."""

from __future__ import annotations

import asyncio
import http.client
import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from host_tier import shm
from remote_tier import RedisTier, RemoteTierConfig
from tierstore.client import Client, ServiceError
from tierstore.config import StoreConfig
from tierstore.service import kv_remote
from tierstore.service.config import ServiceConfig
from tierstore.service.kv import KeyValueStore
from tierstore.service.kv_commits import CommitSuperseded
from tierstore.shm_client import SharedMemoryTransport
from tierstore.store import TierStore
from tierstore.testing.redis_server import RedisServer
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

pytestmark = pytest.mark.skipif(not shm.available(16 << 20), reason="no usable /dev/shm")
NS = "commit-test"


def data(n: int, size: int, seed: int) -> list[bytes]:
    g = np.random.default_rng(seed)
    return [g.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def filled(kv: KeyValueStore, keys: list[str], values: list[bytes], who: str = "") -> str:
    res_id, ranges = kv.reserve(keys, [len(v) for v in values], who)
    for value, data_ in zip(ranges, values, strict=True):
        assert value is not None
        kv.host.tensor(value).numpy()[:] = np.frombuffer(data_, np.uint8)
    return res_id


# ------------------------------------------------------------------ the store
def test_a_commit_sent_again_gets_its_first_answer_until_a_key_changes() -> None:
    values = data(3, 500, seed=1)

    async def scenario() -> None:
        kv = KeyValueStore(1 << 20, None, shared=False)
        try:
            res_id = filled(kv, ["a", "b"], values[:2], "alice")
            assert await kv.commit(res_id, "alice") == [True, True]
            assert await kv.commit(res_id, "alice") == [True, True]  # retried: same answer
            assert await kv.commit(res_id, "bob") is None  # not bob's: unknown to him
            assert await kv.commit("never-issued", "alice") is None
            assert await kv.batch_get(["a", "b"]) == values[:2]
            kv.host.drop_unpinned("a")  # an eviction is no change: the answer stands
            assert await kv.commit(res_id, "alice") == [True, True]
            await kv.batch_set(["b"], [values[2]])  # a newer value: the answer no longer holds
            with pytest.raises(CommitSuperseded):
                await kv.commit(res_id, "alice")
            other = filled(kv, ["c"], values[:1], "alice")
            assert await kv.commit(other, "alice") == [True]
            await kv.delete(["c"])
            with pytest.raises(CommitSuperseded):
                await kv.commit(other, "alice")
            assert kv.abort(res_id, "alice") is False  # committed, not abortable
        finally:
            await kv.aclose()

    asyncio.run(scenario())


def test_a_commit_is_forgotten_after_the_lease_ttl_and_its_keys_unwatched() -> None:
    (value,) = data(1, 500, seed=2)

    async def scenario() -> None:
        kv = KeyValueStore(1 << 20, None, shared=False, ttl_s=0.0)
        try:
            res_id = filled(kv, ["a"], [value])
            assert await kv.commit(res_id) == [True]
            assert await kv.commit(res_id) is None  # past the TTL: unknown, as before
            assert len(kv._commits) == 0
            kv._changes.check_integrity()
            assert not kv._changes._reading  # no key is watched any more
        finally:
            await kv.aclose()

    asyncio.run(scenario())


def test_a_retry_while_the_first_commit_still_writes_waits_for_its_answer(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the write-behind limit a commit waits for Redis before it answers; a retry sent
    meanwhile (the client gave up on the first) gets the same answer once it is known."""
    monkeypatch.setattr(kv_remote, "WRITE_BEHIND_BYTES", 0)
    values = data(2, 500, seed=3)

    async def scenario() -> None:
        kv = KeyValueStore(1 << 20, None, shared=False)
        kv.remote = await RedisTier.connect(RemoteTierConfig(
            url=redis_server.url, key_prefix=f"commit{secrets.token_hex(4)}"))
        gate, entered = asyncio.Event(), asyncio.Event()
        slow = kv.remote.put_many

        async def held(items: Any) -> list[bool]:
            entered.set()
            await gate.wait()
            return await slow(items)

        kv.remote.put_many = held  # type: ignore[method-assign]
        try:
            res_id = filled(kv, ["a", "b"], values)
            first = asyncio.ensure_future(kv.commit(res_id))
            await entered.wait()
            retry = asyncio.ensure_future(kv.commit(res_id))
            await asyncio.sleep(0.01)
            assert not retry.done()
            gate.set()
            assert await first == [True, True]
            assert await retry == [True, True]
        finally:
            gate.set()
            await kv.aclose()

    asyncio.run(scenario())


# ------------------------------------------------------------------ a real service
@pytest.fixture
def svc(redis_server: RedisServer) -> Iterator[RunningService]:
    config = ServiceConfig(port=free_port(), kv_host_bytes=1 << 20)
    store = TierStore(tiny_layout(page_size=4), StoreConfig(capacity_bytes=1 << 20))
    running = RunningService(store, config, RemoteTierConfig(
        url=redis_server.url, key_prefix=f"commit{secrets.token_hex(4)}")).start()
    yield running
    running.stop()


def test_a_transport_whose_commit_answer_is_lost_stores_the_values(
        svc: RunningService, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service commits, the connection drops before the answer arrives, the transport
    sends the commit again: the values are stored and the retry says so (it was 404, and
    the write read as failed)."""
    values = data(3, 700, seed=4)
    getresponse = http.client.HTTPConnection.getresponse
    request = http.client.HTTPConnection.request
    lost: list[str] = []

    def note(self: http.client.HTTPConnection, method: str, url: str, *args: Any,
             **kwargs: Any) -> None:
        self._engf_path = url  # type: ignore[attr-defined]
        request(self, method, url, *args, **kwargs)

    def losing(self: http.client.HTTPConnection) -> http.client.HTTPResponse:
        response = getresponse(self)
        path = getattr(self, "_engf_path", "")
        if path.endswith("/shm_commit") and not lost:
            response.read()  # the service has answered: the commit ran
            lost.append(path)
            raise http.client.RemoteDisconnected("answer lost")
        return response

    with Client(svc.url) as client:
        transport = SharedMemoryTransport.attach(client)
        try:
            monkeypatch.setattr(http.client.HTTPConnection, "request", note)
            monkeypatch.setattr(http.client.HTTPConnection, "getresponse", losing)
            keys = ["x", "y", "z"]
            assert transport.batch_set(keys, values, NS) == [True] * 3
            assert lost  # the first answer was lost
            monkeypatch.undo()
            assert transport.batch_get(keys, NS) == values
            assert client.batch_get(keys, NS) == values
        finally:
            transport.close()


def test_a_commit_sent_again_over_http_answers_the_same_then_409_then_404(
        svc: RunningService) -> None:
    values = data(2, 300, seed=5)
    with Client(svc.url, retries=0) as client:
        transport = SharedMemoryTransport.attach(client)
        try:
            reply = client.call("/v1/storage/shm_reserve", {
                "keys": ["p", "q"], "sizes": [300, 300], "namespace": NS,
                "segment": transport.segment.name})
            res_id = reply["reservation"]
            for (start, length), value in zip(reply["slots"], values, strict=True):
                transport.segment.tensor[start:start + length].numpy()[:] = \
                    np.frombuffer(value, np.uint8)
            first = client.call("/v1/storage/shm_commit", {"reservation": res_id})
            assert first["stored"] == [True, True]
            assert client.call("/v1/storage/shm_commit", {"reservation": res_id}) == first
            assert client.batch_set(["q"], [b"newer"], NS) == [True]
            with pytest.raises(ServiceError) as superseded:
                client.call("/v1/storage/shm_commit", {"reservation": res_id})
            assert superseded.value.status == 409
            assert superseded.value.error == "reservation_superseded"
            with pytest.raises(ServiceError) as unknown:
                client.call("/v1/storage/shm_commit", {"reservation": "never-issued"})
            assert unknown.value.status == 404
        finally:
            transport.close()
