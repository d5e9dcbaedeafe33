"""What only the server knows, read from its Prometheus ``/metrics`` before and after a run.

The client sees latencies; whether a prompt's prefix was already cached, or how long a request
waited in the scheduler's queue, is visible only inside. vLLM exports both (``vllm:`` prefix)
and so does our server (``labsupport:``); counters only grow, so the run's share is the
difference between two scrapes. A server without ``/metrics`` simply adds nothing.
"""
from __future__ import annotations

PREFIXES = ("labsupport:", "vllm:")


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (engines, models), for the names we read."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(PREFIXES):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def scrape_server_metrics(client, base_url: str) -> dict[str, float] | None:
    """The parsed ``/metrics`` of the server, or None where it has none (or it cannot be read)."""
    try:
        resp = await client.get(base_url + "/metrics", timeout=10)
        return parse_metrics(resp.text) if resp.status_code == 200 else None
    except Exception:  # a bench must not fail for want of optional metrics
        return None


def _counter(values: dict[str, float], prefix: str, name: str) -> float | None:
    for key in (f"{prefix}{name}_total", f"{prefix}{name}"):
        if key in values:
            return values[key]
    return None


def server_metrics_delta(before: dict | None, after: dict | None) -> dict:
    """``prefix_cache_hit_rate`` (cached prompt tokens / prompt tokens looked up) and
    ``mean_queue_time_ms`` over the run, for whichever of the two prefixes the server uses."""
    if before is None or after is None:
        return {}
    out = {}
    for prefix in PREFIXES:
        diff = {}
        for name in ("prefix_cache_queries", "prefix_cache_hits", "request_queue_time_seconds_sum",
                     "request_queue_time_seconds_count"):
            a, b = _counter(after, prefix, name), _counter(before, prefix, name)
            if a is not None:
                diff[name] = a - (b or 0.0)
        if diff.get("prefix_cache_queries"):
            out["prefix_cache_hit_rate"] = diff.get("prefix_cache_hits", 0.0) / diff["prefix_cache_queries"]
        if diff.get("request_queue_time_seconds_count"):
            out["mean_queue_time_ms"] = (1000 * diff.get("request_queue_time_seconds_sum", 0.0)
                                         / diff["request_queue_time_seconds_count"])
        if out:
            out["server_metrics_prefix"] = prefix
            break
    return out
