"""Prometheus histogram arithmetic: buckets out of a parsed ``/metrics``, counts between two scrapes,
the quantile estimate ``histogram_quantile`` makes, and how a latency and a bucket bound are written.

Separate from ``dashboard.ServerDashboard`` because it is the part worth reading on its own: what a
P99 read off a server's histogram can and cannot tell (it is only as precise as the buckets), with
no thread, widget or HTTP around it, so it can be tested against Prometheus' numbers directly.
"""
from __future__ import annotations

import math
import re


def histogram_buckets(values: dict[str, float], name: str) -> list[tuple[float, float]]:
    """``[(upper bound, cumulative count), ...]`` of histogram ``name`` in parsed metrics, sorted."""
    pattern = re.compile(re.escape(name) + r'_bucket\{le="([^"]+)"\}$')
    buckets = [(float(m.group(1)), v) for k, v in values.items() if (m := pattern.match(k))]
    return sorted(buckets)


def bucket_counts(now: list[tuple[float, float]], before: list[tuple[float, float]] | None = None):
    """Observations per bucket (not cumulative) between two scrapes of one histogram."""
    start = dict(before or [])
    cumulative = [(le, count - start.get(le, 0.0)) for le, count in now]
    out, previous = [], 0.0
    for le, count in cumulative:
        out.append((le, max(count - previous, 0.0)))
        previous = count
    return out


def histogram_quantile(q: float, counts: list[tuple[float, float]]) -> float:
    """Prometheus' estimate of the ``q`` quantile from per-bucket counts: linear inside the bucket
    it falls in (so it is only as precise as the buckets). NaN without observations."""
    total = sum(c for _, c in counts)
    if total <= 0:
        return math.nan
    rank, seen, lower = q * total, 0.0, 0.0
    for le, c in counts:
        if c and seen + c >= rank:
            if math.isinf(le):
                return lower  # Prometheus answers the highest finite bound
            return lower + (le - lower) * (rank - seen) / c
        seen += c
        lower = le if not math.isinf(le) else lower
    return lower


def tail_quantile(counts: list[tuple[float, float]]) -> tuple[str, float]:
    """The tail a histogram can honestly give: ``("p99", estimate)`` from ``MIN_P99_SAMPLES`` observations on,
    else ``("max_bound", the upper bound of the highest occupied bucket)``, since a P99 of a handful is the max
    and a histogram keeps only its bucket (``inf`` when it fell past the last finite bound). NaN without
    observations."""
    from ..percentiles import MIN_P99_SAMPLES
    n = sum(c for _, c in counts)
    if n <= 0:
        return "p99", math.nan
    if n >= MIN_P99_SAMPLES:
        return "p99", histogram_quantile(0.99, counts)
    return "max_bound", max(le for le, c in counts if c > 0)


def quantiles_text(counts: list[tuple[float, float]]) -> str:
    """"P50 ≈ x, P99 ≈ y (n = N)" from per-bucket counts; under ``MIN_P99_SAMPLES`` observations the tail is the
    largest, known only to its bucket ("max ≤ 2.5 s"): a P99 of a handful is the max, and a histogram does not
    keep the max itself."""
    from ..percentiles import MIN_P99_SAMPLES
    n = sum(c for _, c in counts)
    if n <= 0:
        return "no observations"
    p50 = f"P50 ≈ {_seconds(histogram_quantile(0.5, counts))}"
    if n >= MIN_P99_SAMPLES:
        return f"{p50}, P99 ≈ {_seconds(histogram_quantile(0.99, counts))} (n = {n:.0f})"
    top = max(le for le, c in counts if c > 0)
    finite = [le for le, _ in counts if not math.isinf(le)]
    tail = f"max > {_seconds(max(finite))}" if math.isinf(top) and finite else f"max ≤ {_seconds(top)}"
    return f"{p50}, {tail} (n = {n:.0f})"


def _seconds(s: float) -> str:
    if math.isnan(s):
        return "-"
    return f"{1000 * s:.0f} ms" if s < 1 else f"{s:.2f} s"


def _bound(le: float) -> str:
    if math.isinf(le):
        return "+Inf"
    return f"{1000 * le:g}ms" if le < 1 else f"{le:g}s"
