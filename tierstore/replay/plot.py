"""A self-contained HTML page (inline SVG, no scripts, no network) of hit rate over trace
time, one line per configuration: per window of trace time, and cumulative; and, per
configuration, its prompt tokens by outcome (hits by tier, losses by reason)."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

_COLORS = ("#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#17becf", "#8c564b",
           "#e377c2")
# Lines of equal configurations overlap exactly (e.g. L2 + L3 and the infinite cache): dashes
# of different lengths keep each one visible.
_DASHES = ("", "7 4", "2 3", "", "10 3 2 3", "4 4", "1 4", "12 4")
_W, _H, _PAD_L, _PAD_R, _PAD_T, _PAD_B = 760, 300, 56, 170, 28, 40

Points = Sequence[tuple[float, float]]


def _step(span: float) -> float:
    """A round tick step (1, 2 or 5 x 10^k) giving five to ten ticks over ``span``."""
    raw = max(span, 1e-9) / 6
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _panel(title: str, lines: Mapping[str, Points], t_max: float, *, final: bool) -> str:
    """One SVG chart: x = trace seconds [0, t_max], y = hit rate [0, 1]; ``final`` adds each
    line's last value to the legend."""
    pw, ph = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B

    def x(t: float) -> float:
        return _PAD_L + pw * (t / t_max if t_max else 0.0)

    def y(r: float) -> float:
        return _PAD_T + ph * (1 - r)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{_PAD_L}" y="16" font-size="13" font-weight="bold">'
           f'{html.escape(title)}</text>']
    for i in range(6):  # y grid: 0 .. 100 %
        r = i / 5
        out.append(f'<line x1="{_PAD_L}" x2="{_PAD_L + pw}" y1="{y(r):.1f}" y2="{y(r):.1f}" '
                   f'stroke="#ddd"/><text x="{_PAD_L - 6}" y="{y(r) + 4:.1f}" '
                   f'text-anchor="end">{r:.0%}</text>')
    step = _step(t_max)
    for i in range(int(t_max / step) + 1):  # x ticks
        t = i * step
        out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{_PAD_T + ph}" '
                   f'y2="{_PAD_T + ph + 4}" stroke="#555"/><text x="{x(t):.1f}" '
                   f'y="{_PAD_T + ph + 16}" text-anchor="middle">{t:.0f}</text>')
    out.append(f'<text x="{_PAD_L + pw / 2}" y="{_H - 6}" text-anchor="middle">'
               f'trace time (s)</text>')
    out.append(f'<rect x="{_PAD_L}" y="{_PAD_T}" width="{pw}" height="{ph}" fill="none" '
               f'stroke="#555"/>')
    for i, (name, pts) in enumerate(lines.items()):
        color = _COLORS[i % len(_COLORS)]
        coords = " ".join(f"{x(t):.1f},{y(r):.1f}" for t, r in pts)
        dash = _DASHES[i % len(_DASHES)]
        style = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8"{style} '
                   f'points="{coords}"><title>{html.escape(name)}</title></polyline>')
        ly = _PAD_T + 14 + 16 * i
        lx = _PAD_L + pw + 12
        last = f" {pts[-1][1]:.1%}" if pts and final else ""
        out.append(f'<line x1="{lx}" x2="{lx + 22}" y1="{ly - 4}" y2="{ly - 4}" '
                   f'stroke="{color}" stroke-width="2"{style}/><text x="{lx + 28}" y="{ly}">'
                   f'{html.escape(name)}{last}</text>')
    out.append("</svg>")
    return "\n".join(out)


# Outcome colours: hits in greens/blues, losses in warm colours (attribution reasons).
_OUTCOME_COLORS = {"hit l1": "#2ca02c", "hit l2": "#98df8a", "hit l3": "#1f77b4",
                   "cold": "#7f7f7f", "evicted": "#d62728", "no_checkpoint": "#9467bd",
                   "swa_window": "#ff7f0e", "partial_page": "#c7c7c7",
                   "l3_unavailable": "#e377c2", "no_room": "#8c564b"}


def _outcomes(shares: Mapping[str, Mapping[str, float]]) -> str:
    """One stacked bar per configuration: the share of prompt tokens of each outcome."""
    bar_h, gap, left, width = 18, 8, 110, _W - 110 - 20
    height = 40 + len(shares) * (bar_h + gap) + 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           '<text x="8" y="16" font-size="13" font-weight="bold">Prompt tokens by outcome: '
           'hits by tier, losses by reason</text>']
    for i, (name, parts) in enumerate(shares.items()):
        y = 30 + i * (bar_h + gap)
        out.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">'
                   f'{html.escape(name)}</text>')
        x = float(left)
        for outcome, share in parts.items():
            w = width * share
            if w <= 0:
                continue
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" '
                       f'fill="{_OUTCOME_COLORS.get(outcome, "#bbb")}"><title>'
                       f'{html.escape(name)}: {html.escape(outcome)} {share:.1%}</title></rect>')
            x += w
    y = 30 + len(shares) * (bar_h + gap) + 8
    for j, (outcome, c) in enumerate(_OUTCOME_COLORS.items()):
        lx, ly = 8 + (j % 5) * 150, y + 16 * (j // 5)
        out.append(f'<rect x="{lx}" y="{ly}" width="10" height="10" fill="{c}"/>'
                   f'<text x="{lx + 14}" y="{ly + 9}">{html.escape(outcome)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def write_html(path: str | Path, title: str, subtitle: str, window_s: float,
               windowed: Mapping[str, Points], cumulative: Mapping[str, Points],
               outcomes: Mapping[str, Mapping[str, float]] | None = None) -> Path:
    """Write the page to ``path`` (parents created); returns the path. ``outcomes`` (per
    configuration, the share of prompt tokens per outcome) adds a stacked-bar panel."""
    t_max = max((p[-1][0] for p in (*windowed.values(), *cumulative.values()) if p),
                default=1.0)
    body = "\n".join([
        "<!DOCTYPE html>", '<html><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title></head>",
        '<body style="font-family:sans-serif;max-width:800px">',
        f"<h2>{html.escape(title)}</h2>", f"<p>{html.escape(subtitle)}</p>",
        _panel(f"Prompt-token hit rate per {window_s:g} s window", windowed, t_max,
               final=False),
        _panel("Cumulative prompt-token hit rate", cumulative, t_max, final=True),
        *([_outcomes(outcomes)] if outcomes else []),
        "</body></html>", ""])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(body, encoding="utf-8")
    return out
