"""vLLM secondary tier: store and load blocks/s and GB/s of the tierstore tier vs vLLM's own
filesystem tier (``tiering/fs``) on this machine, same blocks, same run.

Each contender is built by vLLM 0.33's ``SecondaryTierFactory`` over one primary memory of
``--blocks`` rows (a block per row, as vLLM's CPU primary tier lays them out) and driven as
vLLM's tiering manager drives it: jobs of ``--job-blocks`` blocks submitted at once
(``submit_store`` / ``submit_load``), then ``get_finished_jobs`` polled until all report.
Block sizes are those of two real presets: a 16-token block of every full-attention layer
(bf16, one TP rank). Contenders (each round runs fs and ``tierstore shm`` back to back,
which first alternating, then the others; per-round ratios, their median and minimum over
``--rounds``):

- ``fs``: vLLM's filesystem tier on a temporary directory (``--dir``), its default 16 + 16
  threads; O_DIRECT where the filesystem takes it, else buffered (reported);
- ``tierstore shm``: the tierstore tier against ``tierstore serve`` (a child process, as
  vLLM would use it) whose storage API keeps a host copy in a shared segment and writes every
  block through to a private valkey/redis-server (the shared fleet tier); the tier copies each
  block between the primary row and the segment itself;
- ``tierstore http``: the same service, every block over HTTP;
- ``tierstore shm, no L3``: shared memory to a service without Redis: host-local, like fs.

One untimed warm-up round per contender first (segment pages, directories, connections).
Each round stores fresh keys, then (untimed) drops the page cache and waits for the service's
background Redis writes, then loads every block into other rows (bytes checked, untimed). The
fs tier is not fsynced, as vLLM runs it. ``--drop fadvise`` (default): ``sync`` and
``posix_fadvise(DONTNEED)`` on every file of the fs tier, i.e. exactly the pages that would
let its loads skip the disk; ``--drop drop_caches``: ``echo 1 > /proc/sys/vm/drop_caches``
(root only; it also evicts every process's code pages, which the contender loading next pays
for; refused, it falls back to fadvise). Which one ran is reported as ``page_cache``.
Needs vLLM (``pip install --no-deps vllm==0.33.0`` and ``pip install 'tierstore[vllm]'``)
and ``redis-server``/valkey.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from remote_tier.embedded import RedisServer
from tierstore.bench._util import fmt_ratio, table
from tierstore.layout import load_preset
from tierstore.service.running import serve_process

_INSTALL = "pip install --no-deps vllm==0.33.0 && pip install 'tierstore[vllm]'"
PRESETS = ("gpt-oss-20b", "nemotron-h-8b")
BLOCK_TOKENS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", nargs="+", default=list(PRESETS),
                        help="presets whose full-attention block sizes are measured")
    parser.add_argument("--blocks", type=int, default=128, help="blocks stored per round")
    parser.add_argument("--job-blocks", type=int, default=16, help="blocks per job")
    parser.add_argument("--rounds", type=int, default=5, help="rotating rounds (median)")
    parser.add_argument("--threads", type=int, default=4,
                        help="tierstore tier's load and store threads (each)")
    parser.add_argument("--dir", default=None, help="parent of the fs tier's directory")
    parser.add_argument("--drop", choices=("fadvise", "drop_caches"), default="fadvise",
                        help="how the fs tier's pages leave the page cache before its loads")


def run(args: argparse.Namespace) -> dict:
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
    except ImportError as exc:
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    load_before = os.getloadavg()
    results = [_preset(args, name, SecondaryTierFactory, TieringOffloadingSpec)
               for name in args.presets]
    return {"available": True, "blocks": args.blocks, "job_blocks": args.job_blocks,
            "rounds": args.rounds, "threads": args.threads, "presets": results,
            "load_average": {"before": load_before, "after": os.getloadavg()}}


def _spec(spec_cls: Any, model: str, row_bytes: int, rows: int) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    return spec_cls(OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS, layer_names=("attn",),
                                      group_id=0),),
        worker_kv_bytes_per_block=row_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": rows * row_bytes, "secondary_tiers": []},
        engine_id=f"bench-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False)))


def _preset(args: argparse.Namespace, name: str, factory: Any, spec_cls: Any) -> dict:
    layout = load_preset(name, page_size=BLOCK_TOKENS)
    assert layout.kv is not None, f"{name} has no full-attention KV"
    row = -(-layout.kv.raw_nbytes // 4096) * 4096  # vLLM pads a row to the page size
    n = args.blocks
    # Rows [0, n) hold the stored blocks; loads go into rows [n, 2n).
    # Page-aligned, as vLLM's primary region (an mmap) is: O_DIRECT needs aligned buffers.
    region = mmap.mmap(-1, 2 * n * row)
    primary = np.frombuffer(region, dtype=np.int8).reshape(2 * n, row)
    primary[:n] = np.random.default_rng(0).integers(-128, 128, (n, row), dtype=np.int8)
    view = primary.data  # the 2-D memoryview vLLM hands its tiers
    spec = _spec(spec_cls, layout.name, row, 2 * n)
    working = n * row
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(dir=args.dir))
        redis = stack.enter_context(RedisServer())
        # 4x the working set: a principal may hold a quarter of it reserved (the service's
        # default), i.e. every store job of a round in flight at once.
        host = f"{-(-4 * working // 2**20)}MiB"
        shared = stack.enter_context(_serve(["--redis-url", redis.url, "--kv-host", host]))
        local = stack.enter_context(_serve(["--no-redis", "--kv-host", host]))
        ours = {"type": "TierStoreTier", "module_path": "tierstore.integrations.vllm",
                "load_threads": args.threads, "store_threads": args.threads}
        tiers = {"fs": factory.create_secondary_tier({"type": "fs", "root_dir": tmp}, view,
                                                     spec),
                 "tierstore shm": factory.create_secondary_tier(
                     {**ours, "url": shared, "transport": "shm"}, view, spec),
                 "tierstore http": factory.create_secondary_tier(
                     {**ours, "url": shared, "transport": "http"}, view, spec),
                 "tierstore shm, no L3": factory.create_secondary_tier(
                     {**ours, "url": local, "transport": "shm"}, view, spec)}
        urls = {"tierstore shm": shared, "tierstore http": shared,
                "tierstore shm, no L3": local}
        for tier in tiers.values():
            stack.callback(tier.shutdown)
        samples: dict[str, dict[str, list[float]]] = {
            label: {"store": [], "load": []} for label in tiers}
        cache_modes: set[str] = set()
        order = list(tiers)
        for label in order:  # untimed: first touch of segments, directories, connections
            _round(tiers[label], f"{name}/warm/{label}", primary, n, args.job_blocks, tmp,
                   urls.get(label), args.drop)
        for r in range(args.rounds):
            pair = ["fs", "tierstore shm"][::1 if r % 2 == 0 else -1]
            others = [label for label in order if label not in pair][::1 - 2 * (r % 2)]
            for label in pair + others:
                store_s, load_s, mode = _round(tiers[label], f"{name}/{r}/{label}", primary,
                                               n, args.job_blocks, tmp, urls.get(label),
                                               args.drop)
                samples[label]["store"].append(store_s)
                samples[label]["load"].append(load_s)
                if label == "fs":
                    cache_modes.add(mode)
        o_direct = bool(getattr(tiers["fs"], "_use_o_direct", False))
    rows = []
    for label, s in samples.items():
        store_s, load_s = statistics.median(s["store"]), statistics.median(s["load"])
        rows.append({"tier": label, "store_blocks_s": n / store_s,
                     "store_gb_s": n * row / store_s / 1e9, "load_blocks_s": n / load_s,
                     "load_gb_s": n * row / load_s / 1e9})
    return {"preset": name, "block_bytes": row, "fs_o_direct": o_direct,
            "page_cache": "/".join(sorted(cache_modes)), "rows": rows,
            "vs_fs": {label: _vs_fs(samples[label], samples["fs"])
                      for label in order if label != "fs"}}


def _vs_fs(ours: dict[str, list[float]], fs: dict[str, list[float]]) -> dict[str, Any]:
    """Per operation: the ratio of throughputs in each round (fs seconds / ours, both timed
    in that round), their median and minimum."""
    out: dict[str, Any] = {}
    for op in ("store", "load"):
        per_round = [f / o for o, f in zip(ours[op], fs[op], strict=True)]
        out[op] = statistics.median(per_round)
        out[f"{op}_min"] = min(per_round)
        out[f"{op}_rounds"] = per_round
    return out


def _round(tier: Any, tag: str, primary: np.ndarray, n: int, job_blocks: int, fs_dir: str,
           url: str | None, drop: str = "fadvise") -> tuple[float, float, str]:
    """Seconds to store rows [0, n) under fresh keys, and to load them into rows [n, 2n);
    how the page cache was dropped in between."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    keys = [make_offload_key(hashlib.sha256(f"{tag}/{i}".encode()).digest(), 0)
            for i in range(n)]
    ctx = ReqContext(req_id=tag)

    def jobs(is_load: bool, base: int, first_id: int) -> list[Any]:
        return [TransferJob(job_id=first_id + j, keys=keys[s:s + job_blocks],
                            chunk_ids=np.arange(base + s, base + min(s + job_blocks, n),
                                                dtype=np.int32),
                            is_promotion=is_load, req_context=ctx)
                for j, s in enumerate(range(0, n, job_blocks))]

    stores, loads = jobs(False, 0, 0), jobs(True, n, 1 << 20)
    primary[n:] = 0
    start = time.perf_counter()
    for job in stores:
        tier.submit_store(job)
    _wait(tier, len(stores), tag)
    store_s = time.perf_counter() - start
    mode = _drop_page_cache(fs_dir, drop)
    while url is not None and _behind_bytes(url):  # untimed: Redis writes still behind
        time.sleep(0.001)
    start = time.perf_counter()
    for job in loads:
        tier.submit_load(job)
    _wait(tier, len(loads), tag)
    load_s = time.perf_counter() - start
    assert np.array_equal(primary[n:], primary[:n]), f"{tag}: wrong bytes loaded"
    return store_s, load_s, mode


def _wait(tier: Any, count: int, tag: str) -> None:
    """Poll ``get_finished_jobs`` (as the manager does each step) until ``count`` reported."""
    done = 0
    while done < count:
        finished = list(tier.get_finished_jobs())
        assert all(r.success for r in finished), f"{tag}: a job failed"
        done += len(finished)
        if done < count:
            time.sleep(0.0002)


@contextlib.contextmanager
def _serve(flags: list[str]) -> Iterator[str]:
    """``tierstore serve`` in a child process on a free loopback port (as vLLM would use it:
    not sharing the benchmark's interpreter); yields its URL, stops it by its pid."""
    with serve_process(["--device", "cpu", "--model", "gpt-oss-20b", "--l1", "16MiB",
                        "--l2", "0", *flags]) as served:
        yield served.url


def _stats(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url + "/v1/stats", timeout=5) as response:
            return dict(json.loads(response.read()))
    except OSError:
        return None


def _behind_bytes(url: str) -> int:
    """Bytes of committed values the service has yet to write to Redis."""
    stats = _stats(url)
    return 0 if stats is None else int(stats["service"]["kv"].get("redis_behind_bytes", 0))


def _drop_page_cache(directory: str, how: str = "fadvise") -> str:
    """Take the fs tier's pages out of the page cache: every clean page of the machine
    (``drop_caches``, where the kernel lets us) or those of the tier's files (``fadvise``).
    Which one happened."""
    os.sync()
    if how == "drop_caches":
        with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
            return "drop_caches"
    for root, _dirs, files in os.walk(directory):
        for file in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(root, file), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return "fadvise"


def render(result: dict) -> str:
    if not result["available"]:
        return (f"vLLM is not importable here ({result['reason']}), so there is nothing to "
                f"compare.\nInstall it with: {_INSTALL}")
    lines = []
    for p in result["presets"]:
        lines.append(f"{p['preset']}: {BLOCK_TOKENS}-token blocks of "
                     f"{p['block_bytes'] / 2**10:.0f} KiB, {result['blocks']} per round in jobs "
                     f"of {result['job_blocks']}, median of {result['rounds']} rounds; fs tier "
                     f"{'O_DIRECT' if p['fs_o_direct'] else 'buffered'}, page cache dropped by "
                     f"{p['page_cache']}")
        lines.append(table(p["rows"], ["tier", "store_blocks_s", "store_gb_s",
                                       "load_blocks_s", "load_gb_s"]))
        for name, vs in p["vs_fs"].items():
            lines.append(f"{name} / fs, per round median (min): store "
                         f"{fmt_ratio(vs['store'])}x ({fmt_ratio(vs['store_min'])}x), load "
                         f"{fmt_ratio(vs['load'])}x ({fmt_ratio(vs['load_min'])}x)")
    before, after = result["load_average"]["before"], result["load_average"]["after"]
    lines.append(f"load average (1/5/15 min): {'/'.join(f'{x:.1f}' for x in before)} before, "
                 f"{'/'.join(f'{x:.1f}' for x in after)} after")
    return "\n".join(lines)
