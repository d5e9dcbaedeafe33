"""Chapter 06's rate sweep in words: what each rate served, where requests began to wait, bursty against Poisson.

The chapter's cell runs the sweep (a `benchmark` per rate and arrival pattern) and hands the runs here, so the
cell shows its measurement and this module the sentence built around it. Nothing here decides a verdict from
one run per rate: ratios between single runs are reported with ``measure.one_run_each``'s "no verdict".
"""
from __future__ import annotations

from ...measure import one_run_each
from ...percentiles import tail


def chain(values, spec: str) -> str:
    return " → ".join(format(v, spec) for v in values)


def tails(runs) -> tuple[list[float], int]:
    """Each run's TTFT tail (a P99 from 100 requests or more, else the max) and how many runs had fewer than 100."""
    got = [tail(r.summary, "ttft") for r in runs]
    return [v for _, v in got], sum(label == "max" for label, _ in got)


def tail_words(runs) -> str:
    values, maxes = tails(runs)
    name = ("TTFT max" if maxes == len(runs) else "TTFT P99" if not maxes else
            f"TTFT tail (the max where fewer than 100 requests, in {maxes} of {len(runs)} runs; else P99)")
    return f"{name} {chain(values, ',.0f')} ms"


def queue_ms(run) -> float:
    return run.summary.get("mean_queue_time_ms", float("nan"))


def sweep_reading(sweep, bursty, loads, bursty_loads, counts, burstiness: float, lone_ttft_ms: float) -> str:
    """The Poisson sweep (``sweep``, one run per entry of ``loads``) and the bursty one (``bursty`` at
    ``bursty_loads``, a subset of ``loads``) as the chapter's two paragraphs.

    A request "waited for a slot" at a rate where the server's mean queue time exceeds a tenth of one request's
    TTFT alone (``lone_ttft_ms``): that is where the knee is read from, not from the throughput ratios."""
    names = [f"{load:g}x" for load in loads]
    offered = [run.config["request_rate"] for run in sweep]
    served = [run["request_throughput"] for run in sweep]
    tok_s = [run["output_throughput"] for run in sweep]
    queued = [queue_ms(run) for run in sweep]
    waited = [q > 0.1 * lone_ttft_ms for q in queued]
    growth = [b / a for a, b in zip(tok_s, tok_s[1:])]
    text = (f"Poisson arrivals, {chain(counts, 'd')} requests at {', '.join(names)} the measured capacity "
            f"({chain(offered, '.2f')} req/s offered): throughput {chain(tok_s, '.1f')} tok/s ({chain(served, '.2f')} "
            f"req/s served), {tail_words(sweep)}, ITL P50 {chain([r['median_itl_ms'] for r in sweep], ',.0f')} ms, "
            f"server queue time {chain(queued, ',.0f')} ms. ")
    text += (f"From rate to rate throughput went {', '.join(f'×{g:.2f}' for g in growth)}: one run per rate gives no "
             "interval, so these ratios carry no verdict of their own: where the knee lies is read from the server's "
             "queue below (a request waiting for a slot).")
    if any(waited):
        first = waited.index(True)
        text += f" Requests waited for a slot from {names[first]} on (server queue {queued[first]:,.0f} ms on average)."
    else:
        text += " At no rate did requests wait for a slot in the server's queue."
    if not waited[0] and served[0] < 0.85 * offered[0]:
        text += (f" At {names[0]}, {served[0]:.2f} req/s were served of {offered[0]:.2f} offered with no request "
                 "waiting for a slot: the run's start and end, not saturation.")
    poisson_at = [sweep[list(loads).index(load)] for load in bursty_loads]   # the same rates and counts, Poisson
    text += (f"\n\nBursty arrivals (gamma shape {burstiness:g}) at {', '.join(f'{l:g}x' for l in bursty_loads)}: "
             f"{tail_words(bursty)} against Poisson's {chain(tails(poisson_at)[0], ',.0f')} ms at the same rates and "
             "request counts ("
             + ", ".join(one_run_each(b, p) for b, p in zip(tails(bursty)[0], tails(poisson_at)[0]))
             + f"); server queue time {chain([queue_ms(r) for r in bursty], ',.0f')} ms against "
             f"{chain([queue_ms(r) for r in poisson_at], ',.0f')} ms.")
    return text
