"""Percentiles of a run's latencies, and when its tail may be called a P99.

The median is the typical user, P99 the unlucky one a service level objective is written for. Below
``MIN_P99_SAMPLES`` samples a "P99" is the largest sample or next to it, so it is called the max: what a table
prints (``bench/summary.py``) and what a chart labels (``viz/chapter_charts.py``) follow the same rule, from
the numbers a run's summary holds.
"""
from __future__ import annotations

MIN_P99_SAMPLES = 100  # below this, a "P99" is the largest sample or next to it: call it the max


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def tail_of(values: list[float]) -> tuple[str, float]:
    """("P99", their P99) over at least ``MIN_P99_SAMPLES`` values, else ("max", the largest)."""
    if len(values) >= MIN_P99_SAMPLES:
        return "P99", percentile(values, 99)
    return "max", max(values) if values else float("nan")


def tail(summary: dict, name: str) -> tuple[str, float]:
    """("P99", value) with at least ``MIN_P99_SAMPLES`` samples of ``name``, else ("max", the largest)."""
    if summary.get(f"n_{name}", MIN_P99_SAMPLES) >= MIN_P99_SAMPLES:
        return "P99", summary[f"p99_{name}_ms"]
    return "max", summary[f"max_{name}_ms"]
