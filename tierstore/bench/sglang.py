"""SGLang HiCache L3: batch_set / batch_get pages/s and MB/s through the tierstore adapter vs
SGLang's own HiCacheFile backend on a local directory, same pages, same run.

Pages are one SGLang page of a preset's full-attention KV (``--page-tokens`` tokens, bf16, one
TP rank), ``--batch`` per call (SGLang's ``STORAGE_BATCH_SIZE`` is 128). Contenders, each built
by SGLang's ``StorageBackendFactory`` and measured in interleaved rounds (median):

- ``HiCacheFile``: one file per page in a temporary directory (through the OS page cache, no
  fsync, as SGLang runs it);
- ``tierstore``: the adapter against an in-process ``tierstore serve`` whose storage API keeps
  a host LRU copy and writes every page through to a private redis-server (gets hit the LRU);
- ``tierstore, Redis gets``: the same with a host LRU too small to hold a page, so every get
  comes from Redis.

The in-process services share the interpreter (and its GIL) with the adapter; ``--url``
measures a ``tierstore serve`` running in its own process instead, as SGLang would use it.

Each round writes fresh keys, reads them back into preallocated pages (checking the bytes of
one), then clears both stores. Needs SGLang (``pip install --no-deps sglang==0.5.23`` and
``pip install 'tierstore[sglang]'``) and ``redis-server``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from remote_tier import RemoteTierConfig
from tierstore.bench._util import table
from tierstore.config import StoreConfig
from tierstore.layout import load_preset, preset_names
from tierstore.service.config import ServiceConfig
from tierstore.store import TierStore
from tierstore.testing.redis_server import RedisServer
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

_INSTALL = "pip install --no-deps sglang==0.5.23 && pip install 'tierstore[sglang]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="qwen3-next-80b-a3b", choices=preset_names())
    parser.add_argument("--page-tokens", type=int, default=64, help="tokens per SGLang page")
    parser.add_argument("--tp-size", type=int, default=1, help="page of one rank of this TP")
    parser.add_argument("--batch", type=int, default=128, help="pages per batch_set/batch_get")
    parser.add_argument("--batches", type=int, default=2, help="batches per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--dir", default=None, help="parent of HiCacheFile's directory")
    parser.add_argument("--url", default=None,
                        help="measure a running `tierstore serve` (in another process) instead "
                             "of the in-process ones; token from TIERSTORE_AUTH_TOKEN")


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
    targets = [torch.empty_like(p) for p in pages]

    def storage_config(extra: dict[str, Any]) -> Any:
        return HiCacheStorageConfig(
            tp_rank=0, tp_size=args.tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
            attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
            is_page_first_layout=True, model_name=layout.name, extra_config=extra)

    def service(redis: RedisServer, prefix: str, host_bytes: int) -> RunningService:
        store = TierStore(tiny_layout(), StoreConfig(capacity_bytes=1 << 20))
        config = ServiceConfig(port=free_port(), kv_host_bytes=host_bytes)
        remote = RemoteTierConfig(url=redis.url, key_prefix=prefix,
                                  max_value_bytes=max(64 << 20, 2 * page_bytes))
        return RunningService(store, config, remote).start()

    working_set = args.batch * args.batches * page_bytes
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(dir=args.dir))
        redis = None if args.url else stack.enter_context(RedisServer())
        services = [] if redis is None else [service(redis, "bench-lru", 2 * working_set),
                                             service(redis, "bench-r", 1)]
        urls = {f"tierstore at {args.url}": args.url} if args.url else {
            "tierstore": services[0].url, "tierstore, Redis gets": services[1].url}
        try:
            backends = {"HiCacheFile": StorageBackendFactory.create_backend(
                "file", storage_config({"file_storage_path": tmp}), None)}
            for label, url in urls.items():
                backends[label] = StorageBackendFactory.create_backend("dynamic", storage_config(
                    {"backend_name": "tierstore", "module_path": "tierstore.integrations.sglang",
                     "class_name": "TierStoreHiCacheStorage", "url": url}), None)
            samples: dict[str, dict[str, list[float]]] = {
                name: {"set": [], "get": []} for name in backends}
            for r in range(args.rounds):
                for name, backend in backends.items():
                    set_s, get_s = _round(backend, f"{r}/{name}", pages, targets, args.batches)
                    samples[name]["set"].append(set_s)
                    samples[name]["get"].append(get_s)
            for name, backend in backends.items():
                if name != "HiCacheFile":
                    backend.close()
        finally:
            for svc in services:
                svc.stop()
        fs = _fs_type(tmp)

    moved = args.batch * args.batches
    rows = []
    for name, s in samples.items():
        set_s, get_s = statistics.median(s["set"]), statistics.median(s["get"])
        rows.append({"backend": name, "set_pages_s": moved / set_s,
                     "set_mb_s": moved * page_bytes / set_s / 1e6,
                     "get_pages_s": moved / get_s, "get_mb_s": moved * page_bytes / get_s / 1e6})
    file_row = rows[0]
    return {"available": True, "preset": args.preset, "page_tokens": args.page_tokens,
            "tp_size": args.tp_size, "page_bytes": page_bytes, "batch_pages": args.batch,
            "batches": args.batches, "rounds": args.rounds, "file_fs": fs, "rows": rows,
            "vs_file": {r["backend"]: {"set": r["set_pages_s"] / file_row["set_pages_s"],
                                       "get": r["get_pages_s"] / file_row["get_pages_s"]}
                        for r in rows[1:]}}


def _round(backend: Any, tag: str, pages: list[torch.Tensor], targets: list[torch.Tensor],
           batches: int) -> tuple[float, float]:
    """Seconds to batch_set, then to batch_get, ``batches`` batches of fresh keys."""
    keys = [[hashlib.sha256(f"{tag}/{b}/{i}".encode()).hexdigest() for i in range(len(pages))]
            for b in range(batches)]
    start = time.perf_counter()
    for batch in keys:
        assert backend.batch_set(batch, pages), f"{tag}: batch_set failed"
    set_s = time.perf_counter() - start
    start = time.perf_counter()
    for batch in keys:
        got = backend.batch_get(batch, targets)
        assert all(t is not None for t in got), f"{tag}: batch_get missed pages"
    get_s = time.perf_counter() - start
    assert torch.equal(targets[-1].view(torch.int16), pages[-1].view(torch.int16)), tag
    backend.clear()
    return set_s, get_s


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
             f"{result['rounds']} rounds; HiCacheFile on {result['file_fs']}",
             table(result["rows"], ["backend", "set_pages_s", "set_mb_s", "get_pages_s",
                                    "get_mb_s"])]
    for name, ratio in result["vs_file"].items():
        lines.append(f"{name} / HiCacheFile: set {ratio['set']:.2f}x, get {ratio['get']:.2f}x")
    return "\n".join(lines)
