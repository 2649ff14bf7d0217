"""Large envelopes in Redis: split over ``chunk_bytes`` values vs one whole value, one run.

A Qwen3-Next-80B-A3B state checkpoint is 73.7 MiB. The Redis tier stores a payload over
``RemoteTierConfig.chunk_bytes`` (16 MiB by default) as several values, written in one
pipeline and read in one ``MGET`` batch straight into the caller's buffer; ``chunk_bytes=0``
stores it whole (the baseline). For each size and topology (a private standalone
``redis-server`` and a private 3-node cluster, both on loopback), rounds alternate the two
and the median MB/s of ``put_many`` and ``get_many(out=...)`` is kept. MB/s is 10^6 payload
bytes per second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from contextlib import ExitStack

from remote_tier.config import RemoteTierConfig
from remote_tier.embedded import RedisServer
from remote_tier.embedded_cluster import RedisCluster
from remote_tier.keys import envelope_key
from remote_tier.store import RedisTier
from tierstore.bench._util import ratio, table

MiB = 1 << 20
_PREFIX, _FP = "bsplit", "benchfp"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mib", default="16.5,73.7",
                        help="payload sizes in MiB (73.7: a Qwen3-Next state checkpoint)")
    parser.add_argument("--values", type=int, default=4, help="values per put_many/get_many")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (median)")
    parser.add_argument("--no-cluster", action="store_true", help="standalone server only")


def run(args: argparse.Namespace) -> dict:
    sizes = [int(float(s) * MiB) for s in args.sizes_mib.split(",")]
    rows: list[dict[str, object]] = []
    with ExitStack() as stack:
        urls = {"standalone": (stack.enter_context(RedisServer()).url, "standalone")}
        if not args.no_cluster:
            urls["cluster"] = (stack.enter_context(RedisCluster()).url, "cluster")
        for topology, (url, mode) in urls.items():
            for size in sizes:
                rows.append(asyncio.run(_compare(url, mode, size, args)) | {
                    "topology": topology, "size_mib": round(size / MiB, 1)})
    return {"unit": "MB/s of payload", "values_per_call": args.values, "rows": rows}


async def _compare(url: str, mode: str, size: int, args: argparse.Namespace
                   ) -> dict[str, float | None]:
    """Median put / get MB/s of the split and the whole layout, rounds alternating."""
    chunked = RemoteTierConfig(url=url, mode=mode, key_prefix=_PREFIX,  # type: ignore[arg-type]
                               op_timeout_s=30.0)
    whole = RemoteTierConfig(url=url, mode=mode, key_prefix=_PREFIX,  # type: ignore[arg-type]
                             op_timeout_s=30.0, chunk_bytes=0, max_value_bytes=size + MiB)
    payload = memoryview(os.urandom(size))
    outs = [bytearray(size) for _ in range(args.values)]
    figures: dict[str, list[float]] = {}
    async with RedisTier(chunked) as split_tier, RedisTier(whole) as whole_tier:
        tiers = {"split": split_tier, "whole": whole_tier}
        for r in range(args.rounds):
            for name in (("split", "whole") if r % 2 == 0 else ("whole", "split")):
                tier = tiers[name]
                keys = [envelope_key(_PREFIX, _FP, f"{name}{i:08x}".encode().hex(), "state")
                        for i in range(args.values)]
                start = time.perf_counter()
                assert all(await tier.put_many([(k, payload) for k in keys])), "put failed"
                put_s = time.perf_counter() - start
                start = time.perf_counter()
                got = await tier.get_many(keys, outs)
                get_s = time.perf_counter() - start
                assert all(g is not None for g in got), "get missed"
                assert outs[-1] == payload, "wrong bytes"
                figures.setdefault(f"{name}_put", []).append(size * len(keys) / put_s / 1e6)
                figures.setdefault(f"{name}_get", []).append(size * len(keys) / get_s / 1e6)
                await tier.delete_many(keys)
    result: dict[str, float | None] = {k: statistics.median(v) for k, v in figures.items()}
    result["put_ratio"] = ratio(result["split_put"], result["whole_put"])
    result["get_ratio"] = ratio(result["split_get"], result["whole_get"])
    return result


def render(result: dict) -> str:
    columns = ["topology", "size_mib", "split_put", "whole_put", "put_ratio", "split_get",
               "whole_get", "get_ratio"]
    return (f"split (chunk_bytes 16 MiB) vs whole values, {result['values_per_call']} values "
            f"per call, {result['unit']}:\n{table(result['rows'], columns)}")
