"""The live dashboard's small inline-SVG charts (a line chart, a bucket histogram) and its stylesheet.

Separate from ``dashboard.ServerDashboard`` because drawing is its own idea: these build SVG text
from plain lists (no server, no thread), and the live widget only has to call them. SVG rather than
matplotlib because a redraw after every scrape must cost next to nothing on the CPU the server shares.
"""
from __future__ import annotations

import math
from html import escape

from .prom_histogram import _bound

CSS = """<style>
.server-dashboard {font: 12px/1.4 system-ui, sans-serif; color: #222}
.server-dashboard .sd-title {font-weight: 600; font-size: 13px}
.server-dashboard .sd-status {color: #555; margin-bottom: 4px}
.server-dashboard .sd-grid {display: flex; flex-wrap: wrap; gap: 6px}
.server-dashboard .sd-panel {border: 1px solid #e4e4e4; background: #fff}
.server-dashboard svg text {font: 10px sans-serif; fill: #444}
.server-dashboard svg .sd-panel-title {font-weight: 600; fill: #222}
.server-dashboard .sd-numbers {width: 290px; font-size: 11px; border-collapse: collapse}
.server-dashboard .sd-numbers caption {font-weight: 600; text-align: left; padding: 3px 4px}
.server-dashboard .sd-numbers td {padding: 2px 4px; color: #666}
.server-dashboard .sd-numbers td + td {text-align: right; color: #222}
</style>"""
W, H, LEFT, RIGHT, TOP, BOTTOM = 290, 140, 36, 8, 20, 22


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 10 or v == int(v) else f"{v:.1f}"


def _frame(title: str, y_max: float, x_label: str = "") -> list[str]:
    x0, x1, y0, y1 = LEFT, W - RIGHT, H - BOTTOM, TOP
    return [f'<text class="sd-panel-title" x="{x0}" y="13">{escape(title)}</text>',
            f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="#999"/>',
            f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="#999"/>',
            f'<line x1="{x0}" y1="{y1}" x2="{x1}" y2="{y1}" stroke="#eee"/>',
            f'<text x="{x0 - 4}" y="{y0}" text-anchor="end">0</text>',
            f'<text x="{x0 - 4}" y="{y1 + 8}" text-anchor="end">{_num(y_max)}</text>',
            f'<text x="{x1}" y="{H - 6}" text-anchor="end">{escape(x_label)}</text>']


def svg_lines(title: str, series, step: bool = False) -> str:
    """A small line chart: ``series`` is ``[(label, colour, xs, ys), ...]`` (xs in seconds)."""
    xs_all = [x for _, _, xs, _ in series for x in xs]
    ys_all = [y for _, _, _, ys in series for y in ys]
    x_max = max(xs_all, default=0.0) or 1.0
    y_max = max(ys_all, default=0.0) * 1.1 or 1.0
    sx, sy = (W - LEFT - RIGHT) / x_max, (H - TOP - BOTTOM) / y_max
    items = _frame(title, y_max, f"{x_max:.0f} s" if xs_all else "time (s)")
    for i, (label, color, xs, ys) in enumerate(series):
        points, prev = [], None
        for x, y in zip(xs, ys):
            px, py = LEFT + sx * x, H - BOTTOM - sy * y
            if step and prev is not None:
                points.append(f"{px:.1f},{prev:.1f}")
            points.append(f"{px:.1f},{py:.1f}")
            prev = py
        if points:
            items.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(points)}"/>')
        if len(series) > 1:  # the legend, in the title's row
            items.append(f'<text x="{W - RIGHT - 58 * (len(series) - 1 - i)}" y="13" text-anchor="end" '
                         f'style="fill: {color}; font-weight: 600">{escape(label)}</text>')
    return f'<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}">{"".join(items)}</svg>'


def svg_bars(title: str, counts: list[tuple[float, float]], color: str) -> str:
    """A small histogram of per-bucket counts ``[(upper bound, count), ...]`` (the occupied range)."""
    used = [i for i, (_, c) in enumerate(counts) if c > 0]
    if used:
        counts = counts[max(used[0] - 1, 0): used[-1] + 2]
    y_max = max((c for _, c in counts), default=0.0) or 1.0
    n = max(len(counts), 1)
    width = (W - LEFT - RIGHT) / n
    items = _frame(title, y_max)
    for i, (le, c) in enumerate(counts):
        h = (H - TOP - BOTTOM) * c / y_max
        x = LEFT + i * width
        items.append(f'<rect x="{x + 1:.1f}" y="{H - BOTTOM - h:.1f}" width="{max(width - 2, 1):.1f}" '
                     f'height="{h:.1f}" fill="{color}"><title>≤ {_bound(le)}: {c:.0f}</title></rect>')
        if i % math.ceil(n / 5) == 0:  # at most 5 labels, or they overlap
            items.append(f'<text x="{x + width / 2:.1f}" y="{H - BOTTOM + 11}" text-anchor="middle">'
                         f'{_bound(le)}</text>')
    if not used:
        items.append(f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no observations yet</text>')
    return f'<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}">{"".join(items)}</svg>'
