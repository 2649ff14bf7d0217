"""tierstore as a vLLM 0.33 secondary offloading tier, driven by vLLM's own code on CPU.

Each "engine" below is vLLM's real ``TieringOffloadingSpec``: its ``get_manager`` builds the
CPU primary tier (a shared-memory region) and loads ``TierStoreTier`` through the real
``SecondaryTierFactory`` by module path. The test plays the scheduler and the GPU worker: it
calls the manager as the offloading connector does (prepare/complete store, lookup, prepare
load, on_schedule_end each step) and fills/reads primary rows as the worker's DMA would. Behind
the tier runs a real ``tierstore serve`` (in-process) with a real valkey-server as its L3.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

_REASON = "vLLM 0.33 is not installed (pip install --no-deps vllm==0.33.0 'tierstore[vllm]')"
tiering_spec = pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason=_REASON)

from vllm.v1.core.kv_cache_utils import MambaSpec  # noqa: E402
from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402

from remote_tier import RemoteTierConfig  # noqa: E402
from tierstore.client import Client  # noqa: E402
from tierstore.config import StoreConfig  # noqa: E402
from tierstore.integrations.vllm import TierStoreTier, block_key  # noqa: E402
from tierstore.integrations.vllm import metrics as tier_metrics  # noqa: E402
from tierstore.service.config import ServiceConfig  # noqa: E402
from tierstore.store import TierStore  # noqa: E402
from tierstore.testing.redis_server import RedisServer  # noqa: E402
from tierstore.testing.reference_model import tiny_layout  # noqa: E402
from tierstore.testing.service import RunningService, free_port  # noqa: E402

BLOCK = 16  # tokens per block
ROW = 8192  # bytes of one block (page aligned: the primary row adds no padding)
MODULE = "tierstore.integrations.vllm"
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def full_group(group_id: int = 0) -> OffloadingGroupConfig:
    return OffloadingGroupConfig(tokens_per_block=BLOCK, group_id=group_id,
                                 layer_names=(f"model.layers.{group_id}.attn",))


def windowed_group(spec: Any, group_id: int) -> OffloadingGroupConfig:
    """A sliding-window or Mamba group, windowed as vLLM's own config builder windows it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_sliding_window_size_in_chunks,
    )
    return OffloadingGroupConfig(
        tokens_per_block=BLOCK, group_id=group_id, layer_names=(f"model.layers.{group_id}.x",),
        sliding_window_size_in_chunks=get_sliding_window_size_in_chunks(spec, BLOCK))


def swa_group(group_id: int) -> OffloadingGroupConfig:
    spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                             dtype=__import__("torch").bfloat16, sliding_window=32)
    return windowed_group(spec, group_id)


def mamba_group(group_id: int) -> OffloadingGroupConfig:
    torch = __import__("torch")
    spec = MambaSpec(block_size=BLOCK, shapes=((4, 64), (2, 16, 16)),
                     dtypes=(torch.bfloat16, torch.float32))
    return windowed_group(spec, group_id)


def offloading_config(groups: tuple[OffloadingGroupConfig, ...], tier: dict[str, Any],
                      model: str = "Qwen/Qwen3-Next-80B-A3B") -> OffloadingConfig:
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 * ROW,
             "tier_poll_interval_s": 0, "secondary_tiers": [tier]}
    return OffloadingConfig(
        groups=groups, worker_kv_bytes_per_block=ROW, enable_kv_cache_events=False,
        extra_config=extra, engine_id=f"tierstore-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False))


class Engine:
    """One vLLM instance's offloading manager, built by vLLM's spec and factory."""

    def __init__(self, url: str, groups: tuple[OffloadingGroupConfig, ...] = (full_group(),),
                 **tier_options: Any) -> None:
        tier = {"type": "TierStoreTier", "module_path": MODULE, "url": url,
                "absent_ttl_s": 0.05, "retry_down_s": 0.05, **tier_options}
        self.spec = tiering_spec.TieringOffloadingSpec(offloading_config(groups, tier))
        self.manager = self.spec.get_manager()
        self.tier: TierStoreTier = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self._req = 0

    def _ctx(self) -> ReqContext:
        self._req += 1
        ctx = ReqContext(req_id=f"req-{self._req}")
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(STEP)

    def settle(self, timeout_s: float = 30.0) -> None:
        """Step until no transfer is in flight (the connector keeps stepping meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            assert time.monotonic() < deadline, "transfers still in flight after 30 s"
            time.sleep(0.005)

    def store(self, blocks: dict[bytes, bytes]) -> None:
        """GPU -> primary (the test writes the rows the worker would), then vLLM cascades
        every stored block to the tier; returns once the cascade jobs have finished."""
        ctx = self._ctx()
        with self.manager.lock:
            out = self.manager.prepare_store(list(blocks), ctx)
        assert out is not None
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.rows[int(chunk)] = np.frombuffer(blocks[key], dtype=np.uint8)
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, ctx)
        self.settle()
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def lookup(self, keys: list[bytes], timeout_s: float = 30.0) -> list[LookupResult]:
        """Look every key up once per step, as the connector does, until each is a HIT
        (ready in primary memory) or a MISS."""
        ctx = self._ctx()
        deadline = time.monotonic() + timeout_s
        while True:
            with self.manager.lock:
                got = [self.manager.lookup(k, ctx) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in got):
                break
            assert time.monotonic() < deadline, f"lookups unresolved after 30 s: {got}"
            self.step()
            time.sleep(0.005)
        with self.manager.lock:
            self.manager.on_request_finished(ctx)
        return got

    def fetch(self, keys: list[bytes]) -> dict[bytes, bytes | None]:
        """What a request would get: each key's bytes when it is a HIT, else None."""
        found = self.lookup(keys)
        hits = [k for k, r in zip(keys, found, strict=True) if r is LookupResult.HIT]
        out: dict[bytes, bytes | None] = dict.fromkeys(keys)
        if hits:
            ctx = self._ctx()
            with self.manager.lock:
                spec = self.manager.prepare_load(hits, ctx)
            for key, chunk in zip(hits, spec.chunk_ids, strict=True):
                out[key] = self.rows[int(chunk)].tobytes()
            with self.manager.lock:
                self.manager.complete_load(hits, ctx)
                self.manager.on_request_finished(ctx)
        return out

    def close(self) -> None:
        del self.rows  # vLLM unmaps the primary region only once nothing exports it
        self.manager.shutdown()


def keys_of(prefix: str, n: int, group: int = 0) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{prefix}/{i}".encode()).digest(), group)
            for i in range(n)]


def random_blocks(keys: list[bytes], seed: int) -> dict[bytes, bytes]:
    rng = np.random.default_rng(seed)
    return {k: rng.integers(0, 256, ROW, dtype=np.uint8).tobytes() for k in keys}


def start_service(redis_server: RedisServer, port: int | None = None,
                  principals: str | None = None, max_batch: int = 4096) -> RunningService:
    config = ServiceConfig(port=port or free_port(), kv_host_bytes=4 << 20,
                           principals=principals, max_batch=max_batch)
    store = TierStore(tiny_layout(page_size=4), StoreConfig(capacity_bytes=1 << 20))
    return RunningService(store, config, RemoteTierConfig(url=redis_server.url,
                                                          key_prefix="vllm")).start()


@pytest.fixture
def svc(redis_server: RedisServer) -> Iterator[RunningService]:
    redis_server.command("FLUSHALL")
    running = start_service(redis_server)
    yield running
    running.stop()


@pytest.fixture(params=["shm", "http"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every engine test runs through the shared segment and over HTTP."""
    return str(request.param)


@pytest.fixture
def engines(transport: str) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(url: str, groups: tuple[OffloadingGroupConfig, ...] = (full_group(),),
             **options: Any) -> Engine:
        options.setdefault("transport", transport)
        made.append(Engine(url, groups, **options))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


# ------------------------------------------------------------------ loading
def test_the_factory_loads_the_tier_by_module_path(svc: RunningService,
                                                   engines: Callable[..., Engine]) -> None:
    config = {"type": "TierStoreTier", "module_path": MODULE}
    assert SecondaryTierFactory.get_tier_class(config) is TierStoreTier
    engine = engines(svc.url)
    assert isinstance(engine.tier, TierStoreTier)
    assert engine.tier.tier_type == "TierStoreTier"
    assert engine.tier.block_size_bytes == ROW
    assert engine.tier.namespace.startswith("vllm/Qwen-Qwen3-Next-80B-A3B.")
    metrics = tiering_spec.TieringOffloadingSpec.build_metric_definitions(
        dict(engine.spec.extra_config))
    assert tier_metrics.BLOCKS in metrics and tier_metrics.LOOKUPS in metrics


def test_an_unknown_tier_option_is_an_error_naming_it(svc: RunningService) -> None:
    with pytest.raises(ValueError, match="urll"):
        Engine(svc.url, urll="http://x")


# ------------------------------------------------------------------ store, lookup, load
def test_two_engines_share_blocks_byte_exact(svc: RunningService, transport: str,
                                             engines: Callable[..., Engine]) -> None:
    writer, reader = engines(svc.url), engines(svc.url)
    assert writer.tier.transport == reader.tier.transport == transport
    keys = keys_of("shared", 6)
    blocks = random_blocks(keys, seed=1)
    writer.store(blocks)
    absent = keys_of("never-stored", 2)
    got = reader.fetch(keys + absent)
    assert all(got[k] == blocks[k] for k in keys)  # byte-exact through the service
    assert got[absent[0]] is None and got[absent[1]] is None
    stats = reader.manager.get_stats().data["data"]
    assert stats[tier_metrics.BLOCKS][("load", "ok")] == 6
    assert sum(stats[tier_metrics.LOOKUPS].values()) >= 8


def test_shared_through_valkey_after_the_service_restarts(
        redis_server: RedisServer, engines: Callable[..., Engine]) -> None:
    """The service's host memory is gone after a restart; Valkey still holds every block."""
    redis_server.command("FLUSHALL")
    port = free_port()
    first = start_service(redis_server, port)
    writer = engines(first.url)
    keys = keys_of("valkey", 4)
    blocks = random_blocks(keys, seed=2)
    writer.store(blocks)
    first.stop()
    second = start_service(redis_server, port)
    try:
        reader = engines(second.url)
        assert reader.fetch(keys) == blocks
    finally:
        second.stop()


def test_lookup_asks_the_service_only_from_the_probe_thread(
        svc: RunningService, engines: Callable[..., Engine]) -> None:
    engine = engines(svc.url)
    client = engine.tier._io.client
    threads: list[str] = []
    probe = client.exists_each

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return probe(*args, **kwargs)

    client.exists_each = recording  # type: ignore[attr-defined]
    keys = keys_of("probe", 40)
    assert engine.lookup(keys) == [LookupResult.MISS] * 40
    assert threads and set(threads) == {"tierstore-vllm-probe"}
    assert len(threads) < 40  # batched, not one request per block


# ------------------------------------------------------------------ hybrid models
@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_hybrid_groups_round_trip_each_group_byte_exact(
        svc: RunningService, engines: Callable[..., Engine], kind: str) -> None:
    other = swa_group(1) if kind == "swa" else mamba_group(1)
    groups = (full_group(0), other)
    assert other.sliding_window_size_in_chunks == (2 if kind == "swa" else 1)
    writer, reader = engines(svc.url, groups), engines(svc.url, groups)
    full, second = keys_of(kind, 4, group=0), keys_of(kind, 4, group=1)
    blocks = random_blocks(full + second, seed=3)  # same hashes, different bytes per group
    writer.store(blocks)
    assert reader.fetch(full + second) == blocks
    assert block_key(full[0]) != block_key(second[0])


def test_a_partial_group_is_never_served_as_a_hit(
        svc: RunningService, engines: Callable[..., Engine]) -> None:
    groups = (full_group(0), mamba_group(1))
    writer, reader = engines(svc.url, groups), engines(svc.url, groups)
    full, state = keys_of("partial", 3, group=0), keys_of("partial", 3, group=1)
    blocks = random_blocks(full + state[:2], seed=4)  # the last state block never stored
    writer.store(blocks)
    # A torn value (half a block) under the state key of the second block.
    with Client(svc.url) as client:
        assert client.batch_set([block_key(state[1])], [blocks[state[1]][:ROW // 2]],
                                reader.tier.namespace) == [True]
    got = reader.fetch(full + state)
    assert [got[k] for k in full] == [blocks[k] for k in full]
    assert got[state[0]] == blocks[state[0]]
    assert got[state[1]] is None  # present but torn: the load fails, never served
    assert got[state[2]] is None  # absent
    assert reader.lookup([state[1]]) == [LookupResult.MISS]


# ------------------------------------------------------------------ faults
def warm(engine: Engine, keys: list[bytes]) -> None:
    """Let the tier's presence cache learn that ``keys`` are stored (no load yet)."""
    ctx = ReqContext(req_id="warm")
    deadline = time.monotonic() + 30
    while any(engine.tier.lookup(k, ctx) is not LookupResult.HIT for k in keys):
        assert time.monotonic() < deadline, "the probe never found the stored keys"
        time.sleep(0.005)


def test_a_service_restart_mid_load_fails_the_job_never_wrong_bytes(
        redis_server: RedisServer, engines: Callable[..., Engine]) -> None:
    redis_server.command("FLUSHALL")
    port = free_port()
    running = start_service(redis_server, port)
    writer, reader = engines(running.url), engines(running.url, max_batch=2)
    keys = keys_of("restart", 6)
    blocks = random_blocks(keys, seed=5)
    writer.store(blocks)
    warm(reader, keys)
    # The load moves two blocks per request; the service stops after the first request.
    io, requests = reader.tier._io, [0]
    request = io.request

    def then_stop(default: Any, fn: Callable[[], Any]) -> Any:
        result = request(default, fn)
        requests[0] += 1
        if requests[0] == 1:
            running.stop()
        return result

    io.request = then_stop  # type: ignore[method-assign]
    got = reader.fetch(keys)
    io.request = request  # type: ignore[method-assign]
    assert all(got[k] is None or got[k] == blocks[k] for k in keys)  # never wrong bytes
    assert [got[k] is not None for k in keys] == [True, True, False, False, False, False]
    stats = reader.manager.get_stats().data["data"]
    assert stats[tier_metrics.BLOCKS][("load", "failed")] == 4
    assert stats["vllm:kv_offload_tiering_promotion_job_failures"]
    restarted = start_service(redis_server, port)
    try:
        # A block whose load failed is a miss for ``absent_ttl_s``, then found in Valkey.
        deadline = time.monotonic() + 30
        got = reader.fetch(keys)
        while any(v is None for v in got.values()):
            assert time.monotonic() < deadline, "blocks not found again after the restart"
            got = reader.fetch(keys)
        assert got == blocks
    finally:
        restarted.stop()


def test_a_store_while_the_service_is_down_is_a_failed_job_and_then_backpressure(
        redis_server: RedisServer, engines: Callable[..., Engine]) -> None:
    redis_server.command("FLUSHALL")
    running = start_service(redis_server)
    backpressure = {"backpressure_cls": "EMABackpressureDetector", "failure_threshold": 2,
                    "policy_cls": "DropStorePolicy"}
    writer = engines(running.url, backpressure=backpressure)
    reader = engines(running.url)
    running.stop()
    submitted: list[int] = []
    submit = writer.tier.submit_store

    def counting(job: Any) -> None:
        submitted.append(job.job_id)
        submit(job)

    writer.tier.submit_store = counting  # type: ignore[method-assign,assignment]
    for i in range(4):
        writer.store(random_blocks(keys_of(f"down-{i}", 2), seed=10 + i))
    assert len(submitted) == 2  # two failed jobs put the tier under pressure: stores dropped
    stats = writer.manager.get_stats().data["data"]
    assert stats[tier_metrics.BLOCKS][("store", "failed")] == 4
    assert stats["vllm:kv_offload_tiering_backpressure_stores_dropped"]
    restarted = start_service(redis_server, int(running.url.rsplit(":", 1)[1]))
    try:
        assert reader.lookup(keys_of("down-0", 2)) == [LookupResult.MISS] * 2
    finally:
        restarted.stop()


def test_lookups_miss_while_the_service_is_down(redis_server: RedisServer,
                                               engines: Callable[..., Engine]) -> None:
    """An unreachable service is a miss (vLLM recomputes), never a request held in RETRY."""
    running = start_service(redis_server)
    engine = engines(running.url)
    running.stop()
    assert engine.lookup(keys_of("down", 5)) == [LookupResult.MISS] * 5
    assert engine.tier.presence.num_probe_failures >= 1


# ------------------------------------------------------------------ tenants
def test_tenants_do_not_share_blocks(redis_server: RedisServer, tmp_path: Path,
                                     engines: Callable[..., Engine]) -> None:
    redis_server.command("FLUSHALL")
    tokens = {"alpha": "alpha-token-" + "a" * 20, "beta": "beta-token-" + "b" * 20}
    tenants = {name: {"tokens": ["sha256:" + hashlib.sha256(tok.encode()).hexdigest()],
                      "namespaces": ["vllm/*"]} for name, tok in tokens.items()}
    path = tmp_path / "principals.json"
    path.write_text(json.dumps({"tenants": tenants}))
    running = start_service(redis_server, principals=str(path))
    try:
        alpha = engines(running.url, auth_token=tokens["alpha"])
        alpha_again = engines(running.url, auth_token=tokens["alpha"])
        beta = engines(running.url, auth_token=tokens["beta"])
        keys = keys_of("tenant", 3)
        blocks = random_blocks(keys, seed=7)
        alpha.store(blocks)
        assert beta.lookup(keys) == [LookupResult.MISS] * 3
        assert alpha_again.fetch(keys) == blocks
    finally:
        running.stop()


# ------------------------------------------------------------------ batched jobs
def load_jobs(keys: list[Any], per_job: int, first_row: int, first_id: int) -> list[Any]:
    """Load jobs as vLLM's tiering manager submits them, straight to the tier."""
    from vllm.v1.kv_offload.tiering.base import TransferJob
    ctx = ReqContext(req_id=f"jobs-{first_id}")
    return [TransferJob(job_id=first_id + j, keys=keys[s:s + per_job],
                        chunk_ids=np.arange(first_row + s, first_row + s + per_job,
                                            dtype=np.int32), is_promotion=True, req_context=ctx)
            for j, s in enumerate(range(0, len(keys), per_job))]


def finished(tier: TierStoreTier, count: int) -> dict[int, Any]:
    """The tier's results of ``count`` jobs, by job id (each reported exactly once)."""
    out: dict[int, Any] = {}
    deadline = time.monotonic() + 30
    while len(out) < count:
        for result in tier.get_finished_jobs():
            assert result.job_id not in out, f"job {result.job_id} reported twice"
            out[result.job_id] = result
        assert time.monotonic() < deadline, f"only {len(out)} of {count} jobs reported"
        time.sleep(0.005)
    assert not list(tier.get_finished_jobs())
    return out


def test_queued_loads_share_a_request_and_each_job_reports(
        svc: RunningService, engines: Callable[..., Engine], transport: str) -> None:
    writer, reader = engines(svc.url), engines(svc.url, load_threads=1)
    keys = keys_of("batched", 12)
    blocks = random_blocks(keys, seed=11)
    writer.store(blocks)
    tier, gate, sizes = reader.tier, threading.Event(), []
    load = tier._load

    def held(names: list[bytes], rows: np.ndarray) -> list[bool]:
        sizes.append(len(names))
        assert gate.wait(30)
        return load(names, rows)

    tier._load = held  # type: ignore[method-assign,assignment]
    jobs = load_jobs(keys, 3, 40, 100)
    tier.submit_load(jobs[0])
    deadline = time.monotonic() + 30
    while not sizes:  # the one load thread holds the first job; the others queue meanwhile
        assert time.monotonic() < deadline, "the load thread never took the first job"
        time.sleep(0.005)
    for job in jobs[1:]:
        tier.submit_load(job)
    gate.set()
    results = finished(tier, 4)
    # Through the segment the three queued jobs went as one batch; over HTTP one by one.
    assert sizes == ([3, 9] if transport == "shm" else [3, 3, 3, 3])
    assert all(r.success and r.transfer_bytes == 3 * ROW for r in results.values())
    assert [reader.rows[40 + i].tobytes() for i in range(12)] == [blocks[k] for k in keys]
    if transport == "shm":  # the idle load thread ended the deferred read leases
        deadline = time.monotonic() + 30
        while svc.service.kv.stats()["shm_leases"]:
            assert time.monotonic() < deadline, "read leases still held after the loads"
            time.sleep(0.01)


def test_a_service_with_a_small_max_batch_fails_no_job(
        redis_server: RedisServer, engines: Callable[..., Engine], transport: str) -> None:
    """A service that takes 4 keys (and lease ids) a request, a tier that sends up to 256 by
    default: the tier learns the service's limit (the attach answer, or /v1/stats over HTTP)
    and every store, probe and load job succeeds, byte-exact (they were 413s: failed jobs)."""
    redis_server.command("FLUSHALL")
    running = start_service(redis_server, max_batch=4)
    try:
        writer = engines(running.url)
        reader = engines(running.url, load_threads=2)
        assert reader.tier._io.max_batch == 4
        keys = keys_of("small-batch", 24)
        blocks = random_blocks(keys, seed=21)
        writer.store(blocks)  # one store job of 24 blocks
        stats = writer.manager.get_stats().data["data"]
        assert stats[tier_metrics.BLOCKS][("store", "ok")] == 24
        assert reader.lookup(keys) == [LookupResult.HIT] * 24  # probes of <= 4 keys
        reader.rows[0:24] = 0
        jobs = load_jobs(keys, 6, 0, 300)  # jobs of 6 blocks, and queued ones batched
        for job in jobs:
            reader.tier.submit_load(job)
        results = finished(reader.tier, len(jobs))
        assert all(r.success for r in results.values())
        assert [reader.rows[i].tobytes() for i in range(24)] == [blocks[k] for k in keys]
        deadline = time.monotonic() + 30
        while running.service.kv.stats()["shm_leases"]:  # the deferred leases all ended
            assert time.monotonic() < deadline, "read leases still held after the loads"
            time.sleep(0.01)
    finally:
        running.stop()


def store_probe_and_load(writer: Engine, reader: Engine, prefix: str, seed: int) -> None:
    """24 blocks stored as one job, probed, loaded as jobs of 6: every job succeeds (none is
    the job a 413 failed), byte-exact."""
    keys = keys_of(prefix, 24)
    blocks = random_blocks(keys, seed=seed)
    writer.manager.get_stats()  # the counters start from here
    writer.store(blocks)
    stats = writer.manager.get_stats().data["data"]
    assert stats[tier_metrics.BLOCKS] == {("store", "ok"): 24}
    assert reader.lookup(keys) == [LookupResult.HIT] * 24
    reader.rows[0:24] = 0
    jobs = load_jobs(keys, 6, 0, 400)
    for job in jobs:
        reader.tier.submit_load(job)
    results = finished(reader.tier, len(jobs))
    assert all(r.success for r in results.values())
    assert [reader.rows[i].tobytes() for i in range(24)] == [blocks[k] for k in keys]


def test_a_restart_with_a_smaller_max_batch_fails_no_job(
        redis_server: RedisServer, engines: Callable[..., Engine],
        caplog: pytest.LogCaptureFixture) -> None:
    """The service restarts taking 4 keys a request where it took 4096, unseen by tiers
    that learned 4096: the first request past 4 is refused (413, naming the limit) and
    resent in parts of 4, so its job succeeds, as every later one."""
    redis_server.command("FLUSHALL")
    port = free_port()
    first = start_service(redis_server, port)
    writer, reader = engines(first.url), engines(first.url, load_threads=2)
    assert (writer.tier._io.max_batch, reader.tier._io.max_batch) == (256, 256)
    first.stop()
    second = start_service(redis_server, port, max_batch=4)
    try:
        store_probe_and_load(writer, reader, "restart-small", seed=22)
        assert (writer.tier._io.max_batch, reader.tier._io.max_batch) == (4, 4)
        assert any("keys in one request" in r.getMessage() for r in caplog.records)
    finally:
        second.stop()


def test_a_tier_started_before_its_service_learns_its_max_batch(
        redis_server: RedisServer, engines: Callable[..., Engine]) -> None:
    """Nothing answers when the tiers start; then a service taking 4 keys a request does:
    they learn its limit on the first call that reaches it, and no job fails."""
    redis_server.command("FLUSHALL")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    writer, reader = engines(url), engines(url, load_threads=2)
    late = start_service(redis_server, port, max_batch=4)
    try:
        store_probe_and_load(writer, reader, "late-small", seed=23)
        assert (writer.tier._io.max_batch, reader.tier._io.max_batch) == (4, 4)
    finally:
        late.stop()


def test_a_restart_mid_batch_fails_the_jobs_it_cut_never_wrong_bytes(
        redis_server: RedisServer, engines: Callable[..., Engine]) -> None:
    redis_server.command("FLUSHALL")
    running = start_service(redis_server)
    writer = engines(running.url)
    reader = engines(running.url, load_threads=1, max_batch=3)
    keys = keys_of("cut", 12)
    blocks = random_blocks(keys, seed=13)
    writer.store(blocks)
    io, requests = reader.tier._io, [0]
    request = io.request

    def then_stop(default: Any, fn: Callable[[], Any]) -> Any:
        result = request(default, fn)
        requests[0] += 1
        if requests[0] == 1:
            running.stop()
        return result

    io.request = then_stop  # type: ignore[method-assign]
    reader.rows[40:52] = 0
    for job in load_jobs(keys, 3, 40, 200):
        reader.tier.submit_load(job)
    results = finished(reader.tier, 4)
    io.request = request  # type: ignore[method-assign]
    # Requests of 3 blocks; the service stopped after the first: job 200 arrived whole,
    # the rest failed (vLLM recomputes them) and their rows were never written.
    assert [results[200 + j].success for j in range(4)] == [True, False, False, False]
    assert all(results[200 + j].successful_keys is None for j in range(1, 4))
    assert [reader.rows[40 + i].tobytes() for i in range(3)] == [blocks[k] for k in keys[:3]]
    assert not reader.rows[43:52].any()


# ------------------------------------------------------------------ bench
def test_bench_runs_small(redis_bin: str) -> None:
    """Every contender stores and loads (bytes checked inside) and the ratios are reported."""
    import argparse

    from tierstore.bench import vllm as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args(["--presets", "nemotron-h-8b", "--blocks", "4",
                                          "--job-blocks", "2", "--rounds", "1"]))
    (preset,) = result["presets"]
    assert result["available"] and preset["block_bytes"] == 256 << 10
    assert [r["tier"] for r in preset["rows"]] == [
        "fs", "tierstore shm", "tierstore http", "tierstore shm, no L3"]
    assert all(r["store_blocks_s"] > 0 and r["load_blocks_s"] > 0 for r in preset["rows"])
    assert preset["page_cache"] in ("drop_caches", "fadvise")
    vs = preset["vs_fs"]["tierstore shm"]
    assert len(vs["load_rounds"]) == 1 and vs["load_min"] == vs["load"] > 0
    assert "tierstore shm / fs, per round median (min): store" in bench.render(result)
