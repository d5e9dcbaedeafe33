"""Prefill/decode disaggregation as a picture: one lane per worker, the KV hand-off drawn between them.

Chapter 07 splits a request across two servers: the prefill worker runs the prompt and holds its
KV blocks, the decode worker pulls them over TCP and generates the rest. Whether that pays off is a
question of time: the pull must be short next to a decode, and neither worker should stall on the
other. So the picture is read from the workers themselves: each answers ``GET /pd/timeline`` with
its recent steps and KV transfers in wall-clock seconds (``time.time()``, one clock for all the
processes of one machine). Request ids differ between workers (each server names its own), so a
hand-off is linked through its ``transfer_id``, which both ends of one pull share.

* ``fetch_timelines``: the workers' answers; a worker that does not answer gives an ``error``
  entry instead of raising (a killed worker is part of the lesson).
* ``plot_pd_timeline``: the static matplotlib figure (saved notebook, slides; also one colocated
  worker alone, for the side-by-side).
* ``PDTimelineWidget``: the live view, built like ``dashboard.ServerDashboard``: a daemon thread
  polls, an ipywidgets HTML view with inline SVG is redrawn (cheap: no matplotlib on the CPU the
  workers share), ``stop()`` joins the poller, polls once more and draws that.
* ``transfer_table``: one row per transfer (bytes, time, GB/s, how the two ends overlap).
"""
from __future__ import annotations

import math
import threading
import time
from html import escape

COLORS = {"prefill": "#1f77b4", "decode": "#2ca02c", "mixed": "#9467bd",  # matplotlib's tab10
          "transfer": "#ff7f0e", "failed": "#d62728"}
ROLE_RANK = {"kv_producer": 0, "kv_both": 1, None: 2, "kv_consumer": 3}  # prefill lanes first
HALF = 0.32  # half a lane's height (lanes 1 apart): the gap between lanes is where transfers cross
ROLE_NAME = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "prefill+decode", None: "colocated"}


def fetch_timelines(workers: dict[str, str], since: float = 0.0, timeout: float = 2.0) -> dict[str, dict]:
    """``{name: the worker's /pd/timeline answer}``; ``{"error": "..."}`` for one that fails to answer."""
    import httpx

    out = {}
    for name, url in workers.items():
        try:
            resp = httpx.get(url.rstrip("/").removesuffix("/v1") + "/pd/timeline", params={"since": since},
                             timeout=timeout)
            resp.raise_for_status()
            out[name] = resp.json()
        except Exception as exc:  # refused, timed out, 404 from a server without PD: say so, keep the others
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def lane_order(timelines: dict[str, dict]) -> list[str]:
    """Worker names, prefill workers first, then colocated/unknown, then decode (stable otherwise)."""
    return sorted(timelines, key=lambda n: ROLE_RANK.get(timelines[n].get("role"), 2))


def step_kind(step: dict) -> str:
    p, d = bool(step.get("prefill")), bool(step.get("decode"))
    return "mixed" if p and d else "prefill" if p else "decode"


def step_tokens(step: dict) -> int:
    """Tokens the step fed the model: prompt tokens plus one per decoding request."""
    return sum(step.get("prefill", {}).values()) + len(step.get("decode", []))


def _size(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def _pairs(timelines: dict[str, dict]) -> list[tuple[str, tuple | None, tuple | None]]:
    """``[(transfer_id, (sender, record) or None, (receiver, record) or None), ...]`` by start time."""
    found: dict[str, dict] = {}
    for name, tl in timelines.items():
        for rec in tl.get("transfers") or []:
            found.setdefault(rec["transfer_id"], {})[rec["role"]] = (name, rec)
    pairs = [(tid, ends.get("send"), ends.get("recv")) for tid, ends in found.items()]
    return sorted(pairs, key=lambda p: min(e[1]["start"] for e in p[1:] if e))


def _row(tid: str, send, recv) -> dict:
    """One transfer in numbers. Its time is the receiver's (connect to unpacked: what the decode
    request waits for), or the sender's when only that end answered."""
    main = (recv or send)[1]
    ms = 1e3 * (main["end"] - main["start"])
    row = {"transfer_id": tid, "from": send and send[0], "to": recv and recv[0], "bytes": main["num_bytes"],
           "blocks": main["num_blocks"], "ms": ms, "GB/s": main["num_bytes"] / max(ms, 1e-6) / 1e6,
           "send_ms": send and 1e3 * (send[1]["end"] - send[1]["start"]),
           "recv_ms": recv and 1e3 * (recv[1]["end"] - recv[1]["start"]), "overlap_ms": None, "overlap": None,
           "ok": all(e[1]["ok"] for e in (send, recv) if e),
           "error": next((e[1]["error"] for e in (send, recv) if e and e[1].get("error")), None)}
    if send and recv:  # the same pull seen from both ends: the send should sit inside the recv
        s, r = send[1], recv[1]
        row["overlap_ms"] = 1e3 * max(0.0, min(s["end"], r["end"]) - max(s["start"], r["start"]))
        row["overlap"] = row["overlap_ms"] / max(1e3 * min(s["end"] - s["start"], r["end"] - r["start"]), 1e-6)
    return row


def transfer_table(timelines: dict[str, dict]) -> list[dict]:
    """One row per transfer_id: from, to, bytes, blocks, ms, GB/s, send_ms, recv_ms, overlap_ms,
    overlap (fraction of the shorter end), ok, error."""
    return [_row(*p) for p in _pairs(timelines)]


def _span(timelines: dict[str, dict]) -> tuple[float, float] | None:
    times = [t for tl in timelines.values() for ev in (tl.get("steps") or []) + (tl.get("transfers") or [])
             for t in (ev["start"], ev["end"])]
    return (min(times), max(times)) if times else None


def plot_pd_timeline(timelines: dict[str, dict], ax=None, t0: float | None = None, title: str | None = None,
                     max_labels: int = 20):
    """Lanes (one per worker, prefill first), steps as bars coloured by what they ran (height: tokens
    fed, square-root scale), and each transfer as a band from the sender's send interval to the
    receiver's recv interval, labelled with size and GB/s (the last ``max_labels`` of them).

    Artists carry gids for tests: lanes ``pd-lane``, one PolyCollection of steps per lane
    ``pd-steps:<name>``, links ``pd-transfer``, one-sided transfers ``pd-transfer-half``, labels
    ``pd-transfer-label``, an unreachable worker's message ``pd-error``. Returns the Axes."""
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
            at = (max(p[0] for p in pts), (ya + yb) / 2)
        else:  # the other end is missing (or on the same lane): a hatched strip on this lane only
            for n, rec in (e for e in (send, recv) if e):
                ax.add_patch(Rectangle((x(rec["start"]), lane[n] + HALF - 0.1), x(rec["end"]) - x(rec["start"]), 0.1,
                                       facecolor=color, edgecolor=color, hatch="///", alpha=0.6, zorder=3,
                                       gid="pd-transfer-half"))
            n, rec = send or recv
            at = (x(rec["end"]), lane[n] + HALF - 0.05)
        if i >= len(pairs) - max_labels:
            text = f"{_size(row['bytes'])}\n{row['GB/s']:.2f} GB/s" if row["ok"] else f"failed: {row['error']}"[:40]
            ax.annotate(text, at, (4, 0), textcoords="offset points", fontsize=7, ha="left", va="center", zorder=4,
                        gid="pd-transfer-label",
                        bbox=dict(boxstyle="round,pad=0.2", fc="white", ec=color, alpha=0.9))
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
    return ax


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


class PDTimelineWidget:
    """The workers' lanes over the last ``window_s`` seconds, live. ``workers``: ``{name: base URL}``.

    Like ``ServerDashboard``: ``start()``/``stop()`` or a ``with`` block; display it (an ipywidgets
    HTML view redrawn after every poll). Each poll asks every worker for what ended in the window,
    so nothing accumulates here. The poller gives up after ``max_failures`` polls in a row where no
    worker answered; one dead worker only shows as a red lane. ``update(timelines)`` draws given
    answers (canned ones, or a saved run), ``plot()`` the matplotlib version of the last poll."""

    def __init__(self, workers: dict[str, str], interval_s: float = 0.5, window_s: float = 10.0,
                 title: str = "Prefill/decode timeline", redraw_every_s: float = 0.5, max_failures: int = 20,
                 timeout: float = 2.0):
        self.workers, self.interval_s, self.window_s, self.title = dict(workers), interval_s, window_s, title
        self.redraw_every_s, self.max_failures, self.timeout = redraw_every_s, max_failures, timeout
        self.timelines: dict[str, dict] = {}
        self.fetched_at: float | None = None
        self.polls, self.failures, self.last_error = 0, 0, None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # timelines: the poller writes, the notebook reads
        self._html = None
        self._last_draw = 0.0

    def poll_once(self) -> dict[str, dict]:
        """Fetch the window from every worker, keep and draw it (at most every ``redraw_every_s``);
        counts a failure when no worker answered."""
        now = time.time()
        got = fetch_timelines(self.workers, since=now - self.window_s, timeout=self.timeout)
        errors = [f"{n}: {tl['error']}" for n, tl in got.items() if "error" in tl]
        self.last_error = "; ".join(errors) or None
        self.failures = self.failures + 1 if got and len(errors) == len(got) else 0
        self.update(got, now, force=False)
        return got

    def update(self, timelines: dict[str, dict], now: float | None = None, force: bool = True):
        """Keep and draw these answers, as if polled at ``now`` (default: their last event)."""
        span = _span(timelines)
        with self._lock:
            self.timelines, self.polls = timelines, self.polls + 1
            self.fetched_at = now if now is not None else (span[1] if span else time.time())
        self._refresh(force)

    def snapshot(self) -> dict[str, dict]:
        """The last answers drawn: ``{name: /pd/timeline answer or {"error": ...}}``."""
        with self._lock:
            return dict(self.timelines)

    def _poll_loop(self):
        while not self._stop.is_set():
            started = time.perf_counter()
            self.poll_once()
            if self.failures >= self.max_failures:
                self.last_error = f"gave up after {self.failures} polls with no worker answering: {self.last_error}"
                break
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - started)))

    def start(self) -> "PDTimelineWidget":
        """Start polling in a daemon thread (a second call while it runs does nothing)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll_loop, name="pd-timeline-poller", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0):
        """Stop the poller and wait for it, then poll once more and draw that. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.poll_once()
        self._refresh(force=True)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def render_html(self) -> str:
        with self._lock:
            timelines, now = dict(self.timelines), self.fetched_at or time.time()
        rows = transfer_table(timelines)
        state = f"{'polling' if self.running else 'stopped'}, every {self.interval_s:g} s"
        good = [r for r in rows if r["ok"]]
        failed = f" ({len(rows) - len(good)} failed)" if len(good) < len(rows) else ""
        parts = [state, f"{self.polls} polls", f"last {self.window_s:g} s", f"{len(rows)} transfers{failed}"]
        if good:
            parts.append(f"last: {_size(good[-1]['bytes'])} in {good[-1]['ms']:.1f} ms ({good[-1]['GB/s']:.2f} GB/s)")
        if self.last_error:
            parts.append(f'<span style="color: {COLORS["failed"]}">{escape(self.last_error)}</span>')
        legend = "".join(f'<span><i style="background: {COLORS[k]}"></i>{k}</span>'
                         for k in ("prefill", "decode", "mixed", "transfer"))
        return (f'<div class="pd-timeline">{CSS}<div class="pd-title">{escape(self.title)}</div>'
                f'<div class="pd-status">{" · ".join(parts)}</div><div class="pd-legend">{legend}</div>'
                f'{render_svg(timelines, now - self.window_s, now)}</div>')

    def _refresh(self, force: bool):
        if self._html is None:
            return
        now = time.perf_counter()
        if force or now - self._last_draw >= self.redraw_every_s:
            self._last_draw = now
            try:
                self._html.value = self.render_html()
            except Exception as exc:  # a drawing problem must not kill the poller
                self.last_error = f"drawing failed: {type(exc).__name__}: {exc}"

    @property
    def widget(self):
        if self._html is None:
            import ipywidgets as widgets

            self._html = widgets.HTML()
            self._refresh(force=True)
        return self._html

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def plot(self, ax=None):
        """The last poll as a static matplotlib timeline (for the saved notebook and the slides)."""
        return plot_pd_timeline(self.snapshot(), ax=ax, title=self.title)
