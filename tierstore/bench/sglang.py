"""SGLang HiCache L3: batch_set / batch_get pages/s and MB/s through the tierstore adapter vs
SGLang's own HiCacheFile backend on a local directory, same pages, same run.

Pages are one SGLang page of a preset's full-attention KV (``--page-tokens`` tokens, bf16, one
TP rank), ``--batch`` per call (SGLang's ``STORAGE_BATCH_SIZE`` is 128), through two paths:
``generic`` (``batch_set`` of tensors, ``batch_get`` into preallocated targets) and ``v1``
(``batch_set_v1`` / ``batch_get_v1`` between a registered ``page_first`` host pool and the
store). Contenders, each built by SGLang's ``StorageBackendFactory`` and measured in
interleaved rounds (median):

- ``HiCacheFile``: one file per page in a temporary directory (through the OS page cache, no
  fsync, as SGLang runs it);
- ``tierstore shm``: the adapter against an in-process ``tierstore serve`` whose storage API
  keeps a host LRU copy in a shared segment and writes every page through to a private
  redis-server; the adapter maps the segment and copies pages itself (gets hit the LRU);
- ``tierstore http``: the same service, the adapter told ``transport: http`` (every page
  crosses HTTP);
- ``tierstore, Redis gets``: a host LRU too small to hold a page, so every get comes from
  Redis (over HTTP);
- ``tierstore shm, no Redis``: shared memory to a service without L3, i.e. a host-local store
  like HiCacheFile (what the Redis write-through costs the writer on a shared 2-core host);
- ``tierstore on disk`` (``--disk``): shared memory to a service without L3 whose storage API
  keeps its values on a disk tier in the same directory as HiCacheFile's (O_DIRECT where the
  filesystem takes it), written behind from host memory (which, like HiCacheFile's page cache,
  holds the working set).

``--cold`` (with ``--disk``) reads from a cold cache: between the sets and the gets (untimed)
HiCacheFile's files are synced and dropped from the page cache (``posix_fadvise(DONTNEED)``),
and the service's host copies are dropped once its disk writes are done (its slab files get the
same ``fadvise``; O_DIRECT reads bypass the page cache anyway). ``--only-disk`` runs just
HiCacheFile and the adapter on disk. ``set_durable`` rows add the time until the pages are on
the device: HiCacheFile's ``os.sync()``, the service's background disk writes.

The in-process services share the interpreter (and its GIL) with the adapter; ``--url``
measures a ``tierstore serve`` running in its own process instead, as SGLang would use it.

Contenders take turns in a rotating order, with an untimed ``sync`` after each (so page-cache
writeback of HiCacheFile's files does not run in the next contender's turn). Each round writes
fresh keys, waits (untimed, reported as ``redis_drain_ms``) until the service's background Redis
writes of them are done, reads them back (checking bytes), then
clears the store. A set counts as done when the service holds the pages in host memory (shm
commits write to Redis behind; HTTP sets wait for Redis). Needs SGLang
(``pip install --no-deps sglang==0.5.23`` and
``pip install 'tierstore[sglang]'``) and ``redis-server``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from remote_tier import RemoteTierConfig
from remote_tier.embedded import RedisServer
from tierstore.bench._util import fmt_ratio, ratio, table
from tierstore.config import StoreConfig
from tierstore.integrations.sglang import TierStoreHiCacheStorage
from tierstore.layout import load_preset, preset_names
from tierstore.reference_model import tiny_layout
from tierstore.service.config import ServiceConfig
from tierstore.service.running import RunningService, free_port
from tierstore.store import TierStore

_INSTALL = "pip install --no-deps sglang==0.5.23 && pip install 'tierstore[sglang]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="qwen3-next-80b-a3b", choices=preset_names())
    parser.add_argument("--page-tokens", type=int, default=64, help="tokens per SGLang page")
    parser.add_argument("--tp-size", type=int, default=1, help="page of one rank of this TP")
    parser.add_argument("--batch", type=int, default=128, help="pages per batch_set/batch_get")
    parser.add_argument("--batches", type=int, default=2, help="batches per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--dir", default=None, help="parent of HiCacheFile's directory")
    parser.add_argument("--disk", action="store_true",
                        help="add the adapter against a service with its values on disk")
    parser.add_argument("--only-disk", action="store_true",
                        help="only HiCacheFile and the adapter on disk (implies --disk)")
    parser.add_argument("--cold", action="store_true",
                        help="drop page caches and host copies between sets and gets")
    parser.add_argument("--url", default=None,
                        help="measure a running `tierstore serve` (in another process) instead "
                             "of the in-process ones; token from TIERSTORE_AUTH_TOKEN")


class _HostPool:
    """A ``page_first`` host KV pool of SGLang's shape (``[2, slots, 1, 1, dim]``, bf16) whose
    pages have the preset's bytes, for the ``*_v1`` paths (SGLang's own host pools import the
    serving stack)."""

    layout, layer_num, head_num = "page_first", 1, 1
    dtype = torch.bfloat16

    def __init__(self, page_size: int, page_bytes: int, pages: int) -> None:
        self.page_size = page_size
        self.head_dim = page_bytes // (2 * page_size * 2)
        self.size_per_token = 2 * self.head_dim * 2
        self.kv_buffer = torch.zeros((2, pages * page_size, 1, 1, self.head_dim),
                                     dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index:index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * self.page_size * self.head_dim, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self.kv_buffer[:, index:index + self.page_size]
        page.copy_(data_page.reshape(page.shape))


class _Generic:
    """``batch_set`` of tensors, ``batch_get`` into preallocated targets."""

    def __init__(self, pages: list[torch.Tensor]) -> None:
        self.pages, self.num_pages = pages, len(pages)
        self.targets = [torch.empty_like(p) for p in pages]

    def set(self, backend: Any, keys: list[str]) -> bool:
        return bool(backend.batch_set(keys, self.pages))

    def get(self, backend: Any, keys: list[str]) -> bool:
        return all(t is not None for t in backend.batch_get(keys, self.targets))

    def check(self) -> bool:
        return torch.equal(self.targets[-1].view(torch.int16), self.pages[-1].view(torch.int16))


class _V1:
    """Pages from the first half of the host pool to the store and back into the second half,
    as SGLang's cache controller moves them: ``batch_set_v1`` / ``batch_get_v1`` on a backend
    that implements them (tierstore), else its generic path (HiCacheFile has no v1: the
    controller copies each page out with ``get_data_page`` and in with a dummy page and
    ``set_from_flat_data_page``)."""

    def __init__(self, pool: _HostPool, batch: int) -> None:
        self.pool, self.num_pages, n = pool, batch, batch * pool.page_size
        self.src, self.dst = torch.arange(n), torch.arange(n, 2 * n)

    def set(self, backend: Any, keys: list[str]) -> bool:
        if isinstance(backend, TierStoreHiCacheStorage):
            return all(backend.batch_set_v1(keys, self.src))
        size = self.pool.page_size
        return bool(backend.batch_set(keys, [self.pool.get_data_page(int(self.src[i * size]))
                                             for i in range(len(keys))]))

    def get(self, backend: Any, keys: list[str]) -> bool:
        if isinstance(backend, TierStoreHiCacheStorage):
            return all(backend.batch_get_v1(keys, self.dst))
        size = self.pool.page_size
        got = backend.batch_get(keys, [self.pool.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(got):
            if page is None:
                return False
            self.pool.set_from_flat_data_page(int(self.dst[i * size]), page)
        return True

    def check(self) -> bool:
        half = self.src.numel()
        return torch.equal(self.pool.kv_buffer[:, :half].view(torch.int16),
                           self.pool.kv_buffer[:, half:].view(torch.int16))


def run(args: argparse.Namespace) -> dict:
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except ImportError as exc:
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}

    layout = load_preset(args.preset, page_size=args.page_tokens, tp_size=args.tp_size)
    assert layout.kv is not None, f"{args.preset} has no full-attention KV"
    page_bytes = layout.kv.raw_nbytes
    g = torch.Generator().manual_seed(0)
    pages = [torch.randn(page_bytes // 2, generator=g).to(torch.bfloat16)
             for _ in range(args.batch)]
    pool = _HostPool(args.page_tokens, page_bytes, 2 * args.batch)
    pool.kv_buffer[:, :args.batch * args.page_tokens] = torch.randn(
        (2, args.batch * args.page_tokens, 1, 1, pool.head_dim), generator=g)
    ops: dict[str, Any] = {"generic": _Generic(pages), "v1": _V1(pool, args.batch)}

    def storage_config(extra: dict[str, Any]) -> Any:
        return HiCacheStorageConfig(
            tp_rank=0, tp_size=args.tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
            attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
            is_page_first_layout=True, model_name=layout.name, extra_config=extra)

    def service(redis: RedisServer | None, prefix: str, host_bytes: int,
                disk: str | None = None) -> RunningService:
        store = TierStore(tiny_layout(), StoreConfig(capacity_bytes=1 << 20))
        config = ServiceConfig(port=free_port(), kv_host_bytes=host_bytes, kv_disk_path=disk,
                               kv_disk_bytes=4 * working_set + (64 << 20),
                               kv_disk_mac_key=b"bench-sglang-disk-secret-0123456")
        remote = None if redis is None else RemoteTierConfig(
            url=redis.url, key_prefix=prefix, max_value_bytes=max(64 << 20, 2 * page_bytes))
        return RunningService(store, config, remote).start()

    working_set = args.batch * args.batches * page_bytes
    disk = args.disk or args.only_disk
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(dir=args.dir))
        files = os.path.join(tmp, "hicache")
        redis = None if args.url or args.only_disk else stack.enter_context(RedisServer())
        services = [] if redis is None else [service(redis, "bench-lru", 2 * working_set),
                                             service(redis, "bench-r", 1),
                                             service(None, "", 2 * working_set)]
        urls: dict[str, tuple[str, str, RunningService | None]] = {
            f"tierstore at {args.url}": (args.url, "auto", None)} if args.url else {
            "tierstore shm": (services[0].url, "shm", services[0]),
            "tierstore http": (services[0].url, "http", services[0]),
            "tierstore, Redis gets": (services[1].url, "http", services[1]),
            "tierstore shm, no Redis": (services[2].url, "shm", services[2])} if services else {}
        if disk and not args.url:  # host memory absorbs the sets, as the page cache does
            services.append(service(None, "", 2 * working_set, os.path.join(tmp, "tierstore")))
            urls["tierstore on disk"] = (services[-1].url, "shm", services[-1])
        try:
            backends = {"HiCacheFile": StorageBackendFactory.create_backend(
                "file", storage_config({"file_storage_path": files}), None)}
            drains: dict[str, RunningService | None] = {"HiCacheFile": None}
            cold = {name: _cooler(files if name == "HiCacheFile" else None,
                                  drains.get(name) or (urls[name][2] if name in urls else None))
                    for name in ["HiCacheFile", *urls]} if args.cold else {}
            for label, (url, transport, svc) in urls.items():
                backends[label] = StorageBackendFactory.create_backend("dynamic", storage_config(
                    {"backend_name": "tierstore", "module_path": "tierstore.integrations.sglang",
                     "class_name": "TierStoreHiCacheStorage", "url": url,
                     "transport": transport}), None)
                drains[label] = svc
            for backend in backends.values():
                backend.register_mem_pool_host(pool)
            samples: dict[tuple[str, str], dict[str, list[Any]]] = {
                (name, path): {"set": [], "get": [], "drain": [], "durable": []}
                for path in ops for name in backends}
            order = list(samples)
            for r in range(args.rounds):
                for name, path in order[r % len(order):] + order[:r % len(order)]:
                    timed = _round(backends[name], f"{r}/{name}/{path}", ops[path],
                                   args.batches, drains[name], cold.get(name))
                    for what, seconds in zip(("set", "get", "drain", "durable"), timed,
                                             strict=True):
                        samples[(name, path)][what].append(seconds)
                    os.sync()  # no writeback of HiCacheFile's files in the next turn
            for name, backend in backends.items():
                if name != "HiCacheFile":
                    backend.close()
        finally:
            for svc in services:
                svc.stop()
        fs = _fs_type(tmp)
        direct = next((svc.service.kv.disk.tier.direct for svc in services
                       if svc.service.kv.disk is not None), None)

    moved = args.batch * args.batches
    rows = []
    for (name, path), s in samples.items():
        set_s, get_s = statistics.median(s["set"]), statistics.median(s["get"])
        row = {"backend": name, "path": path, "set_pages_s": moved / set_s,
               "set_mb_s": moved * page_bytes / set_s / 1e6,
               "get_pages_s": moved / get_s, "get_mb_s": moved * page_bytes / get_s / 1e6,
               "redis_drain_ms": statistics.median(s["drain"]) * 1e3}
        if s["durable"] and all(d is not None for d in s["durable"]):
            durable = statistics.median(s["durable"])
            row["set_durable_mb_s"] = moved * page_bytes / durable / 1e6
        rows.append(row)
    file_rows = {r["path"]: r for r in rows if r["backend"] == "HiCacheFile"}
    return {"available": True, "preset": args.preset, "page_tokens": args.page_tokens,
            "tp_size": args.tp_size, "page_bytes": page_bytes, "batch_pages": args.batch,
            "batches": args.batches, "rounds": args.rounds, "file_fs": fs, "rows": rows,
            "cold": bool(args.cold), "disk_direct": direct,
            "vs_file": {f"{r['backend']} ({r['path']})": {
                "set": ratio(r["set_pages_s"], file_rows[r["path"]]["set_pages_s"]),
                "get": ratio(r["get_pages_s"], file_rows[r["path"]]["get_pages_s"]),
                **({"set_durable": ratio(r["set_durable_mb_s"],
                                         file_rows[r["path"]]["set_durable_mb_s"])}
                   if "set_durable_mb_s" in r and "set_durable_mb_s" in file_rows[r["path"]]
                   else {})}
                for r in rows if r["backend"] != "HiCacheFile"}}


def _cooler(files: str | None, svc: RunningService | None) -> Callable[[], float | None]:
    """The untimed step between sets and gets that makes the gets cold; it returns the
    seconds until the pages were on the device (None: not on a device)."""

    def cool() -> float | None:
        start = time.perf_counter()
        durable: float | None = None
        if files is not None:  # HiCacheFile: write back, then drop its pages from the cache
            os.sync()
            durable = time.perf_counter() - start
            _drop_cached(files)
        elif svc is not None and (disk := svc.service.kv.disk) is not None:
            kv = svc.service.kv
            loop = svc._loop  # the bench owns the in-process service and its loop
            asyncio.run_coroutine_threadsafe(kv.flush(), loop).result(600)
            durable = time.perf_counter() - start
            asyncio.run_coroutine_threadsafe(kv.drop_host_copies(), loop).result(60)
            _drop_cached(disk.tier.path)
        return durable

    return cool


def _drop_cached(where: str) -> None:
    """``posix_fadvise(DONTNEED)`` on every file under ``where``."""
    for top, _, names in os.walk(where):
        for name in names:
            fd = os.open(os.path.join(top, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _round(backend: Any, tag: str, op: Any, batches: int, svc: RunningService | None,
           cool: Callable[[], float | None] | None = None
           ) -> tuple[float, float, float, float | None]:
    """Seconds to set, then (after an untimed wait for the service's background Redis writes,
    itself returned, and ``cool``) to get, ``batches`` batches of fresh keys; and the set's
    seconds until its pages were on the device (when ``cool`` says)."""
    keys = [[hashlib.sha256(f"{tag}/{b}/{i}".encode()).hexdigest() for i in range(op.num_pages)]
            for b in range(batches)]
    start = time.perf_counter()
    for batch in keys:
        assert op.set(backend, batch), f"{tag}: set failed"
    set_s = time.perf_counter() - start
    start = time.perf_counter()
    while svc is not None and svc.service.kv.stats()["redis_behind_bytes"]:
        time.sleep(0.001)
    drain_s = time.perf_counter() - start
    synced = cool() if cool is not None else None
    durable = None if synced is None else set_s + drain_s + synced
    start = time.perf_counter()
    for batch in keys:
        assert op.get(backend, batch), f"{tag}: get missed pages"
    get_s = time.perf_counter() - start
    assert op.check(), f"{tag}: wrong bytes"
    backend.clear()
    return set_s, get_s, drain_s, durable


def _fs_type(path: str) -> str:
    """The filesystem type holding ``path`` (from /proc/mounts), or "unknown"."""
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            entries = [line.split()[1:3] for line in mounts]
    except OSError:
        return "unknown"
    real = os.path.realpath(path)
    best = max((m for m in entries if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best else "unknown"


def render(result: dict) -> str:
    if not result["available"]:
        return (f"SGLang is not importable here ({result['reason']}), so there is nothing to "
                f"compare.\nInstall it with: {_INSTALL}")
    lines = [f"{result['preset']}: {result['page_tokens']}-token KV pages of "
             f"{result['page_bytes'] / 2**20:.2f} MiB (TP {result['tp_size']}), "
             f"{result['batch_pages']} per call, {result['batches']} calls per round, median of "
             f"{result['rounds']} rounds; HiCacheFile on {result['file_fs']}"
             + (f"; disk tier {'O_DIRECT' if result['disk_direct'] else 'buffered'}"
                if result.get("disk_direct") is not None else "")
             + ("; cold gets (page cache and host copies dropped)" if result.get("cold")
                else ""),
             table(result["rows"], ["backend", "path", "set_pages_s", "set_mb_s", "get_pages_s",
                                    "get_mb_s", "redis_drain_ms"]
                   + (["set_durable_mb_s"] if result.get("cold") else []))]
    for name, vs in result["vs_file"].items():
        lines.append(f"{name} / HiCacheFile: set {fmt_ratio(vs['set'])}x, "
                     f"get {fmt_ratio(vs['get'])}x" + (
                         f", set until on the device {fmt_ratio(vs['set_durable'])}x"
                         if "set_durable" in vs else ""))
    return "\n".join(lines)
