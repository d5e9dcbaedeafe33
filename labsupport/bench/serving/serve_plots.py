"""Charts of ``bench serve`` runs: where the knee is, and what the tail looks like.

Left, one point per request rate: latency against the throughput actually achieved. Below the
knee, more load buys throughput at little latency; past it, throughput stops growing while
latency (queueing) climbs: the rate to run at is just before the bend. Middle and right, the
distributions behind the percentiles: TTFT and ITL as CDFs, one curve per rate; P50 and P99
are where a curve crosses 0.5 and 0.99.
"""
from __future__ import annotations

import math


def _cdf(ax, values_ms, label):
    xs = sorted(values_ms)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}/s"


def sweep_complete(results, expected: int | None = None) -> bool:
    """Whether a sweep has every run it was meant to have (``expected``; without it, at least one); if not,
    print why, so that a plot cell after an interrupted sweep says so instead of drawing an empty figure."""
    if results and (expected is None or len(results) >= expected):
        return True
    print(f"The sweep is incomplete: {len(results or ())} of {expected or 'its'} rates ran (was its cell "
          "interrupted?). Re-run the sweep's cell, then this one.")
    return False


def plot_results(results, path: str | None = None, title: str | None = None, expected: int | None = None):
    """A 1x3 figure of the runs (``BenchResult``s, one per rate); saved to ``path`` when given. ``expected``:
    how many runs the sweep has when complete; an incomplete sweep draws nothing (``sweep_complete``) and
    returns None."""
    if not sweep_complete(results, expected):
        return None
    import matplotlib
    if path is not None:
        matplotlib.use("Agg")  # a file from the command line needs no display
    import matplotlib.pyplot as plt

    fig, (knee, ttft, itl) = plt.subplots(1, 3, figsize=(15, 4.2))
    ordered = sorted(results, key=lambda r: r.config["request_rate"])  # the curve follows the load
    xs = [r.summary["output_throughput"] for r in ordered]
    for key, style in (("median_e2el_ms", "o-"), ("p99_e2el_ms", "s--"), ("p99_ttft_ms", "^:")):
        knee.plot(xs, [r.summary[key] for r in ordered], style, label=key.replace("_ms", "").replace("_", " "))
    for r, x in zip(ordered, xs):
        knee.annotate(rate_label(r.config["request_rate"]), (x, r.summary["p99_e2el_ms"]),
                      textcoords="offset points", xytext=(4, 4), fontsize=8)
    knee.set(xlabel="output throughput (tok/s)", ylabel="latency (ms)", title="latency vs throughput")
    knee.legend(fontsize=8)
    for r in results:
        done = [q for q in r.requests if q.success]
        label = rate_label(r.config["request_rate"])
        _cdf(ttft, [q.ttft * 1000 for q in done], label)
        _cdf(itl, [g * 1000 for q in done for g in q.itl], label)
    ttft.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    itl.set(xlabel="ITL (ms)", ylabel="fraction of token gaps", title="ITL CDF")
    for ax in (ttft, itl):
        ax.axhline(0.99, color="grey", lw=0.5)
        ax.legend(title="rate", fontsize=8)
    for ax in (knee, ttft, itl):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig
