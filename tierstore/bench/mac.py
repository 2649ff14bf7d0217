"""The cost of authenticating L3 values: Redis tier put/get MB/s with the BLAKE3 MAC vs the same
code without it, one valkey/redis server, one run.

Starts its own server on a free loopback port. Every contender is the real ``RedisTier``
(``CALLERS`` concurrent callers of ``BATCH`` values, ``CONNECTIONS`` connections), differing
only in the ``Mac`` that signs and verifies each value:

- ``nomac``: no tag at all (16 zero bytes, compared) — the same code without the MAC,
- ``xxh3``: an unkeyed xxh3-128 over the same input, on the event loop — what the tier paid
  for its checksum before the MAC,
- ``blake3``: the keyed BLAKE3 MAC as the tier runs it (values from 256 KiB signed and
  verified on worker threads, a batch's values in parallel),
- ``blake3_inline``: the same MAC on the event loop (what the worker threads save),
- ``blake3_mt``: on the event loop, BLAKE3's ``max_threads`` at the CPU count (one value
  hashed on several cores).

Rounds interleave the contenders (their order rotating), each on its own keys, and every
figure is the median of the rounds; ``hash_us`` is each tag's cost for one value alone. MB/s
is 10^6 payload bytes per second. Besides wall-clock MB/s, each operation reports the CPU it
took per MiB: ``loop_us`` on the event-loop thread (the one thread a tier's I/O runs on: with
cores to spare for the hashing threads, it sets the pace) and ``cpu_us`` in the whole process
(every thread). On a loaded machine the CPU figures are the steadier ones.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import time
from typing import TYPE_CHECKING

import xxhash

from remote_tier.config import RemoteTierConfig
from remote_tier.embedded import RedisServer
from remote_tier.mac import TAG_BYTES, Mac
from remote_tier.store import RedisTier
from tierstore.bench._util import best_of, ratio, table
from tierstore.bench.redis import time_tier
from tierstore.settings import parse_size

if TYPE_CHECKING:
    from typing_extensions import Buffer

_FP = "benchfp"
_SECRET = b"bench-mac-secret-not-a-deployment-one"
CONTENDERS = ("nomac", "xxh3", "blake3", "blake3_inline", "blake3_mt")
_NEVER = 1 << 62


class _NoTag(Mac):
    """The tier without a MAC: every tag is zeros (nothing hashed, nothing handed off)."""

    __slots__ = ()
    offload_bytes = _NEVER

    def sign(self, key: bytes, header: bytes, body: Buffer) -> bytes:
        return bytes(TAG_BYTES)


class _Xxh3(Mac):
    """An unkeyed xxh3-128 over what the MAC covers, on the loop: the pre-MAC checksum."""

    __slots__ = ()
    offload_bytes = _NEVER

    def sign(self, key: bytes, header: bytes, body: Buffer) -> bytes:
        view = memoryview(body)
        h = xxhash.xxh3_128(struct.pack(">QQQ", len(key), len(header), view.nbytes))
        h.update(key)
        h.update(header)
        h.update(view)
        return h.digest()


class _Inline(Mac):
    """The MAC, never handed to worker threads."""

    __slots__ = ()
    offload_bytes = _NEVER


def _mac(name: str) -> Mac:
    if name == "nomac":
        return _NoTag(_SECRET)
    if name == "xxh3":
        return _Xxh3(_SECRET)
    if name == "blake3":
        return Mac(_SECRET)
    if name == "blake3_inline":
        return _Inline(_SECRET)
    return _Inline(_SECRET, max_threads=os.cpu_count() or 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1M", help="value sizes, e.g. 256K,1M,4M")
    parser.add_argument("--total-mb", type=int, default=256, help="MiB moved per measurement")
    parser.add_argument("--keyspace-mb", type=int, default=32,
                        help="MiB of distinct keys per contender, cycled (overwritten)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--connections", type=int, default=4, help="tier connections")
    parser.add_argument("--callers", type=int, default=4, help="concurrent tier callers")
    parser.add_argument("--batch", type=int, default=4, help="values per put_many/get_many")


def run(args: argparse.Namespace) -> dict:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows: list[dict[str, object]] = []
    started = time.perf_counter()
    with RedisServer() as server:
        for size in sizes:
            count = max(8, (args.total_mb << 20) // size)
            samples: dict[str, list[float]] = {}
            for r in range(args.rounds):
                order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[: r % len(CONTENDERS)]
                for name in order:
                    figures = asyncio.run(_tier(server.url, name, size, count, args))
                    for op, value in figures.items():
                        samples.setdefault(f"{name}_{op}", []).append(value)
            server.command("FLUSHALL")
            best = {k: statistics.median(v) for k, v in samples.items()}
            row: dict[str, object] = {"size_kib": size >> 10, **best}
            for name in CONTENDERS:
                row[f"{name}_hash_us"] = _hash_us(_mac(name), size)
            for op in ("put", "get", "get_into"):
                for base in ("nomac", "xxh3"):
                    for name in ("blake3", "blake3_inline", "blake3_mt"):
                        row[f"{name}_{op}_vs_{base}"] = ratio(best[f"{name}_{op}"],
                                                              best[f"{base}_{op}"])
                        # the same ratio from loop-thread CPU per MiB (less is faster)
                        row[f"{name}_{op}_loop_vs_{base}"] = ratio(best[f"{base}_{op}_loop_us"],
                                                                   best[f"{name}_{op}_loop_us"])
            row["samples"] = {k: [round(x) for x in v] for k, v in samples.items()}
            rows.append(row)
    return {
        "unit": "MB/s (1e6 payload bytes per second); hash_us: microseconds per value",
        "connections": args.connections,
        "callers": args.callers,
        "batch": args.batch,
        "rounds": args.rounds,
        "total_mb": args.total_mb,
        "cpus": os.cpu_count(),
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }


def _hash_us(mac: Mac, size: int) -> float:
    body = memoryview(os.urandom(size))
    return best_of(lambda: mac.sign(b"k" * 40, b"h" * 24, body), repeat=5) * 1e6


async def _tier(url: str, name: str, size: int, count: int, args: argparse.Namespace
                ) -> dict[str, float]:
    prefix = f"bm-{name}".replace("_", "-")
    config = RemoteTierConfig(url=url, key_prefix=prefix, connections=args.connections,
                              max_value_bytes=64 << 20, mac_key=_SECRET)
    async with RedisTier(config, mac=_mac(name)) as tier:
        figures = await time_tier(tier, prefix, size, count, args)
        assert tier.stats().num_mac_failures == 0, "a contender failed its own tags"
        return figures


def render(result: dict) -> str:
    head = (
        f"L3 MAC cost: RedisTier put/get with each tag, {result['unit']}; "
        f"{result['callers']} callers x {result['batch']} values, {result['connections']} "
        f"connections, {result['cpus']} CPUs; median of {result['rounds']} rounds, "
        f"{result['seconds']:.0f} s"
    )
    speed = ["size_kib"] + [f"{n}_{op}" for op in ("put", "get", "get_into") for n in CONTENDERS]
    ratios = ["size_kib"] + [f"blake3_{op}_vs_{b}" for op in ("put", "get", "get_into")
                             for b in ("nomac", "xxh3")]
    ratios += [f"{n}_{op}_vs_nomac" for n in ("blake3_inline", "blake3_mt")
               for op in ("put", "get", "get_into")]
    loops = ["size_kib"] + [f"blake3_{op}_loop_vs_{b}" for op in ("put", "get", "get_into")
                            for b in ("nomac", "xxh3")]
    loops += [f"blake3_inline_{op}_loop_vs_nomac" for op in ("put", "get", "get_into")]
    cpu = ["size_kib"] + [f"{n}_{op}_{what}" for op in ("put", "get") for n in CONTENDERS
                          for what in ("loop_us", "cpu_us")]
    hashes = ["size_kib"] + [f"{n}_hash_us" for n in CONTENDERS]
    return "\n\n".join([
        head,
        table(result["rows"], speed),
        "wall-clock ratios (>= 0.9 is the target):\n" + table(result["rows"], ratios),
        "loop-thread CPU per MiB, as ratios (base / contender):\n"
        + table(result["rows"], loops),
        "CPU microseconds per MiB (loop thread, whole process):\n" + table(result["rows"], cpu),
        "one tag alone, microseconds:\n" + table(result["rows"], hashes),
    ])
