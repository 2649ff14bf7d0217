"""Drive LMCache's ``RedisConnector`` put/get and print one JSON line of MB/s.

A standalone script run by ``tierstore bench redis`` with the Python of a separate virtual
environment that has ``lmcache`` installed; it imports nothing from tierstore, and imports
LMCache only inside ``main`` so that ``--help`` works anywhere.

It builds the objects LMCache's own ``RemoteBackend`` hands the connector: an
``LMCacheEngineConfig``, an ``LMCacheMetadata`` whose one KV chunk is ``--size`` bytes, a
``LocalCPUBackend`` (its CPU memory allocator sized for the objects in flight) and
``CacheEngineKey``s. As in LMCache, the connector's event loop runs in its own thread; the timed
phases run on that loop as ``--concurrency`` workers awaiting the connector's public ``put`` /
``get`` coroutines over their share of ``--count`` keys. The keys cycle over ``--keyspace-mb``
of distinct keys created before timing, so the timed puts overwrite. Each ``get`` result is
checked to be a hit of the right length and released back to the allocator. MB/s is 10^6
bytes of value per second; each of ``--rounds`` rounds times one put phase and one get phase,
and the figures are the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

_CHUNK_TOKENS = 256
_DTYPE_BYTES = 2  # bfloat16
_MODEL = "tierstore-bench"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="redis://host:port of the server")
    parser.add_argument("--size", type=int, required=True, help="value bytes per object")
    parser.add_argument("--count", type=int, required=True, help="objects per timed phase")
    parser.add_argument("--rounds", type=int, default=1, help="timed put+get rounds (median)")
    parser.add_argument("--keyspace-mb", type=int, default=64, help="MiB of distinct keys")
    parser.add_argument("--concurrency", type=int, default=16, help="puts/gets in flight")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Measure, print one JSON object on stdout, return 0 (or 2 if lmcache is missing)."""
    args = _parser().parse_args(argv)
    unit = 2 * _CHUNK_TOKENS * _DTYPE_BYTES  # K and V, one layer, one head dimension
    if args.size <= 0 or args.size % unit:
        raise SystemExit(f"--size must be a positive multiple of {unit} bytes, got {args.size}")
    try:
        import lmcache
    except ImportError as exc:
        print(json.dumps({"error": f"lmcache is not importable: {exc}"}))
        return 2
    result = _measure(args, hidden=args.size // unit)
    result["lmcache_version"] = getattr(lmcache, "__version__", "unknown")
    print(json.dumps(result, sort_keys=True))
    return 0


def _measure(args: argparse.Namespace, hidden: int) -> dict[str, Any]:
    import redis.utils
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    size, concurrency = args.size, args.concurrency
    # Room for every get in flight plus the put source, with slack for the allocator's
    # alignment; local_cpu=False: the backend only allocates, it keeps no hot cache.
    need_gb = (concurrency + 4) * size * 1.25 / (1 << 30)
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=_CHUNK_TOKENS,
        local_cpu=False,
        max_local_cpu_size=max(0.0625, need_gb),
        remote_url=args.url,
        remote_serde="naive",
    )
    metadata = LMCacheMetadata(
        model_name=_MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(1, 2, _CHUNK_TOKENS, 1, hidden),
        chunk_size=_CHUNK_TOKENS,
    )
    backend = LocalCPUBackend(config, metadata)
    source = backend.allocate(metadata.get_shapes(), metadata.get_dtypes())
    assert source is not None and source.get_size() == size, "allocator gave no source object"
    payload = os.urandom(size)
    source.byte_array.cast("B")[:] = payload

    distinct = max(concurrency, (args.keyspace_mb << 20) // size)
    keys = [CacheEngineKey(_MODEL, 1, 0, i % distinct, torch.bfloat16) for i in range(args.count)]

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="lmcache-connector", daemon=True)
    thread.start()

    def on_loop(coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    async def build() -> Any:  # its asyncio primitives bind to the loop: build it there
        return RedisConnector(args.url, loop, backend)

    connector = on_loop(build())

    async def put_one(key: Any) -> None:
        await connector.put(key, source)

    async def get_one(key: Any) -> None:
        obj = await connector.get(key)
        assert obj is not None, f"lmcache get missed {key.to_string()}"
        assert obj.get_size() == size, f"lmcache get returned {obj.get_size()} of {size} bytes"
        obj.ref_count_down()

    async def phase(op: Callable[[Any], Awaitable[None]], chosen: list[Any]) -> float:
        async def worker(w: int) -> None:
            for key in chosen[w::concurrency]:
                await op(key)

        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return time.perf_counter() - start

    on_loop(phase(put_one, keys[:distinct]))  # create the keys: the timed puts overwrite
    puts: list[float] = []
    gets: list[float] = []
    nbytes = size * args.count
    for _ in range(args.rounds):
        puts.append(nbytes / on_loop(phase(put_one, keys)) / 1e6)
        gets.append(nbytes / on_loop(phase(get_one, keys)) / 1e6)
    intact = on_loop(connector.get(keys[0]))
    assert bytes(intact.byte_array.cast("B")) == payload, "lmcache returned different bytes"
    intact.ref_count_down()
    source.ref_count_down()
    on_loop(_close(connector))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    return {
        "put": statistics.median(puts),
        "get": statistics.median(gets),
        "samples": {"put": puts, "get": gets},
        "size": size,
        "count": args.count,
        "rounds": args.rounds,
        "distinct_keys": distinct,
        "concurrency": concurrency,
        "executor_workers": connector.pq_executor.max_workers,
        "kv_shape": [list(s) for s in metadata.get_shapes()],
        "kv_dtype": "bfloat16",
        "hiredis": bool(redis.utils.HIREDIS_AVAILABLE),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "measured": (
            "RedisConnector.put / .get coroutines (2 SETs / 2 GETs per object: "
            "kv_bytes + metadata), concurrency workers on the connector's loop thread"
        ),
    }


async def _close(connector: Any) -> None:
    """What ``RedisConnector.close()`` does, with the executor's async shutdown: ``close()``
    calls the blocking ``shutdown()``, which waits on the very loop it runs on and never returns.
    """
    await connector.pq_executor.shutdown_async(wait=True)
    await connector.connection.aclose()


if __name__ == "__main__":
    # Run as a script, this folder leads sys.path, and its redis.py would shadow redis-py.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.exit(main())
