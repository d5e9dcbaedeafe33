"""A live dashboard of a serving engine, read from the outside: its Prometheus ``/metrics``.

A serving engineer does not watch the engine's objects; they watch the server's metrics, the
same way for our server (``labsupport:`` names) and for ``vllm serve`` (``vllm:``), which share
names, types and histogram buckets. ``ServerDashboard`` polls ``GET /metrics`` from a
background thread every ``interval_s`` and draws what a Grafana board would:

* requests running and waiting (the batch, and the queue in front of it);
* KV-cache usage (the memory that admission depends on);
* output tokens per second (the rate of ``generation_tokens_total``);
* TTFT and inter-token latency histograms: the server's own buckets, counted since the
  dashboard started, with the P50 and P99 that ``histogram_quantile`` would estimate (a P99 from 100
  observations up, else the max to its bucket: ``prom_histogram.quantiles_text``).

Display it with ``show()`` (an ipywidgets HTML view with small SVG charts, redrawn after every
scrape: building it costs far less than a matplotlib figure, which on a small CPU would take time
from the very server it watches), run a load, then ``stop()``: the poller thread ends, one last
scrape is drawn, in the widget and as static HTML under it (a saved notebook keeps that one), and
``plot()`` draws the same panels as a static matplotlib figure for the saved
notebook and the slides. As a
context manager it starts and stops itself, also when the code inside raises. The poller
gives up on its own after ``max_failures`` scrapes in a row fail (the server is gone).
"""
from __future__ import annotations

import threading
import time
from html import escape

from .dashboard_svg import CSS, svg_bars, svg_lines
from .prom_histogram import (_bound, bucket_counts, histogram_buckets, histogram_quantile, quantiles_text,
                             tail_quantile)

PREFIXES = ("labsupport:", "vllm:")
COLORS = {"running": "#1f77b4", "waiting": "#ff7f0e", "kv": "#9467bd", "tokens": "#2ca02c",  # matplotlib's tab10
          "ttft": "#d62728", "itl": "#17becf"}


class ServerDashboard:
    """Running/waiting, KV usage, token rate, TTFT and ITL of a server, live, from its ``/metrics``.

    ``url``: the server's base URL (``http://host:port``, with or without ``/v1``). Use it as a
    context manager (``with ServerDashboard(url) as dash: display(dash); run the load``) or call
    ``start()`` and ``stop()``. ``samples`` holds one dict per scrape: ``t`` (seconds since the
    start), ``running``, ``waiting``, ``kv_usage`` (0-1), ``generation_tokens``, ``requests``.
    """

    def __init__(self, url: str, interval_s: float = 0.5, redraw_every_s: float = 0.5,
                 title: str = "Server dashboard", max_failures: int = 20):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.interval_s, self.redraw_every_s, self.title = interval_s, redraw_every_s, title
        self.max_failures = max_failures
        self.samples: list[dict] = []
        self.prefix: str | None = None
        self.first: dict | None = None  # the first scrape: histograms count from here
        self.last: dict | None = None
        self.failures, self.last_error = 0, None
        self._t0: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # samples and scrapes: the poller writes, the notebook reads
        self._html = None
        self._last_draw = 0.0
        self._saved = None  # show()'s display handle for the last drawing as static HTML, filled by stop()

    # ------------------------------------------------------------------ polling

    def scrape(self) -> dict[str, float]:
        """One ``GET /metrics``, parsed; raises on a connection error or a status other than 200."""
        import httpx

        from ..serve.metrics import parse_metrics

        resp = httpx.get(self.url + "/metrics", timeout=5)
        resp.raise_for_status()
        return parse_metrics(resp.text)

    def poll_once(self) -> dict | None:
        """Scrape and record one sample; None (and ``last_error`` set) when the scrape failed."""
        try:
            values = self.scrape()
        except Exception as exc:  # the server is busy starting or gone: count it, keep the dashboard alive
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None
        self.failures = 0
        now = time.perf_counter()
        with self._lock:
            if self._t0 is None:
                self._t0 = now
            if self.prefix is None:
                self.prefix = next((p for p in PREFIXES if p + "num_requests_running" in values), PREFIXES[0])
            p = self.prefix
            kv = values.get(p + "kv_cache_usage_perc", values.get(p + "gpu_cache_usage_perc", 0.0))
            sample = {"t": now - self._t0, "running": values.get(p + "num_requests_running", 0.0),
                      "waiting": values.get(p + "num_requests_waiting", 0.0), "kv_usage": kv,
                      "generation_tokens": values.get(p + "generation_tokens_total", 0.0),
                      "requests": values.get(p + "request_success_total", 0.0)}
            self.samples.append(sample)
            if self.first is None:
                self.first = values
            self.last = values
        return sample

    def _poll_loop(self):
        while not self._stop.is_set():
            started = time.perf_counter()
            self.poll_once()
            if self.failures >= self.max_failures:
                self.last_error = f"gave up after {self.failures} failed scrapes: {self.last_error}"
                break
            self._refresh(force=False)
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - started)))

    def start(self) -> "ServerDashboard":
        """Start polling in a daemon thread (a second call while it runs does nothing)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll_loop, name="dashboard-poller", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0):
        """Stop the poller and wait for it, then record one last scrape and draw it. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.poll_once()
        self._refresh(force=True)
        if self._saved is not None:
            self._saved.update(self.saved_view(), raw=True)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ numbers

    def histogram(self, name: str) -> list[tuple[float, float]]:
        """Per-bucket counts of histogram ``name`` (e.g. ``"time_to_first_token_seconds"``) since the start."""
        with self._lock:
            if self.last is None:
                return []
            full = (self.prefix or PREFIXES[0]) + name
            return bucket_counts(histogram_buckets(self.last, full), histogram_buckets(self.first, full))

    def summary(self) -> dict:
        """What the run looked like to the server: peaks, tokens, requests and latency quantiles. A tail is
        ``p99_ttft_s`` from 100 observations on; under that the key is ``max_bound_ttft_s``, the bound of the
        highest occupied bucket (a P99 of a handful is the max, known only to its bucket). Likewise for ITL."""

        def tails(name, counts):
            label, value = tail_quantile(counts)
            return {f"{label}_{name}_s": value}

        with self._lock:
            samples = list(self.samples)
        ttft, itl = self.histogram("time_to_first_token_seconds"), self.histogram("inter_token_latency_seconds")
        first, last = (samples[0], samples[-1]) if samples else ({}, {})
        span = last.get("t", 0.0) - first.get("t", 0.0)
        tokens = last.get("generation_tokens", 0.0) - first.get("generation_tokens", 0.0)
        return {"samples": len(samples), "seconds": span,
                "max_running": max((s["running"] for s in samples), default=0.0),
                "max_waiting": max((s["waiting"] for s in samples), default=0.0),
                "max_kv_usage": max((s["kv_usage"] for s in samples), default=0.0),
                "generation_tokens": tokens, "tokens_per_s": tokens / span if span > 0 else 0.0,
                "requests": last.get("requests", 0.0) - first.get("requests", 0.0),
                "ttft_count": sum(c for _, c in ttft), "itl_count": sum(c for _, c in itl),
                "p50_ttft_s": histogram_quantile(0.5, ttft), "p50_itl_s": histogram_quantile(0.5, itl),
                **tails("ttft", ttft), **tails("itl", itl)}

    def token_rate(self, window: int = 2) -> tuple[list[float], list[float]]:
        """Output tokens per second between scrapes ``window`` apart: ``(times, rates)``."""
        with self._lock:
            s = list(self.samples)
        times, rates = [], []
        for a, b in zip(s, s[window:]):
            if b["t"] > a["t"]:
                times.append(b["t"])
                rates.append((b["generation_tokens"] - a["generation_tokens"]) / (b["t"] - a["t"]))
        return times, rates

    # ------------------------------------------------------------------ drawing

    def draw(self, fig):
        """Draw the six panels into a matplotlib ``Figure``."""
        with self._lock:
            s = list(self.samples)
        axes = fig.subplots(2, 3)
        t = [x["t"] for x in s]
        ax = axes[0, 0]
        ax.step(t, [x["running"] for x in s], where="post", color=COLORS["running"], label="running")
        ax.step(t, [x["waiting"] for x in s], where="post", color=COLORS["waiting"], label="waiting")
        ax.set(title="requests", xlabel="time (s)", ylabel="requests")
        ax.legend(fontsize=7, loc="upper left")
        ax = axes[0, 1]
        ax.plot(t, [100 * x["kv_usage"] for x in s], color=COLORS["kv"])
        ax.set(title="KV-cache usage", xlabel="time (s)", ylabel="% of blocks")
        ax.set_ylim(bottom=0)
        ax = axes[0, 2]
        ax.plot(*self.token_rate(), color=COLORS["tokens"])
        ax.set(title="output tokens / s", xlabel="time (s)", ylabel="tok/s")
        ax.set_ylim(bottom=0)
        for ax, name, key, title in ((axes[1, 0], "time_to_first_token_seconds", "ttft", "TTFT"),
                                     (axes[1, 1], "inter_token_latency_seconds", "itl", "inter-token latency")):
            self._draw_histogram(ax, self.histogram(name), COLORS[key], title)
        self._draw_numbers(axes[1, 2])
        for ax in axes.flat[:5]:
            ax.grid(alpha=0.3)
        fig.suptitle(self.title, fontweight="bold")
        fig.tight_layout()
        return fig

    @staticmethod
    def _draw_histogram(ax, counts, color, title):
        used = [i for i, (_, c) in enumerate(counts) if c > 0]
        if used:
            counts = counts[max(used[0] - 1, 0): used[-1] + 2]  # the occupied range and one bucket either side
        ax.bar(range(len(counts)), [c for _, c in counts], color=color, width=0.85)
        ax.set_xticks(range(len(counts)), [f"≤{_bound(le)}" for le, _ in counts], rotation=45, ha="right",
                      fontsize=7)
        total = sum(c for _, c in counts)
        ax.set(title=f"{title}: {quantiles_text(counts)}" if total else title, ylabel="count")
        ax.title.set_fontsize(9)

    def numbers(self) -> list[tuple[str, str]]:
        """The summary as (label, text) rows, for the last panel."""
        s = self.summary()
        return [("scrapes", f"{s['samples']} over {s['seconds']:.1f} s"),
                ("requests finished", f"{s['requests']:.0f}"),
                ("output tokens", f"{s['generation_tokens']:.0f} ({s['tokens_per_s']:.1f} tok/s)"),
                ("peak running / waiting", f"{s['max_running']:.0f} / {s['max_waiting']:.0f}"),
                ("peak KV usage", f"{100 * s['max_kv_usage']:.1f} %"),
                ("TTFT", quantiles_text(self.histogram("time_to_first_token_seconds"))),
                ("ITL", quantiles_text(self.histogram("inter_token_latency_seconds")))]

    def _draw_numbers(self, ax):
        ax.axis("off")
        for i, (k, v) in enumerate(self.numbers()):
            ax.text(0.0, 1 - i * 0.14, k, fontsize=8, color="gray", transform=ax.transAxes, va="top")
            ax.text(1.0, 1 - i * 0.14, v, fontsize=8, ha="right", transform=ax.transAxes, va="top")
        ax.set_title(f"since the dashboard started ({self.prefix or '?'} metrics)", fontsize=9)

    def plot(self, figsize=(12, 6)):
        """The dashboard as a static pyplot figure (for the saved notebook and the slides)."""
        import matplotlib.pyplot as plt

        return self.draw(plt.figure(figsize=figsize))

    # ------------------------------------------------------------------ the live widget

    def render_html(self) -> str:
        """The live view: a status line and the six panels as inline SVG. Cheap to build (no
        matplotlib), so redrawing it every scrape takes nothing noticeable from the server."""
        with self._lock:
            s = list(self.samples)
        last = s[-1] if s else None
        state = "polling" if self.running else "stopped"
        parts = [f"{state}, every {self.interval_s:g} s", f"{len(s)} scrapes"]
        if last:
            parts += [f"running {last['running']:.0f}", f"waiting {last['waiting']:.0f}",
                      f"KV {100 * last['kv_usage']:.1f} %"]
        if self.last_error and self.failures:
            parts.append(f'<span style="color: #c00">{escape(self.last_error)}</span>')
        t = [x["t"] for x in s]
        panels = [
            svg_lines("requests",
                      [("running", COLORS["running"], t, [x["running"] for x in s]),
                       ("waiting", COLORS["waiting"], t, [x["waiting"] for x in s])], step=True),
            svg_lines("KV-cache usage (%)", [("KV", COLORS["kv"], t, [100 * x["kv_usage"] for x in s])]),
            svg_lines("output tokens / s", [("tok/s", COLORS["tokens"], *self.token_rate())]),
        ]
        for name, key, title in (("time_to_first_token_seconds", "ttft", "TTFT"),
                                 ("inter_token_latency_seconds", "itl", "ITL")):
            counts = self.histogram(name)
            if sum(c for _, c in counts):
                title += f": {quantiles_text(counts)}"
            panels.append(svg_bars(title, counts, COLORS[key]))
        rows = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in self.numbers())
        panels.append(f'<table class="sd-numbers"><caption>since the dashboard started</caption>{rows}</table>')
        grid = "".join(f'<div class="sd-panel">{p}</div>' for p in panels)
        return (f'<div class="server-dashboard">{CSS}<div class="sd-title">{escape(self.title)}</div>'
                f'<div class="sd-status">{" · ".join(parts)}</div><div class="sd-grid">{grid}</div></div>')

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
            import ipywidgets as widgets  # a course extra: plot() and summary() work without it

            self._html = widgets.HTML()
            self._refresh(force=True)
        return self._html

    def show(self):
        """Display the live widget, and under it a place that ``stop()`` fills with the last drawing as static HTML.

        Why both: a widget's view is drawn from its model, which lives in the kernel. A saved notebook
        reopened without that kernel shows "Error displaying widget: model not found" where the widget
        was; the static copy is plain HTML and SVG in the notebook file, shown by any reader."""
        from IPython.display import display

        display(self)
        self._saved = display({"text/plain": ""}, raw=True, display_id=True)
        return self

    def saved_view(self) -> dict:
        """The last drawing as a static output (``text/html``, with the numbers as ``text/plain``)."""
        caption = ('<div class="sd-status">The last drawing, saved as HTML: what a reopened notebook shows '
                   "without its kernel.</div>")
        text = "\n".join(f"{k}: {v}" for k, v in self.numbers())
        return {"text/html": caption + self.render_html(), "text/plain": f"{self.title} (last drawing)\n{text}"}

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
