"""tierstore as SGLang HiCache's L3 backend, created through SGLang's own factory, against a
real ``tierstore serve`` (in-process) with a real redis-server behind its storage API.

SGLang's host pools cannot be built on a CPU machine (their module imports the serving stack),
so the v1/v2 paths run against small stand-ins that keep SGLang's host-pool contract:
``get_data_page`` / ``get_dummy_flat_data_page`` / ``set_from_flat_data_page`` over a
``page_first`` KV buffer, and a Mamba-like state pool of one byte page per slot.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

hicache = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
factory = pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from remote_tier import RemoteTierConfig  # noqa: E402
from tierstore.config import StoreConfig  # noqa: E402
from tierstore.integrations.sglang import TierStoreHiCacheStorage  # noqa: E402
from tierstore.service.config import ServiceConfig  # noqa: E402
from tierstore.store import TierStore  # noqa: E402
from tierstore.testing.redis_server import RedisServer  # noqa: E402
from tierstore.testing.reference_model import tiny_layout  # noqa: E402
from tierstore.testing.service import RunningService, free_port  # noqa: E402

PoolName, PoolHitPolicy = hicache.PoolName, hicache.PoolHitPolicy
PoolTransfer = hicache.PoolTransfer
PAGE = 4  # tokens per page
TOKEN = "l3-token"


class KVHostPool:
    """Stand-in for SGLang's MHA host pool: ``kv_buffer[2, slots, layers, heads, dim]``
    (``page_first``) or ``[2, layers, slots, heads, dim]`` (``layer_first``)."""

    def __init__(self, slots: int = 64, layers: int = 3, heads: int = 2, dim: int = 8,
                 dtype: torch.dtype = torch.bfloat16, layout: str = "page_first") -> None:
        self.page_size, self.layer_num, self.head_num, self.head_dim = PAGE, layers, heads, dim
        self.dtype, self.layout = dtype, layout
        self.size_per_token = 2 * layers * heads * dim * dtype.itemsize
        shape = (2, slots, layers, heads, dim) if layout == "page_first" else \
            (2, layers, slots, heads, dim)
        self.kv_buffer = torch.zeros(shape, dtype=dtype)

    def _page(self, index: int) -> torch.Tensor:
        rows = slice(index, index + self.page_size)
        return self.kv_buffer[:, rows] if self.layout == "page_first" else \
            self.kv_buffer[:, :, rows]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * self.size_per_token // self.dtype.itemsize,
                           dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g))


class StateHostPool:
    """Stand-in for SGLang's Mamba host pool: one uint8 state page per slot."""

    def __init__(self, slots: int = 16, nbytes: int = 96) -> None:
        self.page_size, self.size_per_token = 1, nbytes
        self.states = torch.zeros((slots, nbytes), dtype=torch.uint8)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.states[index].clone()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.size_per_token, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.states[index].copy_(data_page.view(torch.uint8))


def page_keys(prefix: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{prefix}/{i}".encode()).hexdigest() for i in range(n)]


def pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGE * 48, generator=g).to(torch.bfloat16) for _ in range(n)]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bytes(a.contiguous().view(torch.uint8).numpy()) == \
        bytes(b.contiguous().view(torch.uint8).numpy())


def start_service(redis_server: RedisServer, port: int | None = None,
                  token: str | None = None, max_batch: int = 4096) -> RunningService:
    config = ServiceConfig(port=port or free_port(), auth_token=token, kv_host_bytes=1 << 20,
                           max_batch=max_batch)
    store = TierStore(tiny_layout(page_size=PAGE), StoreConfig(capacity_bytes=1 << 20))
    kv_remote = RemoteTierConfig(url=redis_server.url, key_prefix="sgl")
    return RunningService(store, config, kv_remote).start()


@pytest.fixture
def svc(redis_server: RedisServer) -> Iterator[RunningService]:
    redis_server.command("FLUSHALL")
    running = start_service(redis_server)
    yield running
    running.stop()


Factory = Callable[..., Any]


@pytest.fixture(params=["shm", "http"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every adapter test runs through the shared segment and over HTTP."""
    return str(request.param)


@pytest.fixture
def make_backend(svc: RunningService, transport: str) -> Iterator[Factory]:
    """Backends built exactly as SGLang builds a ``dynamic`` one; closed after the test."""
    made: list[Any] = []

    def make(url: str | None = None, tp_rank: int = 0, tp_size: int = 2,
             model: str = "Qwen/Qwen3-8B", mla: bool = False, **extra: Any) -> Any:
        extra.setdefault("transport", transport)
        config = hicache.HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
            attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
            is_page_first_layout=True, model_name=model,
            extra_config={"backend_name": "tierstore",
                          "module_path": "tierstore.integrations.sglang",
                          "class_name": "TierStoreHiCacheStorage", "url": url or svc.url,
                          "retry_down_s": 0.2, **extra})
        backend = factory.StorageBackendFactory.create_backend("dynamic", config, None)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


# ------------------------------------------------------------------ generic path
def test_factory_builds_a_hicache_storage(make_backend: Factory, transport: str) -> None:
    backend = make_backend()
    assert backend.transport == transport  # the in-process service is on this host
    assert isinstance(backend, hicache.HiCacheStorage)
    assert isinstance(backend, TierStoreHiCacheStorage)
    assert backend.namespace.startswith("sglang/Qwen-Qwen3-8B/tp0of2.")


def test_set_get_round_trip_bytes_identical(make_backend: Factory) -> None:
    backend = make_backend()
    keys, data = page_keys("rt", 5), pages(5, seed=1)
    assert backend.set(keys[0], data[0])
    assert backend.batch_set(keys[1:], data[1:])
    targets = [torch.empty_like(p) for p in data]
    got = backend.batch_get(keys, targets)
    assert all(g is t for g, t in zip(got, targets, strict=True))
    assert all(same_bytes(g, p) for g, p in zip(got, data, strict=True))
    fresh = backend.get(keys[2])  # no target, no host pool: the raw bytes
    assert fresh is not None and same_bytes(fresh, data[2])
    assert backend.get("0" * 64) is None
    assert backend.exists(keys[4]) and not backend.exists("f" * 64)


def test_worker_threads_share_one_backend(make_backend: Factory) -> None:
    backend = make_backend()
    errors: list[str] = []

    def worker(n: int) -> None:
        keys, data = page_keys(f"thread-{n}", 6), pages(6, seed=100 + n)
        for _ in range(3):
            if not backend.batch_set(keys, data):
                errors.append(f"{n}: set")
            got = backend.batch_get(keys)
            if not all(g is not None and same_bytes(g, d)
                       for g, d in zip(got, data, strict=True)):
                errors.append(f"{n}: get")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert backend.set("c" * 64, None) is False  # misuse is a False too, not an exception


def test_batch_exists_counts_consecutive_hits(make_backend: Factory) -> None:
    backend = make_backend()
    keys, data = page_keys("prefix", 7), pages(7, seed=2)
    assert backend.batch_set(keys[:4] + keys[5:6], data[:4] + data[5:6])
    assert backend.batch_exists(keys) == 4
    assert backend.batch_exists(keys[:3]) == 3
    assert backend.batch_exists(keys[4:]) == 0
    assert backend.batch_exists([]) == 0


def test_clear_removes_what_it_stored(make_backend: Factory) -> None:
    backend = make_backend()
    keys = page_keys("clear", 3)
    assert backend.batch_set(keys, pages(3, seed=3))
    assert backend.clear() is True
    assert backend.batch_exists(keys) == 0


def test_stats_count_pages_and_bytes(make_backend: Factory) -> None:
    backend = make_backend()
    keys, data = page_keys("stats", 4), pages(4, seed=4)
    backend.batch_set(keys, data)
    backend.batch_get(keys + ["0" * 64])
    stats = backend.get_stats()
    assert stats.backup_pgs == [4] and stats.prefetch_pgs == [5]
    assert stats.tierstore["get_hits"] == 4 and stats.tierstore["set_stored"] == 4
    assert stats.tierstore["set_bytes"] == sum(p.numel() * 2 for p in data)
    assert backend.get_stats().backup_pgs == []  # the lists drain; the totals stay


# ------------------------------------------------------------------ v1: the host pool
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v1_round_trip_through_the_host_pool(make_backend: Factory, layout: str) -> None:
    backend = make_backend()
    pool = KVHostPool(layout=layout)
    backend.register_mem_pool_host(pool)
    pool.fill_random(seed=5)
    keys = page_keys(f"v1-{layout}", 3)
    src = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23, 36, 37, 38, 39])
    expected = [pool.get_data_page(int(i)).clone() for i in src[::PAGE]]
    assert backend.batch_set_v1(keys, src) == [True] * 3

    dst = torch.arange(44, 56)
    assert backend.batch_get_v1(keys, dst) == [True] * 3
    for i, page in zip(dst[::PAGE], expected, strict=True):
        assert same_bytes(pool.get_data_page(int(i)), page)
    generic = backend.batch_get(keys)  # v1 pages are flat data pages: the generic path reads them
    assert all(same_bytes(g, e) for g, e in zip(generic, expected, strict=True))
    assert all(g.dtype == torch.bfloat16 and g.numel() == e.numel()
               for g, e in zip(generic, expected, strict=True))
    assert backend.batch_get_v1(keys + ["0" * 64], torch.arange(0, 16)) == [True] * 3 + [False]


def test_v1_rejects_misshapen_calls_and_pages_without_raising(make_backend: Factory) -> None:
    backend = make_backend()
    assert backend.batch_get_v1(["a" * 64], torch.arange(PAGE)) == [False]  # no pool yet
    pool = KVHostPool()
    backend.register_mem_pool_host(pool)
    assert backend.batch_set_v1(page_keys("x", 2), torch.arange(PAGE)) == [False, False]
    short = page_keys("short", 1)
    assert backend.set(short[0], torch.zeros(7, dtype=torch.uint8))  # not a page of this pool
    before = pool.kv_buffer.clone()
    assert backend.batch_get_v1(short, torch.arange(PAGE)) == [False]
    assert torch.equal(pool.kv_buffer, before)


# ------------------------------------------------------------------ v2: hybrid pools
@pytest.fixture
def hybrid(make_backend: Factory) -> tuple[Any, KVHostPool, StateHostPool, StateHostPool]:
    backend = make_backend()
    kv, mamba, swa = KVHostPool(), StateHostPool(), StateHostPool(nbytes=40)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    return backend, kv, mamba, swa


def transfer(name: Any, keys: list[str], slots: list[int], policy: Any) -> Any:
    return PoolTransfer(name=name, keys=keys, host_indices=torch.tensor(slots), hit_policy=policy)


def test_v2_round_trip_and_trailing_pages(hybrid: tuple[Any, ...]) -> None:
    backend, kv, mamba, _ = hybrid
    keys = page_keys("v2", 6)
    kv.fill_random(seed=6)
    assert backend.batch_set_v1(keys[:5], torch.arange(5 * PAGE)) == [True] * 5
    mamba.states[1:4] = torch.randint(0, 256, (3, 96), dtype=torch.uint8)
    trailing = PoolHitPolicy.TRAILING_PAGES
    for slot, page in ((1, 1), (2, 3), (3, 5)):  # state after pages 2, 4 and 6
        result = backend.batch_set_v2([transfer(PoolName.MAMBA, [keys[page]], [slot], trailing)])
        assert result == {PoolName.MAMBA: [True]}

    got = backend.batch_get_v2([transfer(PoolName.MAMBA, [keys[3]], [9], trailing)])
    assert got == {PoolName.MAMBA: [True]} and torch.equal(mamba.states[9], mamba.states[2])

    # KV holds 5 pages: the state at 6 has no KV prefix, so 4 is the longest usable one.
    query = [transfer(PoolName.MAMBA, [keys[5]], [0], trailing)]
    result = backend.batch_exists_v2(keys, query)
    assert result.kv_hit_pages == 4 and result.restorable_prefix_pages == [2, 4]
    assert result.extra_pool_hit_pages[PoolName.KV] == 5
    assert result.extra_pool_hit_pages[PoolName.MAMBA] == 4
    assert backend.batch_exists_v2(keys[:3], query).kv_hit_pages == 2
    assert backend.batch_exists_v2(keys[:1], query).kv_hit_pages == 0
    assert backend.batch_exists_v2(keys).kv_hit_pages == 5  # KV alone


def test_v2_trailing_window_and_all_pages(hybrid: tuple[Any, ...]) -> None:
    backend, _, _, swa = hybrid
    keys = page_keys("swa", 6)
    assert backend.batch_set_v1(keys, torch.arange(6 * PAGE)) == [True] * 6
    swa.states[:6] = torch.randint(0, 256, (6, 40), dtype=torch.uint8)
    ok = backend.batch_set_v2([transfer(PoolName.SWA, keys[1:3], [1, 2],
                                        PoolHitPolicy.TRAILING_PAGES)])
    assert ok == {PoolName.SWA: [True, True]}
    # A two-page window must end where both of its pages are stored: only at 3.
    window = [transfer(PoolName.SWA, keys[4:6], [0, 1], PoolHitPolicy.TRAILING_PAGES)]
    result = backend.batch_exists_v2(keys, window)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (3, [3])
    # all_pages: every page of the prefix, from the first: pages 0..2 are missing page 0.
    every = [transfer(PoolName.SWA, keys, list(range(6)), PoolHitPolicy.ALL_PAGES)]
    assert backend.batch_exists_v2(keys, every).kv_hit_pages == 0
    backend.batch_set_v2([transfer(PoolName.SWA, keys[:1], [0], PoolHitPolicy.ALL_PAGES)])
    result = backend.batch_exists_v2(keys, every)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (3, [1, 2, 3])
    # A trailing pool and an all_pages pool must agree on one end.
    both = backend.batch_exists_v2(keys, every + window)
    assert both.kv_hit_pages == 3


def test_v2_existence_answers_as_sglangs_file_backend(
    hybrid: tuple[Any, ...], tmp_path: Any,
) -> None:
    """The same pages present in tierstore and in SGLang's own HiCacheFile (its files made
    directly): batch_exists_v2 must give the same hit pages and restorable lengths, which
    SGLang intersects across TP ranks."""
    backend = hybrid[0]
    config = hicache.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="m", extra_config={"file_storage_path": str(tmp_path)})
    reference = factory.StorageBackendFactory.create_backend("file", config, None)
    rng = torch.Generator().manual_seed(11)
    for case in range(12):
        n = 8
        keys = page_keys(f"ref{case}", n)
        kv_have = n if case % 3 else int(torch.randint(0, n + 1, (1,), generator=rng))
        have = {name: [i for i in range(n) if bool(torch.rand(1, generator=rng) < 0.6)]
                for name in (PoolName.MAMBA, PoolName.SWA)}
        backend.batch_set_v1(keys[:kv_have], torch.arange(kv_have * PAGE))
        for name, idx in have.items():
            if idx:
                backend.batch_set_v2([transfer(name, [keys[i] for i in idx], [0] * len(idx),
                                               PoolHitPolicy.TRAILING_PAGES)])
        for path in ([reference._get_component_key(k) for k in keys[:kv_have]]
                     + [reference._get_component_key(keys[i], name)
                        for name, idx in have.items() for i in idx]):
            (tmp_path / f"{path}.bin").write_bytes(b"x")
        queries = [
            [transfer(PoolName.MAMBA, keys[-1:], [0], PoolHitPolicy.TRAILING_PAGES)],
            [transfer(PoolName.SWA, keys[-3:], [0, 1, 2], PoolHitPolicy.TRAILING_PAGES)],
            [transfer(PoolName.MAMBA, keys[-1:], [0], PoolHitPolicy.TRAILING_PAGES),
             transfer(PoolName.SWA, keys[-2:], [0, 1], PoolHitPolicy.TRAILING_PAGES)],
            [transfer(PoolName.SWA, keys, list(range(n)), PoolHitPolicy.ALL_PAGES)],
        ]
        for query in queries:
            ours, theirs = backend.batch_exists_v2(keys, query), \
                reference.batch_exists_v2(keys, query)
            assert (ours.kv_hit_pages, ours.restorable_prefix_pages) == \
                (theirs.kv_hit_pages, theirs.restorable_prefix_pages), (case, have, kv_have)
            assert ours.extra_pool_hit_pages == theirs.extra_pool_hit_pages, (case, have)


def test_v2_unregistered_pool_is_a_miss(make_backend: Factory) -> None:
    backend = make_backend()
    backend.register_mem_pool_host(KVHostPool())
    keys = page_keys("unreg", 2)
    backend.batch_set_v1(keys, torch.arange(2 * PAGE))
    query = [transfer(PoolName.MAMBA, keys[1:], [0], PoolHitPolicy.TRAILING_PAGES)]
    assert backend.batch_exists_v2(keys, query).kv_hit_pages == 0
    assert backend.batch_get_v2(query) == {PoolName.MAMBA: [False]}


# ------------------------------------------------------------------ namespaces
def test_deployments_never_see_each_others_pages(make_backend: Factory) -> None:
    writer = make_backend(tp_rank=0)
    keys, data = page_keys("iso", 3), pages(3, seed=7)
    assert writer.batch_set(keys, data)
    for other in (make_backend(tp_rank=1), make_backend(tp_size=4),
                  make_backend(model="meta-llama/Llama-3.1-8B"),
                  make_backend(namespace="tenant-b")):
        assert other.namespace != writer.namespace
        assert other.batch_exists(keys) == 0 and other.get(keys[0]) is None
    twin = make_backend(tp_rank=0)  # the same deployment (e.g. after a restart) shares them
    assert twin.batch_exists(keys) == 3

    a, b = make_backend(), make_backend()  # same config, different host-pool layouts
    a.register_mem_pool_host(KVHostPool(dtype=torch.bfloat16))
    b.register_mem_pool_host(KVHostPool(dtype=torch.float16))
    assert a.namespace != b.namespace
    a.batch_set_v1(keys, torch.arange(3 * PAGE))
    assert b.batch_exists(keys) == 0


def test_mla_kv_is_shared_across_tp_ranks_but_state_is_not(make_backend: Factory) -> None:
    rank0, rank1 = make_backend(mla=True, tp_rank=0), make_backend(mla=True, tp_rank=1)
    keys = page_keys("mla", 2)
    assert rank0.batch_set(keys, pages(2, seed=8))
    assert rank1.batch_exists(keys) == 2
    for backend in (rank0, rank1):
        backend.register_mem_pool_host(KVHostPool())
        backend.register_mem_host_pool_v2(StateHostPool(), PoolName.MAMBA)
    trailing = PoolHitPolicy.TRAILING_PAGES
    rank0.batch_set_v2([transfer(PoolName.MAMBA, keys[1:], [0], trailing)])
    query = [transfer(PoolName.MAMBA, keys[1:], [0], trailing)]
    rank0.batch_set_v1(keys, torch.arange(2 * PAGE))
    assert rank0.batch_exists_v2(keys, query).kv_hit_pages == 2
    assert rank1.batch_exists_v2(keys, query).kv_hit_pages == 0


# ------------------------------------------------------------------ faults
def test_service_down_means_misses_then_recovers(make_backend: Factory,
                                                 redis_server: RedisServer, transport: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    first = start_service(redis_server)
    backend = make_backend(url=first.url, retry_down_s=0.2)
    pool = KVHostPool()
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(StateHostPool(), PoolName.MAMBA)
    keys, data = page_keys("down", 3), pages(3, seed=9)
    assert backend.batch_set(keys, data)
    first.stop()

    started = time.monotonic()
    trailing = [transfer(PoolName.MAMBA, keys[2:], [0], PoolHitPolicy.TRAILING_PAGES)]
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get(keys) == [None] * 3
    assert backend.get(keys[0]) is None and not backend.exists(keys[0])
    assert backend.set("e" * 64, data[0]) is False
    assert backend.batch_set(page_keys("new", 2), data[:2]) is False
    assert backend.batch_get_v1(keys, torch.arange(3 * PAGE)) == [False] * 3
    assert backend.batch_set_v1(keys, torch.arange(3 * PAGE)) == [False] * 3
    assert backend.batch_exists_v2(keys, trailing).kv_hit_pages == 0
    assert backend.batch_get_v2(trailing) == {PoolName.MAMBA: [False]}
    assert backend.batch_set_v2(trailing) == {PoolName.MAMBA: [False]}
    assert backend.clear() is False
    assert time.monotonic() - started < 5, "a down service must answer misses quickly"
    down_lines = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(down_lines) == 1, "one rate-limited line, not one per call"

    second = start_service(redis_server, port=first.config.port)  # same port, same Redis
    try:
        deadline = time.monotonic() + 10
        while backend.batch_exists(keys) != 3:
            assert time.monotonic() < deadline, "never recovered after the restart"
            time.sleep(0.1)
        got = backend.batch_get(keys)
        assert all(g is not None and same_bytes(g, d) for g, d in zip(got, data, strict=True))
        assert second.service.kv.stats()["hits_redis"] == 3  # a new service: Redis had them
        assert backend.batch_set(page_keys("after", 2), data[:2])
        assert backend.transport == transport  # re-attached to the new service's segment
    finally:
        second.stop()


def test_auth_token(make_backend: Factory, redis_server: RedisServer) -> None:
    guarded = start_service(redis_server, token=TOKEN)
    try:
        good = make_backend(url=guarded.url, auth_token=TOKEN)
        bad = make_backend(url=guarded.url)
        keys = page_keys("auth", 1)
        assert good.batch_set(keys, pages(1, seed=10)) and good.batch_exists(keys) == 1
        assert bad.batch_exists(keys) == 0 and bad.set("d" * 64, pages(1, seed=11)[0]) is False
    finally:
        guarded.stop()


@pytest.mark.parametrize("transport", ["shm"])
def test_pages_cross_between_transports(make_backend: Factory) -> None:
    """A page written through shared memory reads back over HTTP and the other way round,
    through the generic and the host-pool paths."""
    over_shm, over_http = make_backend(), make_backend(transport="http")
    assert (over_shm.transport, over_http.transport) == ("shm", "http")
    pools = [KVHostPool(), KVHostPool()]
    for backend, pool in zip((over_shm, over_http), pools, strict=True):
        backend.register_mem_pool_host(pool)
    pools[0].fill_random(seed=12)
    keys = page_keys("cross", 4)
    assert over_shm.batch_set_v1(keys[:2], torch.arange(2 * PAGE)) == [True, True]
    pools[1].fill_random(seed=13)
    assert over_http.batch_set_v1(keys[2:], torch.arange(2 * PAGE)) == [True, True]
    for reader, writer_pool, part in ((over_http, pools[0], slice(0, 2)),
                                      (over_shm, pools[1], slice(2, 4))):
        got = reader.batch_get(keys[part])
        assert all(g is not None and same_bytes(g, writer_pool.get_data_page(i * PAGE))
                   for i, g in enumerate(got))
    assert over_shm.batch_get_v1(keys, torch.arange(40, 56)) == [True] * 4
    assert same_bytes(pools[0].get_data_page(48), pools[1].get_data_page(0))


@pytest.mark.parametrize("transport", ["auto"])
def test_a_service_that_starts_later_is_attached(make_backend: Factory,
                                                 redis_server: RedisServer) -> None:
    port = free_port()
    backend = make_backend(url=f"http://127.0.0.1:{port}", retry_down_s=0.2)
    keys, data = page_keys("late", 2), pages(2, seed=15)
    assert backend.transport == "http" and backend.batch_exists(keys) == 0
    late = start_service(redis_server, port=port)
    try:
        deadline = time.monotonic() + 20
        while not backend.batch_set(keys, data):
            assert time.monotonic() < deadline, "never reached the service"
            time.sleep(0.05)
        assert backend.transport == "shm"  # attached as soon as it answered, no long backoff
        got = backend.batch_get(keys)
        assert all(g is not None and same_bytes(g, d) for g, d in zip(got, data, strict=True))
    finally:
        late.stop()


@pytest.mark.parametrize("transport", ["shm"])
def test_pages_larger_than_host_memory_go_over_http(make_backend: Factory) -> None:
    """The service's host copy is 1 MiB: a bigger page cannot be reserved in the segment,
    so the adapter sends it over HTTP (Redis keeps it) and reads it back inline."""
    backend = make_backend()
    big = torch.randn(600_000, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    key = page_keys("big", 1)
    assert backend.transport == "shm" and backend.batch_set(key, [big])
    got = backend.batch_get(key, [torch.empty_like(big)])
    assert got[0] is not None and same_bytes(got[0], big)


# ------------------------------------------------------------------ the service's batch limit
def check_small_batches(backend: Any, prefix: str, seed: int) -> None:
    """Batches of 11 pages (more than the service's 4 keys a request) through every call:
    per-key results in order, a missing page answered as missing where it is."""
    keys, data = page_keys(prefix, 11), pages(11, seed=seed)
    assert backend.batch_set(keys[:6] + keys[7:], data[:6] + data[7:])  # no page 6
    assert backend.batch_exists(keys) == 6 and backend.batch_exists(keys[7:]) == 4
    got = backend.batch_get(keys)
    assert got[6] is None
    assert all(g is not None and same_bytes(g, d)
               for i, (g, d) in enumerate(zip(got, data, strict=True)) if i != 6)
    pool = KVHostPool(slots=128)
    backend.register_mem_pool_host(pool)
    pool.fill_random(seed)
    v1_keys = page_keys(f"{prefix}-v1", 9)
    expected = [pool.get_data_page(i * PAGE).clone() for i in range(9)]
    assert backend.batch_set_v1(v1_keys, torch.arange(9 * PAGE)) == [True] * 9
    assert backend.batch_exists(v1_keys) == 9
    asked = v1_keys[:5] + ["0" * 64] + v1_keys[5:]
    assert backend.batch_get_v1(asked, torch.arange(40, 80)) == [i != 5 for i in range(10)]
    slots = [40 + PAGE * i for i in range(10) if i != 5]
    assert all(same_bytes(pool.get_data_page(s), e) for s, e in zip(slots, expected, strict=True))
    assert backend.clear() is True and backend.batch_exists(keys + v1_keys) == 0


def test_a_service_with_a_small_max_batch_takes_every_batch(
        make_backend: Factory, redis_server: RedisServer) -> None:
    """A service that takes 4 keys a request, an adapter that sends up to 512: it learns the
    limit (/v1/stats, or the attach answer) and splits every call to it (they were 413s,
    so every batch failed and read as missing)."""
    small = start_service(redis_server, max_batch=4)
    try:
        check_small_batches(make_backend(url=small.url), "small", seed=16)
    finally:
        small.stop()


def test_a_restart_with_a_smaller_max_batch_fails_no_batch(
        make_backend: Factory, redis_server: RedisServer,
        caplog: pytest.LogCaptureFixture) -> None:
    """The service restarts taking 4 keys a request where it took 4096: the first batch
    past 4 is refused (413, naming the limit), resent in parts of 4, and succeeds."""
    first = start_service(redis_server)
    backend = make_backend(url=first.url)
    assert backend.batch_set(page_keys("before", 6), pages(6, seed=17))
    first.stop()
    second = start_service(redis_server, max_batch=4, port=first.config.port)
    try:
        check_small_batches(backend, "restart", seed=18)
        refused = [r for r in caplog.records if "refused 10 keys" in r.getMessage()]
        assert refused, "the limit was not re-learned"
    finally:
        second.stop()


def test_a_413_without_a_limit_is_resolved_by_asking_or_halving(
        redis_server: RedisServer) -> None:
    """A 413 whose text names no limit: the service is asked (/v1/stats), and when it cannot
    answer, the refused count is halved (always smaller: the split ends)."""
    from tierstore.client import ServiceError
    from tierstore.integrations._io import ServiceIO
    from tierstore.integrations._support import TierStoreL3Config, _Counters, _LogLimiter

    small = start_service(redis_server, max_batch=4)
    io = ServiceIO(TierStoreL3Config(url=small.url, transport="http", retry_down_s=0.2),
                   _Counters(False), _LogLimiter(30.0))
    try:
        assert io.max_batch == 4  # asked at start
        io._service_limit = 512  # as if it had restarted with a lower limit, unseen
        refused = ServiceError(413, "batch_too_large", "too many keys")
        assert io._lower_limit(refused, 10) and io.max_batch == 4  # asked again
        small.stop()
        assert io._lower_limit(refused, 4) and io.max_batch == 2  # no answer: halved
        assert not io._lower_limit(refused, 1)  # one key cannot be split
    finally:
        io.close()
        small.stop()


# ------------------------------------------------------------------ bench
def test_bench_runs_small(redis_bin: str) -> None:
    import argparse

    from tierstore.bench import sglang as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args(["--page-tokens", "4", "--batch", "4", "--batches",
                                          "2", "--rounds", "1"]))
    names = ["HiCacheFile", "tierstore shm", "tierstore http", "tierstore, Redis gets",
             "tierstore shm, no Redis"]
    assert result["available"] and [(r["backend"], r["path"]) for r in result["rows"]] == [
        (name, path) for path in ("generic", "v1") for name in names]
    assert all(r["set_pages_s"] > 0 and r["get_pages_s"] > 0 for r in result["rows"])
    assert "tierstore shm (v1) / HiCacheFile" in bench.render(result)
