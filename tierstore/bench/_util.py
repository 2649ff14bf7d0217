"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], *, repeat: int = 5, min_time: float = 0.05) -> float:
    """Seconds per call of ``fn``: the best of ``repeat`` rounds, each looping for ``min_time``."""
    best = float("inf")
    for _ in range(repeat):
        calls = 0
        start = time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        best = min(best, elapsed / calls)
    return best


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None (``null`` in JSON: undefined) when ``den`` is 0 or either is
    unknown. A tiny run can measure 0 for a coarse figure (CPU time counts 10 ms ticks), and a
    ratio against it is undefined, not a crash."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def fmt_ratio(value: float | None, spec: str = ".2f") -> str:
    """``value`` formatted with ``spec``, or ``n/a`` for an undefined ratio."""
    return "n/a" if value is None else format(value, spec)


def table(rows: list[dict[str, object]], columns: list[str]) -> str:
    """A plain fixed-width text table."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
