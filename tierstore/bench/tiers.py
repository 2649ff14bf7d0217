"""Tiers: host-tier copy bandwidth vs copy_, and the retention experiment with L2 + L3.

Host copy: N envelopes demoted device->host (here CPU->CPU: the batched strided copy between
two arenas) against one contiguous ``copy_`` of the same bytes, in the same run.

Retention with tiers: the `bench retention` scenario (one long allocation) with real bytes on a
CPU arena, a host tier of --host-mib and Redis (a private redis-server on a free loopback port,
or --redis-url). After the long request completes, every prefix is requested again; each is
served from L1, L2 or L3 (promoted back) or recomputed. Redis throughput itself is measured by
`tierstore bench redis`.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from gpu_arena import Arena, PoolSpec
from host_tier import HostTier
from remote_tier import RemoteTierConfig
from tierstore.bench import retention
from tierstore.bench._util import ratio, table
from tierstore.config import StoreConfig
from tierstore.layout import load_preset
from tierstore.store import TierStore

MiB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    retention.add_arguments(parser)
    parser.add_argument("--host-mib", type=float, default=512.0, help="L2 size")
    parser.add_argument("--redis-url", default=None,
                        help="Redis for L3 (default: start a private redis-server)")
    parser.add_argument("--copy-sizes-kib", default="256,1024,4096")
    parser.add_argument("--copy-mib", type=int, default=128)
    parser.add_argument("--disk-mib", type=float, default=0.0,
                        help="also run the unified rule with L2 + a local disk tier of this "
                             "size (in a temporary directory) and no Redis (0: skip)")
    parser.set_defaults(prefixes=28)


def _host_copy(unit: int, total: int, repeat: int = 5) -> dict[str, float | None]:
    n = max(1, total // unit)
    pools = [PoolSpec("kv", unit, "high")]
    device = Arena(unit * n, pools)
    host = HostTier(unit * n, pools)
    src, dst = device.alloc("kv", n), host.arena.alloc("kv", n)
    assert src is not None and dst is not None
    device.buffer.random_(0, 256)
    host.arena.buffer.fill_(0)
    a = torch.empty(n * unit, dtype=torch.uint8).random_(0, 256)
    b = torch.empty_like(a)
    b.copy_(a)
    store_t, copy_t = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        host.store(device, "kv", src, dst)
        store_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        b.copy_(a)
        copy_t.append(time.perf_counter() - start)
    assert torch.equal(host.arena.read("kv", dst[:1]), device.read("kv", src[:1]))
    return {"envelope_kib": unit / 1024, "mib": n * unit / MiB,
            "host_store_gbps": n * unit / min(store_t) / 1e9,
            "copy_gbps": n * unit / min(copy_t) / 1e9, "ratio": ratio(min(copy_t), min(store_t))}


def _tiered(args: argparse.Namespace, url: str | None, rule: str, disk: str | None = None
            ) -> dict[str, object]:
    layout = load_preset(args.model)
    pages = args.prefix_tokens // layout.page_size
    tokens = pages * layout.page_size
    per_prefix = retention._bytes(layout, retention._demand(layout, tokens, True))
    capacity = -(-(args.prefixes * per_prefix + int(args.slack_mib * MiB)) // 256) * 256
    # The 77 MB Qwen3-Next checkpoints are split over 16 MiB values (chunk_bytes).
    remote = RemoteTierConfig(url=url, key_prefix=f"bench-{rule}", op_timeout_s=5.0) \
        if url else None
    config = StoreConfig(capacity_bytes=capacity, stop_rule=rule,  # type: ignore[arg-type]
                         host_capacity_bytes=int(args.host_mib * MiB), remote=remote,
                         disk_path=disk, disk_size_bytes=int(args.disk_mib * MiB) if disk else 0)
    with TierStore(layout, config) as store:
        if store.remote is not None:
            store.remote.clear()
        retention.fill_prefixes(store, args.prefixes, tokens)
        long_request = store.allocate(retention._demand(layout, args.long_tokens, True))
        assert long_request is not None, "the long request does not fit"
        for kind, ids in long_request.blocks.items():
            store.free(kind, ids)  # it completed; unrelated, so not cached
        before = store.stats().hit_requests
        start = time.perf_counter()
        recomputed = 0
        for i in range(args.prefixes):
            m = store.match(retention._prefix(i, tokens) + [0] * args.suffix_tokens)
            recomputed += tokens + args.suffix_tokens - m.tokens
            if m.lease is not None:
                store.release(m.lease)
        elapsed = time.perf_counter() - start
        after = store.stats()
        served = {t: after.hit_requests.get(t, 0) - before.get(t, 0)
                  for t in ("l1", "l2", "disk", "l3", "miss")}
        store.check_integrity()
        if store.remote is not None:
            store.remote.clear()
        return {"rule": rule + ("+disk" if disk else ""),
                **{f"from_{t}": n for t, n in served.items()},
                "recomputed_tokens": recomputed, "repeat_wall_s": elapsed,
                "moved_mib": {k: v / MiB for k, v in after.moved_bytes.items() if v}}


def run(args: argparse.Namespace) -> dict:
    sizes = [int(s) * 1024 for s in str(args.copy_sizes_kib).split(",")]
    copies = [_host_copy(u, args.copy_mib * MiB) for u in sizes]
    if args.redis_url:
        rows = [_tiered(args, args.redis_url, rule) for rule in ("unified", "per_kind")]
    else:
        from remote_tier.embedded import RedisServer

        with RedisServer() as server:
            rows = [_tiered(args, server.url, rule) for rule in ("unified", "per_kind")]
    if args.disk_mib > 0:
        with tempfile.TemporaryDirectory(prefix="tierstore-bench-tiers-") as where:
            rows.append(_tiered(args, None, "unified", where))
    return {"host_copy": copies, "retention_with_tiers": rows, "model": args.model,
            "prefixes": args.prefixes, "host_mib": args.host_mib}


def render(result: dict) -> str:
    rows = [{k: v for k, v in r.items() if k != "moved_mib"}
            for r in result["retention_with_tiers"]]
    return "\n".join([
        "host tier: device->host batched copy vs one contiguous copy_ of the same bytes",
        table(result["host_copy"], ["envelope_kib", "mib", "host_store_gbps", "copy_gbps",
                                    "ratio"]),
        "",
        f"retention with L2 ({result['host_mib']:.0f} MiB) + L3 (Redis) (+disk: L2 + the local "
        f"disk tier, no Redis), {result['model']}, "
        f"{result['prefixes']} prefixes re-requested after the long request:",
        table(rows, ["rule", "from_l1", "from_l2", "from_disk", "from_l3", "from_miss",
                     "recomputed_tokens", "repeat_wall_s"]),
    ])
