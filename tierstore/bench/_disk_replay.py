"""The replay's disk configuration, for ``bench replay --disk`` and ``bench disk --replay``: a
trace through two stores side by side, L1 + L2 + disk against L1 + a larger L2 (fractions of
the working set).

Both stores take the same requests in the same order (:class:`tierstore.replay.driver.Replay`),
with every hit's envelopes checked against the bytes written; reported per configuration:
the share of prompt tokens hit per tier, bytes moved per tier pair (real sizes), the disk
tier's own I/O (slots, scaled bytes and seconds per direction) and the replay's wall time.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from typing import Any

from tierstore.config import StoreConfig
from tierstore.layout import load_preset
from tierstore.replay.driver import Replay
from tierstore.replay.synth import SynthSpec, synthesize, to_jsonl
from tierstore.replay.targets import LibraryTarget
from tierstore.replay.trace import TraceRequest, parse_trace, working_set
from tierstore.scaling import auto_factor, scale_layout
from tierstore.store import TierStore

MiB = 1 << 20
SIZES = (0.05, 0.05, 0.30, 0.35)  # L1, L2 and disk; the L2 of the configuration without disk


def parse_sizes(text: str) -> tuple[float, float, float, float]:
    """``L1,L2,DISK,L2_ONLY`` fractions (``0.05,0.05,0.30,0.35``); ValueError otherwise."""
    parts = [float(p) for p in text.split(",")]
    if len(parts) != 4 or not all(p > 0 for p in parts):
        raise ValueError(f"give four positive fractions L1,L2,DISK,L2_ONLY, got {text!r}")
    return parts[0], parts[1], parts[2], parts[3]


def compare(model: str, l1: float, l2: float, disk: float, l2_only: float, *,
            scaled_mib: float = 256.0, limit: int | None = None,
            requests: Sequence[TraceRequest] | None = None, page_size: int = 512,
            directory: str | None = None) -> dict[str, Any]:
    """Replay ``requests`` (default: the generated trace, first ``limit``) against {L1 ``l1``,
    L2 ``l2``, disk ``disk``} and {L1 ``l1``, L2 ``l2_only``} (fractions of the working set's
    bytes); the disk in a temporary directory under ``directory``."""
    if requests is None:
        requests = parse_trace(to_jsonl(synthesize(SynthSpec())).splitlines(), limit)
    real = load_preset(model, page_size=page_size)
    ws = working_set(requests, real)
    scaled = scale_layout(real, auto_factor(ws.total_bytes, int(scaled_mib * MiB)))

    def size(fraction: float) -> int:
        return scaled.scaled_bytes(fraction * ws.total_bytes)

    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tierstore-disk-replay-", dir=directory) as where:
        configs = {
            f"l1_{l1:g}+l2_{l2:g}+disk_{disk:g}": StoreConfig(
                capacity_bytes=size(l1), host_capacity_bytes=size(l2), disk_path=where,
                disk_size_bytes=size(disk), disk_mac_key=b"bench-disk-replay-secret-0123456"),
            f"l1_{l1:g}+l2_{l2_only:g}": StoreConfig(capacity_bytes=size(l1),
                                                     host_capacity_bytes=size(l2_only)),
        }
        targets = [LibraryTarget(name, TierStore(scaled.layout, cfg))
                   for name, cfg in configs.items()]
        try:
            start = time.perf_counter()
            series = Replay(targets, scaled.layout).run(requests, progress=False)
            wall = time.perf_counter() - start
            direct = targets[0].store.disk.tier.direct if targets[0].store.disk else None
            for t in targets:
                t.check()
                s = t.store.stats()
                queried = max(1, s.tokens_queried)
                rows[t.name] = {
                    "hit_rate": s.tokens_hit / queried,
                    "hit_share": {k: v / queried for k, v in s.hit_tokens.items()},
                    "moved_real_mib": {k: scaled.real_bytes(v) / MiB
                                       for k, v in s.moved_bytes.items() if v},
                    "store_wall_s": series.wall_s.get(t.name, 0.0),
                    "verified_envelopes": t.verified,
                    "disk": s.disk and {k: s.disk[k] for k in (
                        "read_s", "write_s", "reads", "writes", "bytes_read", "bytes_written",
                        "misses")},
                }
        finally:
            for t in targets:
                t.close()
    return {"model": model, "requests": len(requests), "working_set_real_gib":
            ws.total_bytes / (1 << 30), "scale": scaled.factor, "replay_wall_s": wall,
            "sizes": {"l1": l1, "l2": l2, "disk": disk, "l2_only": l2_only},
            "disk_direct": direct, "configs": rows}


def render(r: dict[str, Any]) -> str:
    """The comparison as text: per configuration, hits by tier, real bytes moved per tier
    pair, the disk's own I/O and the store's time."""
    out = (f"disk configuration ({r['model']}, {r['requests']} requests, working set "
           f"{r['working_set_real_gib']:.1f} GiB real, run at scale 1/{1 / r['scale']:g}; disk "
           f"{'O_DIRECT' if r.get('disk_direct') else 'buffered'}):")
    for name, c in r["configs"].items():
        shares = ", ".join(f"{k} {v:.1%}" for k, v in c["hit_share"].items())
        moved = ", ".join(f"{k} {v / 1024:,.1f}" for k, v in c["moved_real_mib"].items())
        out += (f"\n  {name}: hit {c['hit_rate']:.1%} ({shares}); moved GiB (real): "
                f"{moved}; store time {c['store_wall_s']:.1f} s")
        d = c.get("disk")
        if d:
            out += (f"\n    disk I/O: wrote {d['writes']:,} slots ({d['bytes_written'] / MiB:,.1f}"
                    f" MiB at scale) in {d['write_s']:.2f} s, read {d['reads']:,} slots "
                    f"({d['bytes_read'] / MiB:,.1f} MiB) in {d['read_s']:.2f} s, "
                    f"{d['misses']} verification misses")
    return out
