"""``bench replay --mrc``: the miss-ratio curves a replay's stores estimated, checked against
real replays with one tier resized.

For each configuration of the first run (the infinite cache aside) and each tier its curve
covers, the same trace is replayed with that tier at 0.5x, 2x and 4x its size (the others as
they were); the real share of prompt tokens that tier served is set against the curve's
estimate at that multiple. Errors are in points (percentage points of prompt tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tierstore.replay.experiment import Setup, Size, run
from tierstore.replay.targets import BASELINES

CHECKED = (0.5, 2.0, 4.0)


def _scaled(size: Size, m: float) -> Size:
    if size.fraction is not None:
        return Size(fraction=size.fraction * m)
    assert size.nbytes is not None
    return Size(nbytes=int(size.nbytes * m))


def check(setup: Setup, result: dict[str, Any], multiples: Sequence[float] = CHECKED
          ) -> dict[str, Any]:
    """Replay ``setup`` again per (configuration, tier, multiple); estimate vs real, per
    point, and the largest error."""
    keys = {b.name: k for k, b in BASELINES.items()}
    points: list[dict[str, Any]] = []
    for row in result["rows"]:
        mrc = row.get("mrc")
        if mrc is None or row["config"] == "infinite":
            continue
        listed = mrc["multiples"]
        for tier, curve in mrc["tiers"].items():
            for m in multiples:
                if m not in listed:
                    continue
                sizes = {tier: _scaled(getattr(setup, tier), m)}
                resized = dataclasses.replace(setup, configs=keys[row["config"]], plot=None,
                                              progress=False, **sizes)  # type: ignore[arg-type]
                (real,) = run(resized)["rows"]
                i = listed.index(m)
                est, got = curve["hit_rate"][i], real[f"hit_{tier}"]
                est_total, got_total = curve["total_hit_rate"][i], real["hit_rate"]
                points.append({
                    "config": row["config"], "tier": tier, "multiple": m,
                    "estimate": est, "real": got, "error_points": 100 * (est - got),
                    "estimate_total": est_total, "real_total": got_total,
                    "total_error_points": 100 * (est_total - got_total)})
    worst = max((abs(p["error_points"]) for p in points), default=0.0)
    worst_total = max((abs(p["total_error_points"]) for p in points), default=0.0)
    return {"points": points, "max_abs_error_points": worst,
            "max_abs_total_error_points": worst_total}


def render(check_result: dict[str, Any]) -> str:
    """The comparison as text lines."""
    lines = ["miss-ratio curves vs real replays (share of prompt tokens the tier served):"]
    for p in check_result["points"]:
        lines.append(f"  {p['config']:>12} {p['tier']} x{p['multiple']:g}: estimate "
                     f"{p['estimate']:.1%}, real {p['real']:.1%} ({p['error_points']:+.1f} "
                     f"pts); total {p['estimate_total']:.1%} vs {p['real_total']:.1%} "
                     f"({p['total_error_points']:+.1f})")
    lines.append(f"  largest error {check_result['max_abs_error_points']:.1f} points "
                 f"(totals {check_result['max_abs_total_error_points']:.1f})")
    return "\n".join(lines)
