"""Issue 14: every endpoint fuzzed from the service's own OpenAPI document (schemathesis:
schema-valid and schema-violating bodies, as msgpack and JSON) against a running service
with a token and a real Redis. Never a 5xx; every error is the JSON ``{error, detail}``
shape; a prefix and storage values written before the fuzzing read back byte-exact after.

Issue 19: the service has two principals. The known data belongs to the first; the fuzzer
runs as the second (allowed every namespace, the known one included) and never receives a
byte of the first one's values or prefix pages, then cannot read or match them by name.

Bounded: ``EXAMPLES`` per operation and mode (about 20 s on 2 cores)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from importlib import resources
from typing import Any

import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from remote_tier import RemoteTierConfig
from tierstore.client import Client
from tierstore.config import StoreConfig
from tierstore.service.app import Service
from tierstore.service.config import ServiceConfig
from tierstore.service.principals import hash_token
from tierstore.store import TierStore
from tierstore.testing.redis_server import RedisServer
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

TOKEN = "fuzz-token"  # the fuzzer's (second principal's)
OWNER_TOKEN = "owner-token"  # the known data's (first principal's)
EXAMPLES = 25
LAYOUT = tiny_layout(page_size=4)
UNITS = {k: e.nbytes for k, e in LAYOUT.envelopes().items()}
# Names the fuzzer will not hit by chance: it writes and deletes at random elsewhere.
KNOWN_NS = "known-0f8e2d9c7b6a5d4e3f2a1b0c"
KNOWN_TOKENS = list(range(7001, 7013))  # 3 pages of 4
KNOWN_KEYS = [f"page-{i}-3c1d9e8f7a6b" for i in range(3)]

def _marked(label: str, size: int) -> bytes:
    """``size`` bytes no other request produces: a response holding any 32 of them in a row
    carries the first principal's data."""
    out = b""
    while len(out) < size:
        out += hashlib.sha256(f"{label}/{len(out)}".encode()).digest()
    return out[:size]


KNOWN_VALUES = [_marked(f"value{i}", 100 + 3000 * i) for i in range(3)]

SPEC: dict[str, Any] = json.loads(
    resources.files("tierstore.service").joinpath("openapi.json").read_text(encoding="utf-8"))
schema = schemathesis.openapi.from_dict(SPEC)
schema.config.generation.update(
    modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
    max_examples=EXAMPLES)


@schemathesis.serializer("application/msgpack")
def _to_msgpack(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    return msgpack.packb(_packable(value), use_bin_type=True, default=bytes)


def _packable(value: Any) -> Any:
    """``value`` with ints msgpack cannot carry clamped to its range ends (what an attacker
    can send: uint64 and int64 extremes)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return min(max(value, -(2**63)), 2**64 - 1)
    if isinstance(value, list):
        return [_packable(v) for v in value]
    if isinstance(value, dict):
        return {k: _packable(v) for k, v in value.items()}
    return value


def _known_envelopes() -> dict[str, Any]:
    return {"kv": [_marked(f"kv{k}", UNITS["kv"]) for k in range(3)],
            "swa": [_marked(f"swa{k}", UNITS["swa"]) for k in range(3)],
            "state": _marked("state", UNITS["state"])}


def _markers() -> list[bytes]:
    data = _known_envelopes()
    return [b[:32] for b in [*KNOWN_VALUES, *data["kv"], *data["swa"], data["state"]]]


MARKERS = _markers()


@pytest.fixture(scope="module")
def fuzz_svc(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[RunningService]:
    """A service with two principals, Redis behind both APIs, and the first one's known data
    written up front."""
    redis_server.command("FLUSHALL")
    principals = tmp_path_factory.mktemp("fuzz") / "principals.json"
    principals.write_text(json.dumps({"tenants": {
        "owner": {"tokens": [hash_token(OWNER_TOKEN)], "namespaces": [KNOWN_NS]},
        "fuzzer": {"tokens": [hash_token(TOKEN)], "namespaces": ["*"]}}}))
    store = TierStore(LAYOUT, StoreConfig(
        capacity_bytes=1 << 20, host_capacity_bytes=1 << 20,
        remote=RemoteTierConfig(url=redis_server.url, key_prefix="ts")))
    config = ServiceConfig(port=free_port(), principals=str(principals), max_tokens=4096,
                           max_batch=64, max_body_bytes=1 << 20, kv_host_bytes=4096,
                           lease_ttl_s=5.0)
    kv_remote = RemoteTierConfig(url=redis_server.url, key_prefix="tskv")
    with RunningService(store, config, kv_remote) as running, \
            Client(running.url, token=OWNER_TOKEN, retries=0) as c:
        data = _known_envelopes()
        c.insert(KNOWN_TOKENS, KNOWN_NS, kv=data["kv"], swa=data["swa"], state=data["state"])
        assert c.batch_set(KNOWN_KEYS, KNOWN_VALUES, namespace=KNOWN_NS) == [True] * 3
        yield running


def test_the_spec_covers_every_route() -> None:
    """What the fuzzer cannot see it cannot test: every route the app serves is documented."""
    config = ServiceConfig(kv_host_bytes=4096, shm=False)
    app = Service(TierStore(LAYOUT, StoreConfig(capacity_bytes=1 << 20)), config).app()
    served = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.resource is not None and r.method != "HEAD"}
    documented = {(m, p) for p, ops in SPEC["paths"].items() for m in ops}
    assert served == documented


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_every_endpoint(case: schemathesis.Case, fuzz_svc: RunningService) -> None:
    response = case.call(base_url=fuzz_svc.url, headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=30)
    where = f"{case.method} {case.path} {case.media_type}: {response.status_code}"
    assert response.status_code < 500, f"{where} {response.content[:300]!r}"
    leaked = [m for m in MARKERS if m in response.content]
    assert not leaked, f"{where}: the second principal received the first one's bytes"
    if response.status_code >= 400:
        content_type = response.headers.get("content-type", [""])[0]
        assert content_type.startswith("application/json"), f"{where} {content_type}"
        error = response.json()
        # a 413 for too many items also says the route's limit
        extra = {"limit"} if response.status_code == 413 and "limit" in error else set()
        assert set(error) == {"error", "detail", *extra}, f"{where} {error}"
        assert isinstance(error["error"], str) and isinstance(error["detail"], str), where
        assert not extra or (type(error["limit"]) is int and error["limit"] > 0), where


def test_the_fuzzer_cannot_read_the_first_principals_data_by_name(
        fuzz_svc: RunningService) -> None:
    with Client(fuzz_svc.url, token=TOKEN, retries=0) as c:
        assert c.batch_get(KNOWN_KEYS, namespace=KNOWN_NS) == [None] * 3
        assert c.batch_exists(KNOWN_KEYS, namespace=KNOWN_NS) == 0
        assert c.match([*KNOWN_TOKENS, 1], KNOWN_NS)["matched_tokens"] == 0
        got = c.fetch([*KNOWN_TOKENS, 1], KNOWN_NS)
        assert got["matched_tokens"] == 0 and got["kv"] == []


def test_known_data_reads_back_byte_exact_after_fuzzing(fuzz_svc: RunningService) -> None:
    with Client(fuzz_svc.url, token=OWNER_TOKEN, retries=0) as c:
        got = c.fetch([*KNOWN_TOKENS, 1], KNOWN_NS)
        data = _known_envelopes()
        assert got["matched_tokens"] == len(KNOWN_TOKENS)
        assert got["kv"] == data["kv"] and got["state"] == data["state"]
        assert c.batch_get(KNOWN_KEYS, namespace=KNOWN_NS) == KNOWN_VALUES
