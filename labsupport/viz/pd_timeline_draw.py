"""Drawing the PD timeline: the static matplotlib figure and the live view's inline SVG, one lane per worker.

Separate from the data (``pd_timeline_data``) and the widget that polls (``pd_timeline``) because
both pictures are the same idea drawn twice: lanes prefill first, steps sized by the tokens they fed,
each transfer a band from the sender's lane to the receiver's. matplotlib for the saved notebook and
the slides; SVG for the live view, which is redrawn every poll on the CPU the workers share.
"""
from __future__ import annotations

import math
import time
from html import escape

from .pd_timeline_data import _pairs, _row, _span, lane_order, step_kind, step_tokens

COLORS = {"prefill": "#1f77b4", "decode": "#2ca02c", "mixed": "#9467bd",  # matplotlib's tab10
          "transfer": "#ff7f0e", "failed": "#d62728"}
HALF = 0.32  # half a lane's height (lanes 1 apart): the gap between lanes is where transfers cross
ROLE_NAME = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "prefill+decode", None: "colocated"}


def _size(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def plot_pd_timeline(timelines: dict[str, dict], ax=None, t0: float | None = None, title: str | None = None,
                     max_labels: int = 20):
    """Lanes (one per worker, prefill first), steps as bars coloured by what they ran (height: tokens
    fed, square-root scale), and each transfer as a band from the sender's send interval to the
    receiver's recv interval, labelled with size and GB/s (the last ``max_labels`` of them).

    Artists carry gids for tests: lanes ``pd-lane``, one PolyCollection of steps per lane
    ``pd-steps:<name>``, links ``pd-transfer``, one-sided transfers ``pd-transfer-half``, labels
    ``pd-transfer-label`` (placed by ``place_transfer_labels``), an unreachable worker's message ``pd-error``.
    Returns the Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch, Polygon, Rectangle

    names = lane_order(timelines)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.4 + 1.0 * max(len(names), 1)))
    span = _span(timelines)
    t0 = t0 if t0 is not None else (span[0] if span else time.time())
    x = lambda t: 1e3 * (t - t0)  # noqa: E731
    lane = {n: i for i, n in enumerate(names)}
    peak = max((step_tokens(s) for tl in timelines.values() for s in tl.get("steps") or []), default=1) or 1
    for n in names:
        tl, y = timelines[n], lane[n]
        ax.axhspan(y - HALF, y + HALF, color="#f2f2f2", zorder=0, gid="pd-lane")
        if "error" in tl:
            ax.text(0.01, y, f"unreachable: {tl['error']}"[:120], color=COLORS["failed"], fontsize=8, va="center",
                    transform=ax.get_yaxis_transform(), gid="pd-error")
        verts, colors = [], []
        for s in tl.get("steps") or []:
            h = HALF * (0.2 + 0.8 * math.sqrt(step_tokens(s) / peak))
            verts.append([(x(s["start"]), y - h), (x(s["end"]), y - h), (x(s["end"]), y + h), (x(s["start"]), y + h)])
            colors.append(COLORS[step_kind(s)])
        if verts:  # one collection per lane: thousands of steps stay cheap; thin edges keep short steps visible
            ax.add_collection(PolyCollection(verts, facecolors=colors, edgecolors=colors, linewidths=0.5,
                                             zorder=2, gid=f"pd-steps:{n}"))
    pairs = _pairs(timelines)
    for i, (tid, send, recv) in enumerate(pairs):
        row = _row(tid, send, recv)
        color = COLORS["transfer" if row["ok"] else "failed"]
        if send and recv and lane[send[0]] != lane[recv[0]]:
            (a, s), (b, r) = send, recv
            ya, yb = lane[a], lane[b]
            d = HALF if yb > ya else -HALF  # from the sender's edge facing the receiver to the receiver's
            pts = [(x(s["start"]), ya + d), (x(s["end"]), ya + d), (x(r["end"]), yb - d), (x(r["start"]), yb - d)]
            ax.add_patch(Polygon(pts, closed=True, facecolor=color, edgecolor=color, alpha=0.45, lw=1.5, zorder=3,
                                 gid="pd-transfer"))
            room = (min(ya, yb) + HALF, max(ya, yb) - HALF)  # the gap between the two lanes
            band = (min(p[0] for p in pts), max(p[0] for p in pts))
        else:  # the other end is missing (or on the same lane): a hatched strip on this lane only
            for n, rec in (e for e in (send, recv) if e):
                ax.add_patch(Rectangle((x(rec["start"]), lane[n] + HALF - 0.1), x(rec["end"]) - x(rec["start"]), 0.1,
                                       facecolor=color, edgecolor=color, hatch="///", alpha=0.6, zorder=3,
                                       gid="pd-transfer-half"))
            n, rec = send or recv
            room = (lane[n] + HALF - 0.2, lane[n] + HALF + 0.15)  # the strip and the gap below it
            band = (x(rec["start"]), x(rec["end"]))
        if i >= len(pairs) - max_labels:
            text = f"{_size(row['bytes'])} · {row['GB/s']:.2f} GB/s" if row["ok"] else f"failed: {row['error']}"[:40]
            label = ax.annotate(text, (band[1], sum(room) / 2), (4, 0), textcoords="offset points", fontsize=7,
                                ha="left", va="center", zorder=4, gid="pd-transfer-label",
                                bbox=dict(boxstyle="round,pad=0.2", fc="white", ec=color, alpha=0.9))
            label.pd_room = (*band, *room)  # where place_transfer_labels may put it: beside the band, in the gap
    roles = ["unreachable" if "error" in timelines[n] else ROLE_NAME.get(timelines[n].get("role"), "?") for n in names]
    ax.set_yticks(range(len(names)), [f"{n}\n({r})" for n, r in zip(names, roles)], fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)  # the first lane on top
    ax.set_xlim(*((x(span[0]) - 5, x(span[1]) + 5) if span else (0, 1000)))
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    ran = {step_kind(s) for tl in timelines.values() for s in tl.get("steps") or []}
    oks = {_row(*p)["ok"] for p in pairs}
    kinds = [k for k in ("prefill", "decode", "mixed") if k in ran] + ["transfer"] * (True in oks)
    kinds += ["failed"] * (False in oks)
    labels = {"transfer": "KV transfer", "failed": "failed transfer"}
    ax.legend([Patch(color=COLORS[k], alpha=0.45 if k in ("transfer", "failed") else 1) for k in kinds],
              [labels.get(k, f"{k} step") for k in kinds], fontsize=7, ncol=len(kinds), loc="lower right",
              bbox_to_anchor=(1, 1))
    ax.set_title(title or ("prefill/decode timeline" if pairs else "timeline"), loc="left", fontsize=10)
    place_transfer_labels(ax)
    return ax


def renderer_of(fig):
    """The renderer that measures text on ``fig``; a figure closed in pyplot has lost its own, so it gets Agg's."""
    if not hasattr(fig.canvas, "get_renderer"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        FigureCanvasAgg(fig)
    return fig.canvas.get_renderer()


def place_transfer_labels(ax):
    """Put each transfer's label where it is read and nothing hides it: beside its band (right of it, or
    left where the right runs past the axes' edge), in the gap between the lanes, in one of three rows,
    never over an earlier label. A label with no such place is hidden (``transfer_table`` lists every
    transfer). Measured on the figure as it is laid out now: call it again after ``tight_layout`` or a
    change of the x-limits (``plot_pd_timelines`` does)."""
    labels = sorted((a for a in ax.texts if hasattr(a, "pd_room")), key=lambda a: a.pd_room[1])
    if not labels:
        return
    renderer = renderer_of(ax.figure)
    frame, placed = ax.get_window_extent(renderer), []
    to_px = ax.transData.transform
    for label in labels:
        left, right, y_lo, y_hi = label.pd_room
        low, high = sorted(to_px([(left, y_lo), (left, y_hi)])[:, 1])  # in pixels (the y-axis is inverted)
        label.set_visible(True)  # measured only while visible
        spots = [(x, y, dx, ha) for y in ((y_lo + y_hi) / 2, y_lo + (y_hi - y_lo) / 4, y_hi - (y_hi - y_lo) / 4)
                 for x, dx, ha in ((right, 4, "left"), (left, -4, "right"))]
        for x, y, dx, ha in spots:
            label.xy, label.xyann = (x, y), (dx, 0)
            label.set_ha(ha)
            box = label.get_window_extent(renderer).padded(1)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and low - 1 <= box.y0 and box.y1 <= high + 1
            if inside and not any(box.overlaps(other) for other in placed):
                placed.append(box)
                break
        else:
            label.set_visible(False)


def plot_pd_timelines(panels: list[tuple[dict[str, dict], str]], width: float = 12):
    """Several runs (``(timelines, title)`` each), one above the other on one time scale: each panel's
    time from its own first event, all panels with the x-limits of the longest, so equal widths are equal
    durations. Panel heights follow their lane counts. Returns the figure (closed in pyplot)."""
    import matplotlib.pyplot as plt

    lanes = [max(len(lane_order(tl)), 1) for tl, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=lanes,
                             figsize=(width, 1.3 * len(panels) + 1.2 * sum(lanes)))
    axes = list(axes[:, 0])
    for ax, (timelines, title) in zip(axes, panels):
        plot_pd_timeline(timelines, ax=ax, title=title)
    spans = [_span(tl) for tl, _ in panels]
    longest = max((1e3 * (s[1] - s[0]) for s in spans if s), default=1000)
    axes[0].set_xlim(-5, longest + 5)  # shared: every panel now has these limits
    for ax in axes:
        ax.tick_params(labelbottom=True)  # each panel keeps its own time labels
    fig.tight_layout()
    for ax in axes:
        place_transfer_labels(ax)
    plt.close(fig)
    return fig


CSS = """<style>
.pd-timeline {font: 12px/1.4 system-ui, sans-serif; color: #222}
.pd-timeline .pd-title {font-weight: 600; font-size: 13px}
.pd-timeline .pd-status {color: #555}
.pd-timeline .pd-legend span {display: inline-block; margin-right: 10px}
.pd-timeline .pd-legend i {display: inline-block; width: 14px; height: 9px; margin-right: 3px}
.pd-timeline svg text {font: 10px sans-serif; fill: #444}
</style>"""
W, LANE, LEFT, RIGHT, TOP, BOTTOM = 860, 56, 120, 10, 6, 20


def _rect(cls: str, x: float, y: float, w: float, h: float, fill: str, tip: str = "") -> str:
    return (f'<rect class="{cls}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}">'
            f'{f"<title>{tip}</title>" if tip else ""}</rect>')


def render_svg(timelines: dict[str, dict], t_lo: float, t_hi: float) -> str:
    """The lanes of ``[t_lo, t_hi]`` as inline SVG: steps ``rect.pd-step.pd-<kind>``, links
    ``polygon.pd-transfer`` (a hover shows each one's numbers), time in seconds before ``t_hi``."""
    names = lane_order(timelines)
    height, scale = TOP + LANE * max(len(names), 1) + BOTTOM, (W - LEFT - RIGHT) / max(t_hi - t_lo, 1e-9)
    x = lambda t: LEFT + scale * (min(max(t, t_lo), t_hi) - t_lo)  # noqa: E731  (clipped to the window)
    mid = {n: TOP + LANE * (i + 0.5) for i, n in enumerate(names)}
    peak = max((step_tokens(s) for tl in timelines.values() for s in tl.get("steps") or []), default=1) or 1
    items = []
    for n in names:
        tl, y = timelines[n], mid[n]
        role = "unreachable" if "error" in tl else ROLE_NAME.get(tl.get("role"), "?")
        items += [_rect("pd-lane", LEFT, y - HALF * LANE, W - LEFT - RIGHT, 2 * HALF * LANE, "#f2f2f2"),
                  f'<text x="{LEFT - 6}" y="{y - 2:.1f}" text-anchor="end" style="font-weight: 600">{escape(n)}</text>',
                  f'<text x="{LEFT - 6}" y="{y + 10:.1f}" text-anchor="end">{role}</text>']
        if "error" in tl:
            items.append(f'<text x="{LEFT + 6}" y="{y + 4:.1f}" style="fill: {COLORS["failed"]}">'
                         f'{escape(tl["error"][:110])}</text>')
        for s in tl.get("steps") or []:
            if s["end"] < t_lo or s["start"] > t_hi:
                continue
            h, kind = HALF * LANE * (0.2 + 0.8 * math.sqrt(step_tokens(s) / peak)), step_kind(s)
            items.append(_rect(f"pd-step pd-{kind}", x(s["start"]), y - h, max(x(s["end"]) - x(s["start"]), 1),
                               2 * h, COLORS[kind], f'{kind}: {step_tokens(s)} tokens, '
                                                    f'{1e3 * (s["end"] - s["start"]):.1f} ms'))
    label_end = 0.0
    for tid, send, recv in _pairs(timelines):
        row = _row(tid, send, recv)
        color, tip = COLORS["transfer" if row["ok"] else "failed"], (
            f"{escape(tid)}: {_size(row['bytes'])}, {row['ms']:.1f} ms, {row['GB/s']:.2f} GB/s"
            + ("" if row["ok"] else f", failed: {escape(str(row['error']))}"))
        ends = [e for e in (send, recv) if e]
        if max(e[1]["end"] for e in ends) < t_lo:
            continue
        if send and recv and send[0] != recv[0]:
            (a, s), (b, r) = send, recv
            d = HALF * LANE * (1 if mid[b] > mid[a] else -1)
            pts = [(x(s["start"]), mid[a] + d), (x(s["end"]), mid[a] + d), (x(r["end"]), mid[b] - d),
                   (x(r["start"]), mid[b] - d)]
            points, at = " ".join(f"{px:.1f},{py:.1f}" for px, py in pts), max(p[0] for p in pts) + 4
            items.append(f'<polygon class="pd-transfer" points="{points}" fill="{color}" fill-opacity="0.5" '
                         f'stroke="{color}" stroke-width="1.5"><title>{tip}</title></polygon>')
            if at > label_end:  # a label that would overlap the previous one is left to the hover
                items.append(f'<text x="{at:.1f}" y="{(mid[a] + mid[b]) / 2 + 3:.1f}">'
                             f'{_size(row["bytes"])} · {row["GB/s"]:.2f} GB/s</text>')
                label_end = at + 120
        else:
            for n, rec in ends:
                items.append(_rect("pd-transfer-half", x(rec["start"]), mid[n] + (HALF - 0.1) * LANE,
                                   max(x(rec["end"]) - x(rec["start"]), 2), 0.1 * LANE, color, tip))
    for i in range(6):  # the time axis: seconds before the last poll
        t = t_lo + i * (t_hi - t_lo) / 5
        items.append(f'<text x="{x(t):.1f}" y="{height - 6}" text-anchor="middle">'
                     f'{"now" if i == 5 else f"-{t_hi - t:.1f} s"}</text>')
    return f'<svg width="{W}" height="{height}" viewBox="0 0 {W} {height}">{"".join(items)}</svg>'
