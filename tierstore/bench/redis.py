"""Redis tier put/get MB/s vs redis-benchmark, plain redis-py and LMCache, one server, one run.

Starts its own ``redis-server`` on a free loopback port. For each value size it measures, in
interleaved rounds:

- ``redis-benchmark -t set,get -d SIZE -c CONNECTIONS --csv`` (the reference),
- ``RedisTier.put_many`` / ``get_many`` (fresh buffers) / ``get_many(out=...)`` (received
  straight into preallocated buffers), ``CALLERS`` concurrent callers of ``BATCH`` items,
  the tier holding ``CONNECTIONS`` connections,
- a plain single-connection redis-py asyncio ``SET``/``GET`` loop (the baseline),
- LMCache's ``RedisConnector.put`` / ``get`` (``_lmcache_driver.py``, run with the Python of a
  separate LMCache venv, ``--lmcache-python``), ``CALLERS x BATCH`` objects in flight.

Every contender cycles over ``--keyspace-mb`` of keys created before timing (redis-benchmark
overwrites one key), so the timed SETs overwrite. Each figure is the median of the rounds
(a loopback benchmark on a shared machine is noisy; rounds are interleaved so noise hits
every contender alike). MB/s is 10^6 bytes of value per second, headers excluded.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import os
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as aredis

from remote_tier.config import RemoteTierConfig
from remote_tier.embedded import RedisServer, redis_binary
from remote_tier.keys import envelope_key
from remote_tier.store import RedisTier
from tierstore.bench._util import ratio, table
from tierstore.errors import UnavailableError
from tierstore.settings import parse_size

_PREFIX = "bench"
_FP = "benchfp"
_LMCACHE_PYTHON = "/tmp/lmcache-venv/bin/python"
_LMCACHE_DRIVER = Path(__file__).with_name("_lmcache_driver.py")
_LMCACHE_UNIT = 1024  # the driver's KV chunk: 256 tokens x K,V x bfloat16 x hidden


class LmcacheAbsent(UnavailableError, RuntimeError):
    """The LMCache venv's Python is missing or cannot import ``lmcache``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="256K,1M,4M", help="value sizes, e.g. 256K,1M,4M")
    parser.add_argument("--total-mb", type=int, default=512, help="MiB moved per measurement")
    parser.add_argument(
        "--keyspace-mb", type=int, default=64, help="MiB of distinct keys, cycled (overwritten)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--connections", type=int, default=4, help="tier and benchmark conns")
    parser.add_argument("--callers", type=int, default=4, help="concurrent tier callers")
    parser.add_argument("--batch", type=int, default=4, help="items per put_many/get_many")
    parser.add_argument(
        "--lmcache-python",
        default=_LMCACHE_PYTHON if os.path.exists(_LMCACHE_PYTHON) else "",
        help=f"Python of a venv with lmcache ('' = off; default {_LMCACHE_PYTHON} if present)",
    )


def run(args: argparse.Namespace) -> dict:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    lmcache = _lmcache_status(args.lmcache_python)
    if lmcache["status"] == "on" and any(size % _LMCACHE_UNIT for size in sizes):
        raise ValueError(f"LMCache needs sizes in multiples of {_LMCACHE_UNIT} B, got {sizes}")
    rows: list[dict[str, object]] = []
    started = time.perf_counter()
    with RedisServer() as server:
        for size in sizes:
            count = max(8, (args.total_mb << 20) // size)
            samples: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                figures = _redis_benchmark(server.port, size, count, args.connections)
                figures.update(asyncio.run(_tier(server.url, size, count, args)))
                figures.update(asyncio.run(_plain(server.url, size, count, args.keyspace_mb)))
                if lmcache["status"] == "on":
                    try:
                        figures.update(_lmcache(server.url, size, count, args, lmcache))
                    except LmcacheAbsent as exc:
                        lmcache.update(status="absent", reason=str(exc))
                server.command("FLUSHALL")
                for name, value in figures.items():
                    samples.setdefault(name, []).append(value)
            best = {name: statistics.median(values) for name, values in samples.items()}
            row: dict[str, object] = {"size_kib": size >> 10, **best}
            row["samples"] = {name: [round(v) for v in values] for name, values in samples.items()}
            row["put_vs_rb"] = ratio(best["tier_put"], best["rb_set"])
            row["get_vs_rb"] = ratio(best["tier_get"], best["rb_get"])
            row["get_into_vs_rb"] = ratio(best["tier_get_into"], best["rb_get"])
            row["put_vs_plain"] = ratio(best["tier_put"], best["plain_set"])
            row["get_vs_plain"] = ratio(best["tier_get"], best["plain_get"])
            row["plain_get_vs_rb"] = ratio(best["plain_get"], best["rb_get"])
            if "lmcache_get" in best and lmcache["status"] == "on":
                row["put_vs_lmcache"] = ratio(best["tier_put"], best["lmcache_put"])
                row["get_vs_lmcache"] = ratio(best["tier_get"], best["lmcache_get"])
                # LMCache's get lands in a buffer its allocator owns, like get_many(out=...)
                row["get_into_vs_lmcache"] = ratio(best["tier_get_into"],
                                                    best["lmcache_get"])
            rows.append(row)
    return {
        "note": (
            "redis-benchmark SETs/GETs one key (hot in cache); the tier and plain redis-py "
            "cycle over keyspace_mb of keys"
        ),
        "keyspace_mb": args.keyspace_mb,
        "unit": "MB/s (1e6 value bytes per second)",
        "connections": args.connections,
        "callers": args.callers,
        "batch": args.batch,
        "rounds": args.rounds,
        "total_mb": args.total_mb,
        "lmcache": lmcache,
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }


def render(result: dict) -> str:
    columns = ["size_kib", "rb_set", "tier_put", "plain_set", "put_vs_rb", "put_vs_plain"]
    gets = ["size_kib", "rb_get", "tier_get", "tier_get_into", "plain_get"]
    gets += ["get_vs_rb", "get_into_vs_rb", "get_vs_plain", "plain_get_vs_rb"]
    head = (
        f"Redis tier vs redis-benchmark (-c {result['connections']}) and plain redis-py, "
        f"{result['unit']}; tier: {result['callers']} callers x {result['batch']} items, "
        f"{result['connections']} connections; median of {result['rounds']} rounds, "
        f"{result['seconds']:.0f} s"
    )
    parts = [head, table(result["rows"], columns), table(result["rows"], gets)]
    lmcache = result.get("lmcache", {"status": "off"})
    if lmcache["status"] == "on":
        vs = ["size_kib", "lmcache_put", "tier_put", "put_vs_lmcache"]
        vs += ["lmcache_get", "tier_get", "get_vs_lmcache", "get_into_vs_lmcache"]
        parts.append(
            f"LMCache {lmcache.get('version', '?')} RedisConnector "
            f"({lmcache.get('concurrency', '?')} in flight, hiredis={lmcache.get('hiredis')}; "
            f"{lmcache['python']}):\n{table(result['rows'], vs)}"
        )
    else:
        parts.append(f"LMCache: {lmcache['status']} ({lmcache.get('reason', '')})")
    return "\n\n".join(parts)


def _lmcache_status(python: str) -> dict[str, object]:
    """Whether the LMCache contender runs: ``on``, ``off`` (flag empty) or ``absent``."""
    if not python:
        return {"status": "off", "reason": "--lmcache-python ''"}
    if not os.access(python, os.X_OK):
        return {"status": "absent", "reason": f"{python} not found", "python": python}
    return {"status": "on", "python": python}


def _lmcache(
    url: str, size: int, count: int, args: argparse.Namespace, info: dict[str, object]
) -> dict[str, float]:
    """One round of LMCache's connector in its own venv; records what it measured in ``info``."""
    cmd = [str(info["python"]), str(_LMCACHE_DRIVER), "--url", url, "--size", str(size)]
    cmd += ["--count", str(count), "--rounds", "1", "--keyspace-mb", str(args.keyspace_mb)]
    cmd += ["--concurrency", str(args.callers * args.batch)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    reply = json.loads(lines[-1]) if lines else {}
    if done.returncode == 2 and "error" in reply:
        raise LmcacheAbsent(reply["error"])
    if done.returncode != 0 or "get" not in reply:
        tail = done.stderr.strip().splitlines()[-5:]
        raise RuntimeError(f"LMCache driver exited {done.returncode}: {' | '.join(tail)}")
    for key in ("lmcache_version", "hiredis", "concurrency", "executor_workers", "measured"):
        info[key.removeprefix("lmcache_")] = reply[key]
    return {"lmcache_put": reply["put"], "lmcache_get": reply["get"]}


def _redis_benchmark(port: int, size: int, count: int, connections: int) -> dict[str, float]:
    cmd = [redis_binary("redis-benchmark"), "-h", "127.0.0.1", "-p", str(port)]
    cmd += ["-t", "set,get", "-d", str(size), "-n", str(count), "-c", str(connections), "--csv"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    rps = {row["test"]: float(row["rps"]) for row in csv.DictReader(io.StringIO(out))}
    return {"rb_set": rps["SET"] * size / 1e6, "rb_get": rps["GET"] * size / 1e6}


async def timed(fn: Callable[[], Awaitable[None]], nbytes: int, op: str) -> dict[str, float]:
    """``op`` MB/s, and its loop-thread and whole-process CPU microseconds per MiB."""
    mib = nbytes / (1 << 20)
    start, loop0, cpu0 = time.perf_counter(), time.thread_time(), time.process_time()
    await fn()
    wall = time.perf_counter() - start
    return {
        op: nbytes / wall / 1e6,
        f"{op}_loop_us": (time.thread_time() - loop0) / mib * 1e6,
        f"{op}_cpu_us": (time.process_time() - cpu0) / mib * 1e6,
    }


async def time_tier(tier: RedisTier, prefix: str, size: int, count: int,
                    args: argparse.Namespace) -> dict[str, float]:
    """Put, get and get-into of ``count`` values of ``size`` bytes through ``tier``, by
    ``args.callers`` concurrent callers in batches of ``args.batch`` over a keyspace of
    ``args.keyspace_mb``: :func:`timed`'s figures for ``put``, ``get`` and ``get_into``."""
    distinct = max(args.batch * args.callers, (args.keyspace_mb << 20) // size)
    keys = [envelope_key(prefix, _FP, f"{i % distinct:016x}", "kv") for i in range(count)]
    value = memoryview(os.urandom(size))
    callers, batch = args.callers, args.batch
    outs = [[bytearray(size) for _ in range(batch)] for _ in range(callers)]

    def shares(c: int) -> range:
        return range(c * batch, count, callers * batch)

    async def put(c: int) -> None:
        for lo in shares(c):
            ok = await tier.put_many([(k, value) for k in keys[lo : lo + batch]])
            assert all(ok), "bench put failed"

    async def get(c: int, into: bool) -> None:
        for lo in shares(c):
            chunk = keys[lo : lo + batch]
            got = await tier.get_many(chunk, outs[c][: len(chunk)] if into else None)
            assert all(g is not None for g in got), "bench get missed"

    async def all_callers(fn: Callable[[int], Awaitable[None]]) -> None:
        await asyncio.gather(*(fn(c) for c in range(callers)))

    for lo in range(0, distinct, batch):  # create the keys: the timed puts overwrite
        await tier.put_many([(k, value) for k in keys[lo : min(lo + batch, distinct)]])
    nbytes = size * count
    figures = await timed(lambda: all_callers(put), nbytes, "put")
    figures |= await timed(lambda: all_callers(lambda c: get(c, False)), nbytes, "get")
    figures |= await timed(lambda: all_callers(lambda c: get(c, True)), nbytes, "get_into")
    return figures


async def _tier(url: str, size: int, count: int, args: argparse.Namespace) -> dict[str, float]:
    config = RemoteTierConfig(
        url=url, key_prefix=_PREFIX, connections=args.connections, max_value_bytes=64 << 20
    )
    async with RedisTier(config) as tier:
        figures = await time_tier(tier, _PREFIX, size, count, args)
    return {f"tier_{op}": figures[op] for op in ("put", "get", "get_into")}


async def _plain(url: str, size: int, count: int, keyspace_mb: int) -> dict[str, float]:
    client = aredis.Redis.from_url(url)
    value = os.urandom(size)
    distinct = max(1, (keyspace_mb << 20) // size)
    keys = [f"plain:{i % distinct}" for i in range(count)]
    try:

        async def put() -> None:
            for key in keys:
                await client.set(key, value)

        async def get() -> None:
            for key in keys:
                await client.get(key)

        for key in keys[:distinct]:
            await client.set(key, value)
        nbytes = size * count
        sets = await timed(put, nbytes, "plain_set")
        gets = await timed(get, nbytes, "plain_get")
        return {"plain_set": sets["plain_set"], "plain_get": gets["plain_get"]}
    finally:
        await client.aclose()
