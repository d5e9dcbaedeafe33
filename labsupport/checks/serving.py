"""Check for chapter 06: the attendee's ``goodput(results, slo, duration_s)``.

Goodput is the rate of requests that succeeded *and* met every latency target (SLO) given:
``slo`` maps ``"ttft"``, ``"tpot"``, ``"e2el"`` to milliseconds, while a ``RequestResult``
holds seconds. The check compares the attendee's function with the reference
(``labsupport.bench.serve_bench.goodput``) on hand-made results, each built to catch one
mistake (a failed request counted, ``any`` instead of ``all``, seconds compared with
milliseconds, a one-token answer's TPOT divided by zero, an SLO key that is not there, the
boundary, an empty run), then on real benchmark runs at SLOs set between measured values.
"""
from __future__ import annotations

import math

from ..bench.serve_bench import RequestResult
from ..bench.serve_bench import goodput as reference_goodput
from .base import CheckFailed, passed


def _result(ttft: float, latency: float, output_tokens: int, success: bool = True) -> RequestResult:
    """A request as the load generator records it (seconds); TPOT follows from the three numbers."""
    return RequestResult(prompt_len=32, output_len=output_tokens, success=success, ttft=ttft, latency=latency,
                         output_tokens=output_tokens, error="" if success else "HTTP 500: a step failed")


def hand_made_cases() -> list[tuple[str, list[RequestResult], dict, float]]:
    """``(what it tests, results, slo, duration_s)``; TPOTs: (latency - ttft) / (output_tokens - 1)."""
    fast = _result(0.10, 1.00, 10)            # TTFT 100 ms, TPOT 100 ms, E2E 1000 ms
    slow_start = _result(0.90, 1.80, 10)      # TTFT 900 ms, TPOT 100 ms
    slow_tokens = _result(0.10, 4.60, 10)     # TTFT 100 ms, TPOT 500 ms
    slow_both = _result(0.90, 5.40, 10)       # TTFT 900 ms, TPOT 500 ms
    failed = _result(0.0, 0.0, 0, success=False)  # nothing measured: zeros, which would "meet" any SLO
    one_token = _result(0.20, 0.20, 1)        # no second token: TPOT is 0 by definition
    at_limit = _result(0.25, 0.25, 1)         # TTFT exactly 250 ms
    return [
        ("every request fast: goodput = requests / duration", [fast, fast, fast, fast], {"ttft": 500, "tpot": 200}, 2.0),
        ("SLOs are in milliseconds, results in seconds", [fast, slow_start], {"ttft": 300}, 1.0),
        ("a failed request never counts, though its zero latencies are under every SLO",
         [fast, failed, failed, fast], {"ttft": 500, "tpot": 200}, 4.0),
        ("a request must meet every SLO given (all, not any)",
         [fast, slow_start, slow_tokens, slow_both], {"ttft": 500, "tpot": 200}, 1.0),
        ("an SLO key that is not given is no constraint (TTFT only)",
         [fast, slow_start, slow_tokens], {"ttft": 500}, 1.0),
        ("an SLO key that is not given is no constraint (TPOT only)",
         [fast, slow_start, slow_tokens], {"tpot": 200}, 1.0),
        ("e2el is the whole request's latency", [fast, slow_start, slow_tokens], {"e2el": 2000}, 3.0),
        ("no SLO at all: every successful request counts", [fast, failed, slow_tokens], {}, 2.0),
        ("a one-token answer has TPOT 0: it meets any TPOT SLO (no division by zero)",
         [one_token, slow_tokens], {"tpot": 50}, 1.0),
        ("exactly at the limit meets the SLO (<=)", [at_limit, slow_start], {"ttft": 250}, 1.0),
        ("a rate: divided by the duration given, not by the number of requests",
         [fast, fast, slow_tokens], {"ttft": 500, "tpot": 200}, 8.0),
        ("no results: 0 requests per second", [], {"ttft": 500}, 5.0),
        ("only failures: 0 requests per second", [failed, failed], {"ttft": 500}, 5.0),
        ("a duration of 0 (nothing ran): 0, not a ZeroDivisionError", [], {"ttft": 500}, 0.0),
    ]


def real_slos(results: list[RequestResult]) -> list[dict]:
    """SLOs that split real results: each limit lies halfway between two measured values, so no
    value sits on it and the seconds-vs-milliseconds rounding of either formula cannot matter."""
    done = [r for r in results if r.success]
    slos = []
    for key, value in (("ttft", lambda r: r.ttft), ("tpot", lambda r: r.tpot), ("e2el", lambda r: r.latency)):
        ms = sorted({1000 * value(r) for r in done})
        if len(ms) >= 2:
            mid = len(ms) // 2
            slos.append({key: (ms[mid - 1] + ms[mid]) / 2})
    if len(slos) == 3:
        slos.append({k: v for s in slos[:2] for k, v in s.items()})  # TTFT and TPOT together
        slos.append({k: v for s in slos for k, v in s.items()})      # all three
    return slos


def _variant(results, slo, duration_s, *, scale=1000, need_success=True, combine=all, per_second=True):
    """Goodput computed with one known mistake (the defaults compute it right)."""
    measured = {"ttft": lambda r: r.ttft, "tpot": lambda r: r.tpot, "e2el": lambda r: r.latency}
    good = [r for r in results if (r.success or not need_success)
            and (not slo or combine(measured[k](r) * scale <= v for k, v in slo.items()))]
    if not per_second:
        return float(len(good))
    return len(good) / duration_s if duration_s > 0 else 0.0


MISTAKES = [  # (what the attendee probably did, the same computation with that mistake)
    ("compared seconds with milliseconds: results are in seconds, the SLO in milliseconds (x 1000)",
     lambda res, slo, d: _variant(res, slo, d, scale=1)),
    ("counted failed requests: check r.success first", lambda res, slo, d: _variant(res, slo, d, need_success=False)),
    ("counted a request that met any one SLO: it must meet all of them", lambda res, slo, d: _variant(res, slo, d, combine=any)),
    ("returned a count: divide by duration_s for a rate per second", lambda res, slo, d: _variant(res, slo, d, per_second=False)),
    ("returned a fraction of the requests: goodput is per second of the run, divide by duration_s",
     lambda res, slo, d: _variant(res, slo, d, per_second=False) / len(res) if res else 0.0),
]


def _hint(got, results, slo, duration_s) -> str:
    if not isinstance(got, (int, float)):
        return ". Return a number: requests per second"
    want = reference_goodput(results, slo, duration_s)
    close = lambda a, b: math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)  # noqa: E731
    why = [w for w, wrong in MISTAKES if close(got, wrong(results, slo, duration_s))
           and not close(want, wrong(results, slo, duration_s))]
    return f". It looks like your function {' or '.join(why)}" if why else ""


def _compare(goodput_fn, what: str, results, slo, duration_s):
    want = reference_goodput(results, slo, duration_s)
    try:
        got = goodput_fn(results, dict(slo), duration_s)
    except Exception as exc:
        hint = (": a key absent from slo is no constraint, so loop over slo.items()" if isinstance(exc, KeyError)
                else "")
        raise CheckFailed(f"[{what}] goodput(..., slo={slo}, duration_s={duration_s}) raised "
                          f"{type(exc).__name__}: {exc}{hint}") from exc
    if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isclose(got, want, rel_tol=1e-9,
                                                                                         abs_tol=1e-12):
        counts = f"{want * duration_s:.0f} of {len(results)} requests" if duration_s else "none"
        raise CheckFailed(f"[{what}] slo={slo}, duration_s={duration_s}: got {got!r}, expected {want:.6g} "
                          f"requests/s ({counts} count){_hint(got, results, slo, duration_s)}")


def check_goodput(goodput_fn, runs=()):
    """Chapter 06: ``goodput_fn(results, slo, duration_s) -> requests per second``.

    ``runs``: real ``BenchResult``s (from ``serve_bench.benchmark``) to compare on as well."""
    cases = hand_made_cases()
    for what, results, slo, duration in cases:
        _compare(goodput_fn, what, results, slo, duration)
    try:
        goodput_fn([_result(0.1, 1.0, 10)], {"ttft_ms": 500}, 1.0)
    except ValueError:
        pass
    else:
        raise CheckFailed("an SLO key the function does not know ('ttft_ms') must raise ValueError: a typo "
                          "would otherwise drop that SLO silently and inflate the goodput")
    compared = 0
    for i, run in enumerate(runs):
        duration = run.summary["duration"]
        for slo in real_slos(run.requests):
            _compare(goodput_fn, f"real run {i} ({len(run.requests)} requests)", run.requests, slo, duration)
            compared += 1
    message = f"goodput matches the reference in {len(cases) + 1} hand-made cases"
    if runs:
        message += f" and on {len(runs)} real runs at {compared} SLOs"
    passed(message)
