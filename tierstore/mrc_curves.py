"""Reading the miss-ratio shadow's tallies (:mod:`tierstore.mrc`) as curves per tier."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

# The functions here take a ``tierstore.mrc.Shadow`` (``s``), typed ``Any``: importing it, even
# for typing only, would close an import circle (tests/test_imports.py).
Shadow = Any


def edges(capacities: Mapping[str, int], multiples: Sequence[float]) -> list[float]:
    """The byte sizes the curves are read at: every tier's ``above + m * C``."""
    out: set[float] = set()
    above = 0
    caps = [capacities[t] for t in ("l1", "l2", "l3") if t in capacities]
    everything = sum(caps)
    for cap in caps:
        out.update(above + m * cap for m in multiples)
        out.update(everything + (m - 1) * cap for m in multiples)  # totals
        out.add(above)
        above += cap
    return sorted(out)


def _cum(edges: list[float], hist: list[float], size: float) -> float:
    """Weighted mass at distances <= ``size`` (``size`` is one of the edges)."""
    return sum(hist[: bisect.bisect_left(edges, size) + 1])


def read(s: Shadow) -> dict[str, object]:
    """``Shadow.curves`` of what the shadow has played so far."""
    def cum(hist: list[float], size: float) -> float:
        return _cum(s.edges, hist, size)

    tokens = s.tokens or 1
    out: dict[str, object] = {}
    above = 0
    caps = [(t, s.capacities[t]) for t in ("l1", "l2", "l3") if t in s.capacities]
    all_bytes = sum(c for _, c in caps)
    hist = s._hist
    for tier, cap in caps:
        base = cum(hist, above)
        hit, total, kinds = [], [], {}
        for j, m in enumerate(s.multiples):
            size = above + m * cap
            everything = all_bytes + (m - 1) * cap
            if s._overlap and tier == "l2":  # counted per multiple as they came
                hit.append(s._l2_hit[j] / tokens)
                below = cum(hist, everything) - cum(hist, size)  # L3's
                total.append((sum(hist) if s.unbounded_below else
                              cum(hist, above) + s._l2_hit[j] + below) / tokens)
                continue
            hit.append((cum(hist, size) - base) / tokens)
            if s.unbounded_below:
                total.append(sum(hist) / tokens)
            elif s._overlap and tier == "l1":
                total.append(s._l1_total[j] / tokens)
            else:
                total.append(cum(hist, everything) / tokens)
        for kind in s.kinds:
            refs = s._kind_refs[kind] or 1.0
            if s._overlap and tier == "l2":
                kinds[kind] = [v / refs for v in s._l2_kind[kind]]
                continue
            h = s._kind_hist[kind]
            b = cum(h, above)
            kinds[kind] = [(cum(h, above + m * cap) - b) / refs
                           for m in s.multiples]
        out[tier] = {"capacity_bytes": cap, "hit_rate": hit, "total_hit_rate": total,
                     "entries": kinds}
        above += cap
    pages, ends = s.tracked()
    return {"multiples": list(s.multiples), "tiers": out,
            "sampling": {"rate": s.rate, "end_rate": s.end_rate,
                         "tracked_pages": pages, "tracked_ends": ends,
                         "max_tracked": s.max_tracked,
                         "requests": s.requests, "tokens": s.tokens}}
