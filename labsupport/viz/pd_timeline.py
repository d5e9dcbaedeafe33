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
  worker alone, for the side-by-side); ``plot_pd_timelines``: several runs on one time scale.
* ``PDTimelineWidget``: the live view, built like ``dashboard.ServerDashboard``: a daemon thread
  polls, an ipywidgets HTML view with inline SVG is redrawn (cheap: no matplotlib on the CPU the
  workers share), ``stop()`` joins the poller, polls once more and draws that.
* ``transfer_table``: one row per transfer (bytes, time, GB/s, how the two ends overlap).

The data (fetching, pairing, ``transfer_table``) lives in ``pd_timeline_data`` and the drawing
(``plot_pd_timeline``, ``render_svg``) in ``pd_timeline_draw``; this module holds the live widget
and imports the rest, so ``from labsupport.viz.pd_timeline import ...`` works as before.
"""
from __future__ import annotations

import threading
import time
from html import escape

from .pd_timeline_data import _span, fetch_timelines, transfer_table
from .pd_timeline_draw import (COLORS, CSS, _size, place_transfer_labels, plot_pd_timeline, plot_pd_timelines,
                               render_svg)


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
