"""Issue 19: principals and tenants through the real service, with a real Redis behind it.

Two tenants naming the same namespace never read, overwrite, list or delete each other's
values or prefixes (neither in host memory nor in Redis); namespaces outside a tenant's list
and writes of a read-only tenant get 403; quotas (value bytes, prefix pages, reservations)
cost only the tenant's own data; shared-memory leases and reservations work only for the
principal that took them; ``stored`` is false with a reason when Redis refuses a write."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from host_tier import shm
from remote_tier import RemoteTierConfig
from tierstore.bench import soak
from tierstore.client import Client, ServiceError
from tierstore.config import StoreConfig
from tierstore.hashing import PageHasher, tenant_namespace
from tierstore.service import server
from tierstore.service.app import Service
from tierstore.service.config import ServiceConfig
from tierstore.service.principals import Principals, PrincipalsError, hash_token, new_token
from tierstore.service.quotas import ENTRY_OVERHEAD, PageQuota, ValueQuota
from tierstore.shm_client import SharedMemoryTransport
from tierstore.store import TierStore
from tierstore.testing.redis_server import RedisServer
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

LAYOUT = tiny_layout(page_size=4)
UNITS = {k: e.nbytes for k, e in LAYOUT.envelopes().items()}
TOKENS = {name: new_token() for name in ("alpha", "beta", "reader", "small")}
QUOTA_VALUES = 3  # values of VALUE_SIZE the small tenant's byte quota holds
VALUE_SIZE = 1000
needs_shm = pytest.mark.skipif(not shm.available(16 << 20), reason="no usable /dev/shm")


def principals_doc() -> dict[str, Any]:
    def entry(name: str, namespaces: list[str], **extra: Any) -> dict[str, Any]:
        return {"tokens": [hash_token(TOKENS[name])], "namespaces": namespaces, **extra}

    return {"tenants": {
        "alpha": entry("alpha", ["shared", "alpha/*"]),
        "beta": entry("beta", ["shared", "beta/*"]),
        "reader": entry("reader", ["shared"], read_only=True),
        "small": entry("small", ["small"], max_value_bytes=QUOTA_VALUES * (VALUE_SIZE +
                                                                           ENTRY_OVERHEAD),
                       max_prefix_pages=2, max_reservations=2, max_reserved_bytes="8KiB")}}


def envelopes(pages: int, fill: int) -> dict[str, Any]:
    return {"kv": [bytes([fill]) * UNITS["kv"]] * pages,
            "swa": [bytes([fill + 1]) * UNITS["swa"]] * pages,
            "state": bytes([fill + 2]) * UNITS["state"]}


@pytest.fixture(scope="module")
def svc(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[RunningService]:
    redis_server.command("FLUSHALL")
    path = tmp_path_factory.mktemp("principals") / "principals.json"
    path.write_text(json.dumps(principals_doc()))
    store = TierStore(LAYOUT, StoreConfig(
        capacity_bytes=1 << 20, host_capacity_bytes=1 << 20,
        remote=RemoteTierConfig(url=redis_server.url, key_prefix="ts")))
    config = ServiceConfig(port=free_port(), principals=str(path), kv_host_bytes=1 << 20,
                           lease_ttl_s=30.0, reservation_ttl_s=30.0,
                           shm=shm.available(1 << 20))
    kv_remote = RemoteTierConfig(url=redis_server.url, key_prefix="tskv")
    with RunningService(store, config, kv_remote) as running:
        yield running


@pytest.fixture(scope="module")
def clients(svc: RunningService) -> Iterator[dict[str, Client]]:
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(Client(svc.url, token=token, retries=0))
               for name, token in TOKENS.items()}


def error_of(call: Callable[[], object]) -> tuple[int, str]:
    with pytest.raises(ServiceError) as caught:
        call()
    return caught.value.status, caught.value.error


# ------------------------------------------------------------------ isolation
def test_tenants_never_share_values_under_one_namespace(
        clients: dict[str, Client], redis_server: RedisServer) -> None:
    a, b = clients["alpha"], clients["beta"]
    assert a.batch_set(["k", "only-a"], [b"alpha-k", b"alpha-only"], "shared") == [True, True]
    assert b.batch_get(["k", "only-a"], "shared") == [None, None]
    assert b.batch_exists(["k", "only-a"], "shared") == 0
    assert b.batch_set(["k"], [b"beta-k"], "shared") == [True]  # no overwrite of alpha's
    assert a.batch_get(["k"], "shared") == [b"alpha-k"]
    assert b.batch_get(["k"], "shared") == [b"beta-k"]
    assert b.delete(["only-a"], "shared") == 0
    assert a.batch_get(["only-a"], "shared") == [b"alpha-only"]
    # Redis holds one key per tenant: the tenant is part of the stored key.
    for tenant in ("alpha", "beta"):
        raw = f"tskv:raw:{tenant}|6:shared/k"
        assert redis_server.command("EXISTS", raw).strip() == b":1", raw


def test_tenants_never_share_prefixes_under_one_namespace(clients: dict[str, Client]) -> None:
    a, b = clients["alpha"], clients["beta"]
    tokens = list(range(500, 512))  # 3 pages
    mine = envelopes(3, fill=10)
    a.insert(tokens, "shared", **mine)
    assert b.match([*tokens, 1], "shared")["matched_tokens"] == 0
    assert b.fetch([*tokens, 1], "shared")["matched_tokens"] == 0
    b.insert(tokens, "shared", **envelopes(3, fill=50))  # its own pages, not alpha's
    got = a.fetch([*tokens, 1], "shared")
    assert got["matched_tokens"] == 12 and got["kv"] == mine["kv"]
    assert got["state"] == mine["state"]
    assert b.fetch([*tokens, 1], "shared")["kv"] == envelopes(3, fill=50)["kv"]


def test_the_tenant_is_in_the_page_salt() -> None:
    hasher = PageHasher("m", "l", 4)
    roots = {hasher.root(ns) for ns in ("shared", tenant_namespace("alpha", "shared"),
                                         tenant_namespace("beta", "shared"))}
    assert len(roots) == 3
    assert tenant_namespace("", "shared") == "shared"  # the open tenant keeps its old keys


def test_namespaces_outside_the_tenants_list_are_forbidden(clients: dict[str, Client]
                                                          ) -> None:
    a = clients["alpha"]
    assert a.batch_set(["x"], [b"1"], "alpha/sub") == [True]  # a prefix entry
    for call in (lambda: a.batch_get(["x"], "beta/sub"), lambda: a.batch_set(["x"], [b"1"]),
                 lambda: a.match([1, 2, 3, 4], "beta/x"),
                 lambda: a.fetch([1, 2, 3, 4], "alphabet"),
                 lambda: a.insert([1, 2, 3, 4], "beta/x", **envelopes(1, 1)),
                 lambda: a.delete(["x"], "beta/sub")):
        assert error_of(call) == (403, "forbidden_namespace")
    # A scoped name cannot be sent to reach another tenant's keys.
    assert error_of(lambda: a.batch_get(["k"], "beta|shared"))[0] == 400


def test_a_read_only_tenant_reads_but_never_writes(clients: dict[str, Client]) -> None:
    r = clients["reader"]
    assert r.batch_get(["k"], "shared") == [None]
    assert r.match([1, 2, 3, 4], "shared")["matched_tokens"] == 0
    for call in (lambda: r.batch_set(["k"], [b"1"], "shared"),
                 lambda: r.delete(["k"], "shared"),
                 lambda: r.insert([1, 2, 3, 4], "shared", **envelopes(1, 1)),
                 lambda: r.call("/v1/storage/shm_reserve", {"keys": ["k"], "sizes": [1],
                                                            "namespace": "shared",
                                                            "segment": "x"}),
                 lambda: r.call("/v1/storage/shm_commit", {"reservation": "x"})):
        assert error_of(call) == (403, "read_only")


def test_unknown_tokens_are_refused(svc: RunningService) -> None:
    for token in (None, "not-a-token", TOKENS["alpha"] + "x"):
        with Client(svc.url, token=token, retries=0) as c:
            with pytest.raises(ServiceError) as caught:
                c.batch_get(["k"], "shared")
            assert (caught.value.status, caught.value.error) == (401, "unauthorized")


# ------------------------------------------------------------------ quotas
def test_over_its_byte_quota_a_tenant_loses_its_own_oldest_values(
        clients: dict[str, Client], svc: RunningService) -> None:
    s, a = clients["small"], clients["alpha"]
    a.batch_set(["neighbour"], [b"n" * VALUE_SIZE], "shared")
    values = [bytes([i]) * VALUE_SIZE for i in range(QUOTA_VALUES + 2)]
    for i, value in enumerate(values):
        assert s.batch_set([f"v{i}"], [value], "small") == [True]
    keys = [f"v{i}" for i in range(len(values))]
    assert s.batch_get(keys, "small") == [None, None, *values[2:]]  # its own oldest went
    assert a.batch_get(["neighbour"], "shared") == [b"n" * VALUE_SIZE]
    reply = s.call("/v1/storage/batch_set", {"keys": ["huge"], "namespace": "small",
                                             "values": [b"h" * (QUOTA_VALUES * VALUE_SIZE * 2)]})
    assert reply == {"stored": [False], "reasons": ["quota"]}
    assert s.batch_get(keys[2:], "small") == values[2:]  # a refused value evicts nothing
    held = s.stats()["principal"]
    assert held["tenant"] == "small" and held["max_value_bytes"] == QUOTA_VALUES * (
        VALUE_SIZE + ENTRY_OVERHEAD)
    assert held["value_bytes"] == svc.service.kv.quota.held("small") <= held["max_value_bytes"]


def test_over_its_page_quota_an_insert_is_refused(clients: dict[str, Client]) -> None:
    s = clients["small"]
    first = list(range(900, 908))  # 2 pages: the whole quota
    assert s.insert(first, "small", **envelopes(2, 3))["new_pages"] == 2
    assert s.insert(first, "small", **envelopes(2, 3))["new_pages"] == 0  # cached: no cost
    assert error_of(lambda: s.insert(list(range(950, 954)), "small", **envelopes(1, 3))) == \
        (429, "quota_exceeded")
    assert s.match([*first, 1], "small")["matched_tokens"] == 8  # nothing was lost
    a = clients["alpha"]  # another tenant is not limited by it
    assert a.insert(list(range(950, 962)), "alpha/p", **envelopes(3, 3))["new_pages"] == 3


# ------------------------------------------------------------------ shared memory
def segment_of(client: Client) -> str:
    return str(client.call("/v1/shm/attach", {})["segments"]["kv"]["name"])


@needs_shm
def test_reservations_are_capped_per_principal(clients: dict[str, Client],
                                               svc: RunningService) -> None:
    s = clients["small"]
    segment = segment_of(s)

    def reserve(sizes: list[int]) -> dict[str, Any]:
        return dict(s.call("/v1/storage/shm_reserve", {
            "keys": [f"r{i}" for i in range(len(sizes))], "sizes": sizes,
            "namespace": "small", "segment": segment}))

    first = reserve([6000, 6000])  # 8 KiB of bytes quota: the second gets no range
    assert first["slots"][0] is not None and first["slots"][1] is None
    second = reserve([4000])
    assert second["slots"] == [None]  # 6000 + 4000 > 8 KiB
    assert error_of(lambda: reserve([1])) == (429, "reservation_quota")  # 2 reservations
    assert svc.service.kv.host.reservations_held("tenant:small") == (2, 6000)
    for held in (first, second):
        assert s.call("/v1/storage/shm_abort", {"reservation": held["reservation"]})["aborted"]
    assert reserve([1])["slots"] != [None]  # room again


@needs_shm
def test_leases_and_reservations_belong_to_their_principal(clients: dict[str, Client]) -> None:
    a, b = clients["alpha"], clients["beta"]
    segment = segment_of(a)
    a.batch_set(["leased"], [b"L" * 100], "shared")
    lease = a.call("/v1/storage/shm_get", {"keys": ["leased"], "namespace": "shared",
                                           "segment": segment})["lease"]
    assert lease is not None
    assert b.call("/v1/storage/shm_release", {"lease": lease}) == {"released": False}
    assert a.call("/v1/storage/shm_release", {"lease": lease}) == {"released": True}
    held = a.call("/v1/storage/shm_reserve", {"keys": ["r"], "sizes": [10],
                                              "namespace": "shared", "segment": segment})
    res = held["reservation"]
    assert error_of(lambda: b.call("/v1/storage/shm_commit", {"reservation": res})) == \
        (404, "unknown_reservation")
    assert b.call("/v1/storage/shm_abort", {"reservation": res}) == {"aborted": False}
    assert a.call("/v1/storage/shm_commit", {"reservation": res})["stored"] == [True]
    # Sent again: the same answer to its principal, and still nothing to anyone else.
    assert a.call("/v1/storage/shm_commit", {"reservation": res})["stored"] == [True]
    assert error_of(lambda: b.call("/v1/storage/shm_commit", {"reservation": res})) == \
        (404, "unknown_reservation")


@needs_shm
def test_a_reservation_never_evicts_another_tenants_values(
        svc: RunningService, clients: dict[str, Client]) -> None:
    a, b = clients["alpha"], clients["beta"]
    host = svc.service.kv.host
    filler = [bytes([i]) * (64 << 10) for i in range(16)]  # fills the 1 MiB host copy
    a.batch_set([f"fill{i}" for i in range(16)], filler, "alpha/fill")
    before = {k for k in host._index if k.startswith("alpha|")}
    assert before
    held = b.call("/v1/storage/shm_reserve", {"keys": ["big"], "sizes": [200 << 10],
                                              "namespace": "shared",
                                              "segment": segment_of(b)})
    assert held["slots"] == [None]  # no room without evicting alpha
    assert {k for k in host._index if k.startswith("alpha|")} == before
    b.call("/v1/storage/shm_abort", {"reservation": held["reservation"]})
    host.check_integrity()


def start_open(redis_server: RedisServer | None = None, **config: Any) -> RunningService:
    store = TierStore(LAYOUT, StoreConfig(capacity_bytes=1 << 20))
    settings = {"port": free_port(), "kv_host_bytes": 1 << 20, **config}
    remote = None if redis_server is None else RemoteTierConfig(url=redis_server.url,
                                                                key_prefix="tskv")
    return RunningService(store, ServiceConfig(**settings), remote).start()


def post_from(address: str, url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST msgpack ``body`` from the loopback ``address`` (another client address)."""
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10,
                                      source_address=(address, 0))
    try:
        conn.request("POST", path, msgpack.packb(body, use_bin_type=True),
                     {"Content-Type": "application/msgpack"})
        response = conn.getresponse()
        raw = response.read()
        kind = response.getheader("Content-Type", "")
        return response.status, msgpack.unpackb(raw) if "msgpack" in kind else json.loads(raw)
    finally:
        conn.close()


@needs_shm
def test_without_a_token_shm_ids_belong_to_the_client_address() -> None:
    running = start_open(lease_ttl_s=30.0)
    try:
        url = running.url
        _, attach = post_from("127.0.0.1", url, "/v1/shm/attach", {})
        segment = attach["segments"]["kv"]["name"]
        _, held = post_from("127.0.0.1", url, "/v1/storage/shm_reserve",
                            {"keys": ["k"], "sizes": [10], "segment": segment})
        res = held["reservation"]
        assert post_from("127.0.0.2", url, "/v1/storage/shm_commit",
                         {"reservation": res})[0] == 404
        assert post_from("127.0.0.2", url, "/v1/storage/shm_abort",
                         {"reservation": res}) == (200, {"aborted": False})
        assert post_from("127.0.0.1", url, "/v1/storage/shm_commit",
                         {"reservation": res}) == (200, {"stored": [True]})
        _, got = post_from("127.0.0.1", url, "/v1/storage/shm_get",
                           {"keys": ["k"], "segment": segment})
        assert post_from("127.0.0.2", url, "/v1/storage/shm_release",
                         {"lease": got["lease"]}) == (200, {"released": False})
        assert post_from("127.0.0.1", url, "/v1/storage/shm_release",
                         {"lease": got["lease"]}) == (200, {"released": True})
    finally:
        running.stop()


@needs_shm
def test_uncommitted_reservations_expire_and_the_table_is_bounded() -> None:
    running = start_open(reservation_ttl_s=0.3, max_reservations=3,
                         reservations_per_principal=10)
    try:
        with Client(running.url, retries=0) as c:
            segment = segment_of(c)

            def reserve() -> Any:
                return c.call("/v1/storage/shm_reserve", {"keys": ["k"], "sizes": [100],
                                                          "segment": segment})

            held = [reserve()["reservation"] for _ in range(3)]
            assert error_of(reserve) == (503, "reservations_full")
            deadline = time.monotonic() + 20
            while running.service.kv.host.num_reservations:
                assert time.monotonic() < deadline, "the reservations never expired"
                time.sleep(0.05)
            assert error_of(lambda: c.call("/v1/storage/shm_commit",
                                           {"reservation": held[0]}))[0] == 404
            assert reserve()["slots"] != [None]
    finally:
        running.stop()


# ------------------------------------------------------------------ L3 refusing writes
def test_a_write_redis_refuses_answers_stored_false(redis_bin: str) -> None:
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as redis:
        info = redis.command("INFO", "memory").decode()
        used = int(next(line.split(":")[1] for line in info.split("\r\n")
                        if line.startswith("used_memory:")))
        redis.command("CONFIG", "SET", "maxmemory", str(used + (512 << 10)))
        running = start_open(redis, kv_host_bytes=16 << 20)
        try:
            with Client(running.url, retries=0) as c:
                reasons: list[Any] = []
                for i in range(40):  # 40 x 64 KiB passes maxmemory by far
                    reply = c.call("/v1/storage/batch_set", {"keys": [f"k{i}"],
                                                             "values": [b"v" * (64 << 10)]})
                    reasons += reply["reasons"]
                    if reply["stored"] == [False]:
                        assert reply["reasons"] == ["l3_refused"]
                        assert c.batch_get([f"k{i}"]) == [None]  # not kept in host memory
                        break
                else:
                    pytest.fail(f"Redis never refused a write: {reasons}")
        finally:
            running.stop()


# ------------------------------------------------------------------ configuration
def test_a_second_auth_token_is_refused() -> None:
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(["--auth-token", "one", "--auth-token", "two", "--no-redis",
                              "--device", "cpu", "--l1", "1MiB", "--l2", "0"])
    with contextlib.ExitStack() as stack, pytest.raises(ValueError, match="2 times"):
        server.build(args, stack)


def test_the_principals_file_holds_hashes_and_is_validated(tmp_path: Path) -> None:
    token = new_token()
    toml = tmp_path / "p.toml"
    toml.write_text(f'[tenants.alpha]\ntokens = ["{hash_token(token)}"]\n'
                    f'namespaces = ["chat", "alpha/*"]\nmax_value_bytes = "1MiB"\n')
    loaded = Principals.load(toml)
    tenant = loaded.lookup(f"{token}".encode())
    assert tenant is not None and tenant.name == "alpha"
    assert tenant.max_value_bytes == 1 << 20 and tenant.may_use("alpha/x")
    assert not tenant.may_use("chat2") and not tenant.may_use("beta")
    assert loaded.lookup(hash_token(token).encode()) is None  # the hash is not a token
    assert token not in toml.read_text()
    bad = [{"tenants": {}}, {"tenants": {"a": {"tokens": [token], "namespaces": ["x"]}}},
           {"tenants": {"a": {"tokens": [hash_token(token)], "namespaces": []}}},
           {"tenants": {"a b": {"tokens": [hash_token(token)], "namespaces": ["x"]}}},
           {"tenants": {"a": {"tokens": [hash_token(token)], "namespaces": ["x"],
                              "max_value_bytes": -1}}},
           {"tenants": {"a": {"tokens": [hash_token(token)], "namespaces": ["x"],
                              "quota": 1}}},
           {"tenants": {"a": {"tokens": [hash_token(token)], "namespaces": ["x"]},
                        "b": {"tokens": [hash_token(token)], "namespaces": ["y"]}}}]
    for doc in bad:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(PrincipalsError):
            Principals.load(path)
    with pytest.raises(PrincipalsError, match="not valid TOML"):
        (tmp_path / "broken.toml").write_text("[tenants\n")
        Principals.load(tmp_path / "broken.toml")
    missing = ServiceConfig(principals=str(tmp_path / "missing.json"), shm=False)
    with pytest.raises(PrincipalsError, match=r"missing\.json"):  # checked at start
        Service(TierStore(LAYOUT, StoreConfig(capacity_bytes=1 << 20)), missing)


# ------------------------------------------------------------------ soak
def test_a_short_soak_of_two_tenants_sees_no_cross_tenant_bytes(redis_bin: str) -> None:
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    args = parser.parse_args(["--clients", "4", "--seconds", "4", "--tenants", "2"])
    result = soak.run(args)
    assert result["tenants"] == 2
    assert result["cross_tenant_values"] == 0 and result["cross_tenant_bytes"] == 0
    assert result["wrong_values"] == 0 and result["http_5xx"] == 0, result["errors"]
    assert result["verified"].get("values", 0) > 0 and result["verified"].get("kv_pages", 0) > 0


def test_the_soak_counts_another_tenants_payload_as_cross_tenant_bytes() -> None:
    tally = soak.Tally()
    worker = soak.Worker(1, "http://unused", {"kv": 8, "swa": 8, "state": 8}, tally,
                         random.Random(0), tenants=2)
    assert (worker.tenant, worker.ns) == (1, "soak-w0")
    theirs = worker.value("k", tenant=0)
    tally.check("values", theirs, worker.value("k"), lambda: [theirs])
    assert (tally.cross_tenant_values, tally.cross_tenant_bytes) == (1, len(theirs))
    assert tally.wrong_values == 1


@needs_shm
def test_past_its_reservation_quota_the_shm_client_falls_back_to_http() -> None:
    running = start_open(reservations_per_principal=1)
    try:
        with Client(running.url, retries=0) as c:
            transport = SharedMemoryTransport.attach(c)
            try:
                held = c.call("/v1/storage/shm_reserve", {"keys": ["k"], "sizes": [8],
                                                          "segment": segment_of(c)})
                assert transport.batch_set(["a", "b"], [b"1", b"2"]) == [False, False]
                c.batch_set(["a", "b"], [b"1", b"2"])  # what the caller does next
                assert transport.batch_get(["a", "b"]) == [b"1", b"2"]
                c.call("/v1/storage/shm_abort", {"reservation": held["reservation"]})
                assert transport.batch_set(["c"], [b"3"]) == [True]
            finally:
                transport.close()
    finally:
        running.stop()


def test_the_principals_cli_prints_a_token_and_its_hash(capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    from tierstore.cli import main

    assert main(["principals", "token"]) == 0
    out = capsys.readouterr().out.splitlines()
    token = out[0].rsplit(" ", 1)[1]
    assert out[1] == f'tokens = ["{hash_token(token)}"]'
    path = tmp_path / "p.toml"
    path.write_text(f'[tenants.a]\n{out[1]}\nnamespaces = ["x"]\n')
    assert main(["principals", "check", str(path)]) == 0
    assert Principals.load(path).lookup(token.encode()) is not None


def test_the_quota_books_name_only_the_tenants_own_oldest() -> None:
    values = ValueQuota()
    values.charge("a", ["a1", "a2", "a3"], [100, 100, 100])
    values.charge("b", ["b1"], [100])
    limit = 3 * (100 + ENTRY_OVERHEAD)
    assert values.make_room("a", limit, ["a4"], [100]) == (1, ["a1"])
    assert values.make_room("a", limit, ["a2"], [100]) == (1, [])  # a replacement: no victim
    assert values.make_room("a", limit, ["big"], [limit]) == (0, [])  # never fits: no victims
    values.forget("a", ["a1"])
    values.check_integrity()
    pages = PageQuota(record_bytes=64)
    pages.add("a", "ns", b"\0" * 32, 2)  # 2 pages of 4 tokens (16 bytes each)
    assert pages.held("a") == 2 and not pages.fits("a", 3, 2, 16)
    assert not pages.fits("a", 10, 1, 40)  # the records' byte bound
    pages.refresh("a", lambda ns, toks: 1, 16)  # only the first page is still cached
    assert pages.held("a") == 1 and pages.fits("a", 3, 2, 16)
    pages.refresh("a", lambda ns, toks: 0, 16)  # gone: the record and its bytes go too
    assert pages.held("a") == 0 and pages.fits("a", 2, 2, 64)
