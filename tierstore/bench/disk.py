"""Disk tier: envelope write/read throughput against plain sequential ``dd`` with O_DIRECT,
and the restart scan rate (extrapolated to a 100 GiB tier).

For each envelope size (``--sizes-kib``), ``--mib`` MiB of envelopes go through a
:class:`disk_tier.DiskTier` in batches of ``--batch-mib`` (slots allocated lowest-first, so a
batch is one run of consecutive slots cut into vectored calls on ``--threads`` workers,
signed with the MAC) and are read back (verified); then ``dd`` writes and reads the same
bytes in blocks of the same size with ``oflag=direct`` / ``iflag=direct`` in the same
directory (the baseline). Each side's write includes an ``fdatasync``. The filesystem of
``--dir`` and whether O_DIRECT was used are reported. Buffered mode (tmpfs) reads after
``posix_fadvise(DONTNEED)``.

The scan row fills a tier of ``--scan-mib`` MiB with 64 KiB envelopes, closes it and times the
reopen (one aligned header read per slot): slots per second, and the restart time of a 100
GiB tier at 64 KiB, 1 MiB and 4 MiB envelopes from that rate.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from disk_tier import DiskTier, SlotMeta
from disk_tier.slab import aligned
from disk_tier.slot import slot_bytes
from disk_tier.tier import SCAN_THREADS
from remote_tier.mac import Mac
from tierstore.bench import _disk_engines, _disk_replay
from tierstore.bench._util import ratio, table

MiB = 1 << 20
GiB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=None,
                        help="where the files go (default: a temporary directory in /tmp)")
    parser.add_argument("--sizes-kib", default="64,1024,4096", help="envelope sizes")
    parser.add_argument("--mib", type=int, default=512, help="bytes moved per size")
    parser.add_argument("--batch-mib", type=int, default=16, help="bytes per write/read call")
    parser.add_argument("--threads", type=int, default=4, help="disk tier I/O workers")
    parser.add_argument("--repeat", type=int, default=2, help="rounds; the best is kept")
    parser.add_argument("--scan-mib", type=int, default=512, help="tier size of the scan row")
    parser.add_argument("--buffered", action="store_true", help="force buffered I/O")
    parser.add_argument("--replay", action="store_true",
                        help="also replay the generated trace: L1 5%% + L2 5%% + disk 30%% "
                             "against L1 5%% + L2 35%% of the working set")
    parser.add_argument("--engines", action="store_true",
                        help="also time the I/O engines on the same O_DIRECT transfers: the "
                             "worker pool (--threads, and 1), aiofiles and io_uring (liburing) "
                             "where they install")
    parser.add_argument("--replay-model", default="qwen3-next-80b-a3b")
    parser.add_argument("--replay-limit", type=int, default=None, help="first N requests")


def _fs(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, check=True)
        return out.stdout.splitlines()[1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def _dd(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args], capture_output=True, check=True)
    return time.perf_counter() - start


def _tier_round(where: str, unit: int, total: int, batch: int, threads: int,
                buffered: bool) -> tuple[float, float, bool]:
    n = max(1, total // unit)
    per = max(1, batch // unit)
    mac = Mac(b"bench-disk-tier-secret-0123456789")
    size = n * slot_bytes(unit) + slot_bytes(unit)
    rows = np.random.default_rng(0).integers(0, 256, (per, unit), dtype=np.uint8)
    with DiskTier(where, size, {"kv": unit}, "bench", mac, io_threads=threads,
                  direct=False if buffered else None, weights={"kv": 1.0}) as tier:
        batches = []
        start = time.perf_counter()
        for b in range(0, n, per):
            k = min(per, n - b)
            slots = tier.alloc("kv", k)
            assert slots is not None
            metas = [SlotMeta((b + i + 1).to_bytes(32, "big"), b"", b + i) for i in range(k)]
            assert all(tier.write("kv", slots, rows[:k], metas))
            batches.append(slots)
        for f in tier.files.values():
            os.fdatasync(f.fd)
        write_s = time.perf_counter() - start
        if not tier.direct:
            for f in tier.files.values():
                os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for slots in batches:
            _, ok = tier.read("kv", slots)
            assert all(ok), "a slot failed verification"
        read_s = time.perf_counter() - start
        direct = tier.direct
    for name in os.listdir(where):
        os.unlink(os.path.join(where, name))
    return write_s, read_s, direct


def _dd_round(where: str, unit: int, total: int, direct: bool) -> tuple[float, float]:
    n = max(1, total // unit)
    path = os.path.join(where, "dd.bin")
    src = os.path.join(where, "src.bin")  # random bytes, cached: dd's input costs no disk
    with open(src, "wb") as f:
        f.write(np.random.default_rng(1).integers(0, 256, unit, dtype=np.uint8).tobytes())
    oflag = ["oflag=direct"] if direct else []
    iflag = ["iflag=direct"] if direct else []
    w = _dd(["if=/dev/zero", f"of={path}", f"bs={unit}", f"count={n}", "conv=fdatasync",
             *oflag])
    if not direct:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    r = _dd([f"if={path}", "of=/dev/null", f"bs={unit}", *iflag])
    os.unlink(path)
    os.unlink(src)
    return w, r


def _scan(where: str, total: int, threads: int) -> dict[str, Any]:
    unit = 64 * 1024
    mac = Mac(b"bench-disk-tier-secret-0123456789")
    size = total
    with DiskTier(where, size, {"kv": unit}, "bench", mac, io_threads=threads,
                  weights={"kv": 1.0}) as tier:
        n = tier.nslots["kv"]
        rows = np.zeros((min(n, 128), unit), np.uint8)
        for b in range(0, n, 128):
            k = min(128, n - b)
            slots = tier.alloc("kv", k)
            assert slots is not None
            tier.write("kv", slots, rows[:k], [SlotMeta((b + i + 1).to_bytes(32, "big"), b"",
                                                        0) for i in range(k)])
    raw = _raw_headers(os.path.join(where, "kv.slab"), n, slot_bytes(unit))
    os.unlink(os.path.join(where, "index.bin"))  # as after a crash: the scan
    start = time.perf_counter()
    with DiskTier(where, size, {"kv": unit}, "bench", mac, io_threads=threads,
                  weights={"kv": 1.0}) as tier:
        scan = time.perf_counter() - start
        found = len(tier.recovered)
        assert tier.snapshot()["restart"] == "scan"
    start = time.perf_counter()  # after the clean close just now: the checkpointed index
    with DiskTier(where, size, {"kv": unit}, "bench", mac, io_threads=threads,
                  weights={"kv": 1.0}) as tier:
        from_index = time.perf_counter() - start
        assert tier.snapshot()["restart"] == "index" and len(tier.recovered) == found
    rate = n / scan
    for name in os.listdir(where):
        os.unlink(os.path.join(where, name))
    return {"slots": n, "recovered": found, "open_s": scan, "slots_per_s": rate,
            "raw_header_reads_per_s": n / raw, "vs_raw": ratio(raw, scan),
            "index_open_s": from_index, "index_slots_per_s": n / from_index,
            "restart_100gib_s": {f"{kib}KiB": 100 * GiB / slot_bytes(kib * 1024) / rate
                                 for kib in (64, 1024, 4096)},
            "clean_restart_100gib_s": {f"{kib}KiB": 100 * GiB / slot_bytes(kib * 1024)
                                       / (n / from_index) for kib in (64, 1024, 4096)}}


def _raw_headers(path: str, n: int, slot: int) -> float:
    """Seconds to read one aligned block per slot (O_DIRECT where allowed), as the scan does,
    with nothing parsed: the floor of the restart scan."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, os.O_RDONLY)

    def read(lo: int) -> None:
        block = aligned(4096)
        for i in range(lo, min(n, lo + 64)):
            os.preadv(fd, [block.data], i * slot)

    start = time.perf_counter()
    with ThreadPoolExecutor(SCAN_THREADS) as pool:
        list(pool.map(read, range(0, n, 64)))
    os.close(fd)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = args.dir or tempfile.mkdtemp(prefix="tierstore-bench-disk-", dir="/tmp")
    where = os.path.join(base, "tier")
    os.makedirs(where, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        for kib in (int(x) for x in args.sizes_kib.split(",")):
            unit = kib * 1024
            best: dict[str, float] = {}
            direct = False
            for _ in range(max(1, args.repeat)):  # the two sides alternate each round
                w, r, direct = _tier_round(where, unit, args.mib * MiB, args.batch_mib * MiB,
                                           args.threads, args.buffered)
                dw, dr = _dd_round(base, unit, args.mib * MiB, direct)
                for key, v in (("w", w), ("r", r), ("dw", dw), ("dr", dr)):
                    best[key] = min(best.get(key, v), v)
            nbytes = max(1, args.mib * MiB // unit) * unit
            rows.append({
                "envelope_kib": kib, "mib": nbytes / MiB, "direct": direct,
                "tier_write_mib_s": nbytes / MiB / best["w"],
                "tier_read_mib_s": nbytes / MiB / best["r"],
                "dd_write_mib_s": nbytes / MiB / best["dw"],
                "dd_read_mib_s": nbytes / MiB / best["dr"],
                "write_vs_dd": ratio(best["dw"], best["w"]),
                "read_vs_dd": ratio(best["dr"], best["r"]),
            })
        scan = _scan(where, args.scan_mib * MiB, args.threads)
        engines = _disk_engines.compare(base, [int(x) for x in args.sizes_kib.split(",")],
                                        args.mib * MiB, args.threads, args.repeat
                                        ) if args.engines else None
        replay = _disk_replay.compare(args.replay_model, *_disk_replay.SIZES,
                                      limit=args.replay_limit, directory=args.dir
                                      ) if args.replay else None
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return {"dir": base, "filesystem": _fs(base if os.path.exists(base) else "/tmp"),
            "threads": args.threads, "batch_mib": args.batch_mib, "rows": rows, "scan": scan,
            "engines": engines, "replay": replay}


def render(result: dict[str, Any]) -> str:
    head = (f"disk tier on {result['filesystem']} ({result['dir']}), "
            f"{result['threads']} I/O threads, batches of {result['batch_mib']} MiB\n")
    body = table(result["rows"], ["envelope_kib", "direct", "tier_write_mib_s", "dd_write_mib_s",
                                  "write_vs_dd", "tier_read_mib_s", "dd_read_mib_s",
                                  "read_vs_dd"])
    s = result["scan"]
    scan = (f"\nrestart scan: {s['slots']} slots in {s['open_s']:.3f} s = "
            f"{s['slots_per_s']:,.0f} slots/s ({s['vs_raw']:.2f}x of bare header reads, "
            f"{s['raw_header_reads_per_s']:,.0f}/s); a 100 GiB tier: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in s["restart_100gib_s"].items())
            + f"\nclean restart (checkpointed index): {s['index_open_s']:.3f} s = "
            f"{s['index_slots_per_s']:,.0f} slots/s; a 100 GiB tier: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in s["clean_restart_100gib_s"].items()))
    out = head + body + scan
    if result.get("engines"):
        e = result["engines"]
        out += (f"\nI/O engines, O_DIRECT, {e['mib']:.0f} MiB per size, {e['depth']} calls in "
                f"flight, nothing signed or copied:\n"
                + table(e["rows"], ["envelope_kib", "engine", "write_mib_s", "read_mib_s",
                                    "write_vs_threads", "read_vs_threads"])
                + "".join(f"\n  {k}: not measured: {v}" for k, v in e["skipped"].items()))
    if result.get("replay"):
        out += "\n" + _disk_replay.render(result["replay"])
    return out
