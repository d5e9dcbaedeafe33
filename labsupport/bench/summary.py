"""The numbers of a serving benchmark, from per-request timings.

Throughput (output tokens and requests per second of wall time), and for latency the median
and the 99th percentile: the median is the typical user, P99 the unlucky one a service level
objective is written for. TTFT, TPOT, ITL (every gap between tokens), end-to-end latency and
queueing time, all in milliseconds.
"""
from __future__ import annotations

import json
import shlex
import sys
import time

from ..machine import machine
from ..percentiles import percentile, tail


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


def command() -> str:
    """The command line that started this process, as a reader would type it again (``python -m labsupport ...``)."""
    return shlex.join(["python", *sys.orig_argv[1:]])


def write_report(path: str, data: dict) -> dict:
    """Write a measurement to ``path`` as JSON with what a reader needs to trust it later: the machine it ran on,
    the date and the command that made it (each kept where ``data`` already records its own, as a GPU run its
    device). Returns what was written. The benchmark commands' ``--json`` go through here, so a saved run lacks
    none of the three (``bench serve --save-result`` writes vLLM's result format instead)."""
    record = {"machine": data.get("machine") or machine(), "date": data.get("date") or time.strftime("%Y-%m-%d"),
              "command": data.get("command") or command(), **data}
    with open(path, "w") as f:
        json.dump(record, f, indent=2, default=str)
    print(f"wrote {path}")
    return record


def save_run(result: dict, json_path: str | None, plot_path: str | None, draw) -> None:
    """A benchmark command's ``--json`` and ``--plot``: the run as JSON, ``draw(result)``'s figure as a PNG."""
    if json_path:
        write_report(json_path, result)
    if plot_path:
        draw(result).savefig(plot_path, dpi=130)
        print(f"wrote {plot_path}")
