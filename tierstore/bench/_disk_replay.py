"""The replay with a disk tier, for ``bench disk --replay``: the generated trace through two
stores side by side, L1 + L2 + disk against L1 + a larger L2 (fractions of the working set).

Both stores take the same requests in the same order (:class:`tierstore.replay.driver.Replay`),
with every hit's envelopes checked against the bytes written; reported per configuration:
the share of prompt tokens hit per tier, bytes moved per direction and the replay's wall time.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from tierstore.config import StoreConfig
from tierstore.layout import load_preset
from tierstore.replay.driver import Replay
from tierstore.replay.synth import SynthSpec, synthesize, to_jsonl
from tierstore.replay.targets import LibraryTarget
from tierstore.replay.trace import parse_trace, working_set
from tierstore.scaling import auto_factor, scale_layout
from tierstore.store import TierStore

MiB = 1 << 20


def compare(model: str, l1: float, l2: float, disk: float, l2_only: float, *,
            scaled_mib: float = 256.0, limit: int | None = None) -> dict[str, Any]:
    """Replay the generated trace against {L1 ``l1``, L2 ``l2``, disk ``disk``} and {L1
    ``l1``, L2 ``l2_only``} (fractions of the working set's bytes)."""
    requests = parse_trace(to_jsonl(synthesize(SynthSpec())).splitlines(), limit)
    real = load_preset(model, page_size=512)
    ws = working_set(requests, real)
    scaled = scale_layout(real, auto_factor(ws.total_bytes, int(scaled_mib * MiB)))

    def size(fraction: float) -> int:
        return scaled.scaled_bytes(fraction * ws.total_bytes)

    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tierstore-disk-replay-") as where:
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
                    "disk": s.disk and {k: s.disk[k] for k in ("read_s", "write_s", "reads",
                                                                "writes", "misses")},
                }
        finally:
            for t in targets:
                t.close()
    return {"model": model, "requests": len(requests), "working_set_real_gib":
            ws.total_bytes / (1 << 30), "scale": scaled.factor, "replay_wall_s": wall,
            "configs": rows}
