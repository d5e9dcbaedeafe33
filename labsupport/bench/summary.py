"""The numbers of a serving benchmark, from per-request timings.

Throughput (output tokens and requests per second of wall time), and for latency the median
and the 99th percentile: the median is the typical user, P99 the unlucky one a service level
objective is written for. TTFT, TPOT, ITL (every gap between tokens), end-to-end latency and
queueing time, all in milliseconds.
"""
from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(outputs, duration_s: float) -> dict:
    ms = 1000.0
    series = {
        "ttft": [o.metrics.ttft * ms for o in outputs],
        "tpot": [o.metrics.tpot * ms for o in outputs if o.metrics.tpot is not None],
        "itl": [gap * ms for o in outputs for gap in o.metrics.itl],
        "latency": [o.metrics.latency * ms for o in outputs],
        "queueing": [o.metrics.queueing_time * ms for o in outputs],
    }
    out_tokens = sum(len(o.token_ids) for o in outputs)
    summary = {
        "requests": len(outputs),
        "duration_s": duration_s,
        "request_throughput": len(outputs) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_output_tokens": out_tokens,
    }
    for name, values in series.items():
        summary[f"mean_{name}_ms"] = sum(values) / len(values) if values else float("nan")
        summary[f"p50_{name}_ms"] = percentile(values, 50)
        summary[f"p99_{name}_ms"] = percentile(values, 99)
        summary[f"max_{name}_ms"] = max(values) if values else float("nan")
        summary[f"n_{name}"] = len(values)
    return summary


MIN_P99_SAMPLES = 100  # below this, a "P99" is the largest sample or next to it: call it the max


def tail(summary: dict, name: str) -> tuple[str, float]:
    """("P99", value) with at least ``MIN_P99_SAMPLES`` samples of ``name``, else ("max", the largest)."""
    if summary.get(f"n_{name}", MIN_P99_SAMPLES) >= MIN_P99_SAMPLES:
        return "P99", summary[f"p99_{name}_ms"]
    return "max", summary[f"max_{name}_ms"]


def format_summary(summary: dict) -> str:
    lines = [f"{'requests':28s}{summary['requests']}",
             f"{'duration (s)':28s}{summary['duration_s']:.2f}",
             f"{'request throughput (req/s)':28s}{summary['request_throughput']:.2f}",
             f"{'output throughput (tok/s)':28s}{summary['output_throughput']:.1f}"]
    for name in ("ttft", "tpot", "itl", "latency", "queueing"):
        label, value = tail(summary, name)
        lines.append(f"{name.upper() + f' (ms) mean/P50/{label}':28s}{summary[f'mean_{name}_ms']:.1f} / "
                     f"{summary[f'p50_{name}_ms']:.1f} / {value:.1f}")
    return "\n".join(lines)


def save_run(result: dict, json_path: str | None, plot_path: str | None, draw) -> None:
    """A benchmark command's ``--json`` and ``--plot``: the run as JSON, ``draw(result)``'s figure as a PNG."""
    import json
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {json_path}")
    if plot_path:
        draw(result).savefig(plot_path, dpi=130)
        print(f"wrote {plot_path}")
