"""Our engine on the comparison workloads, and the figures every engine's run is reduced to.

The engine is driven exactly as ``bench`` drives it (``run_workload``, all requests arriving at
once, greedy, ``ignore_eos``), after a warm-up on unrelated prompts, so the first matmuls'
set-up and the allocator's first growth are not timed. W3 gets its own engine with
``enable_prefix_caching=True``; the others run without, as vLLM's W1/WV would if it had
nothing to share (its cache is reset before each workload).

``offline_figures`` turns per-request first/last token times into the same numbers for every
engine: output tokens/s, TPOT (median over requests of (last - first) / (n - 1)), median TTFT,
and the decode throughput once every request is decoding (what the roofline's floor bounds).
"""
from __future__ import annotations

import statistics
import time

from .driver import run_workload
from .workload import BenchRequest


def offline_figures(wall_s: float, counts: list[int], first_s: list[float] | None = None,
                    last_s: list[float] | None = None, tpot_s: float | None = None) -> dict:
    """Figures of one offline run; ``first_s``/``last_s`` per request, in seconds from the start.

    Decode throughput counts the tokens made after the last request got its first token (a
    request's tokens spread evenly between its first and last) over the time from then to the end."""
    tokens = sum(counts)
    fig = {"wall_s": wall_s, "output_tokens": tokens, "output_tok_s": tokens / wall_s,
           "tpot_ms": None, "median_ttft_ms": None, "decode_tok_s": None}
    if first_s is None or last_s is None:
        fig["tpot_ms"] = (tpot_s if tpot_s is not None else wall_s / tokens) * 1e3
        return fig
    per_request = [(b - a) / (n - 1) for a, b, n in zip(first_s, last_s, counts) if n > 1 and b > a]
    if tpot_s is None and per_request:
        tpot_s = statistics.median(per_request)
    fig["tpot_ms"] = tpot_s * 1e3 if tpot_s is not None else None
    fig["median_ttft_ms"] = statistics.median(first_s) * 1e3
    t0, t1 = max(first_s), max(last_s)
    decoded = sum((n - 1) * (b - t0) / (b - a) for a, b, n in zip(first_s, last_s, counts) if n > 1 and b > t0)
    if t1 > t0:
        fig["decode_tok_s"] = decoded / (t1 - t0)
    return fig


def _requests(name, workload):
    return [BenchRequest(0.0, list(p), m, f"{name}-{i}") for i, (p, m) in enumerate(zip(workload.prompts,
                                                                                         workload.max_tokens))]


def run(folder, workloads: dict, warmup: list[list[int]], log=print, **engine_options) -> dict:
    """Results by workload name (plus ``"startup_s"`` and ``"outputs"``: W1's first token ids)."""
    from ... import LLM

    engines, results = {}, {"startup_s": 0.0}

    def engine(prefix_caching: bool):
        if prefix_caching not in engines:
            started = time.perf_counter()
            llm = LLM(model=str(folder), device="cpu", dtype="float32", enable_prefix_caching=prefix_caching,
                      **engine_options)
            run_workload(llm, [BenchRequest(0.0, p, 4) for p in warmup], use_tqdm=False)
            results["startup_s"] += time.perf_counter() - started
            engines[prefix_caching] = llm
        return engines[prefix_caching]

    for name, workload in workloads.items():
        log(f"  labsupport {name} ...")
        llm = engine(workload.prefix_caching)
        before = llm.stats()
        outputs, wall = run_workload(llm, _requests(name, workload), use_tqdm=False)
        after = llm.stats()
        start = min(o.metrics.arrival_time for o in outputs)
        counts = [len(o.token_ids) for o in outputs]
        assert counts == workload.max_tokens, "ignore_eos: every request must produce its max_tokens"
        single_itl = outputs[0].metrics.itl if len(outputs) == 1 else None  # W0: the median gap
        fig = offline_figures(wall, counts, [o.metrics.token_times[0] - start for o in outputs],
                              [o.metrics.token_times[-1] - start for o in outputs],
                              statistics.median(single_itl) if single_itl else None)
        fig["prompt_tokens_computed"] = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
        fig["prefix_cache_hit_tokens"] = after.get("prefix_cache_hits", 0) - before.get("prefix_cache_hits", 0)
        fig["first_tokens"] = [o.token_ids[:32] for o in outputs[:4]]
        results[name] = fig
    return results
