"""What a production router adds when workers fail: ``vllm-router`` in front of two of our workers, faults on purpose.

Chapter 07's section 8 kills a worker behind the chapter's own router. Here the vLLM project's router
(``pd/production_router.py``) stands in front of two colocated instances, and the drill makes four faults,
one after the other, reporting what the client saw (status codes, chunks received, how long a request took)
and what the router's own counters say (its Prometheus text: retries, circuit-breaker state):

1. **killed mid-stream**: SIGKILL to the worker serving a streamed answer. A router cannot retry half a stream:
   the client's stream ends early; health checks (``--health-check-interval-secs``,
   ``--health-failure-threshold``) take the dead worker out, and the next requests go to the survivor.
2. **recovery**: the killed worker restarted on its port; the health checks bring it back
   (``--health-success-threshold``), and requests reach both again, without touching the router.
3. **frozen** (SIGSTOP): the worker accepts connections and never answers, the failure a health check sees
   last. ``--request-timeout-secs`` ends each try, ``--retry-max-retries`` sends it to the other worker, and
   the circuit breaker (``--cb-failure-threshold``) stops sending there at all; SIGCONT, and it serves again.
4. **overload**: a router with ``--max-concurrent-requests 1`` meets a burst it cannot hold, twice. Its
   concurrency limit is a token bucket with an optional queue in front (``src/middleware.rs`` in vllm-router):
   with ``--queue-size 0`` (no queue) a request that finds no token is refused at once with **429**; with a
   queue, a queue-processing task takes each queued request off the channel at once and waits for a token on
   its behalf, so the channel hardly ever fills and the refusal comes later, as **408** when
   ``--queue-timeout-secs`` passes. Either way the client gets a status code instead of an unbounded wait.

Then every block of both workers must be free and nothing running in them: a fault must not leak. The
drill reports counts and codes, never a speed: each act is one run, so its timings are single samples.
"""
from __future__ import annotations

import collections
import concurrent.futures
import os
import signal
import time

import httpx

from ..pd.production_router import ProductionRouter
from ..bench.serving.soak_probes import metrics
from ..serve.metrics import parse_metrics

HEALTH = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1",
          "--health-check-timeout-secs", "1"]


def _metrics(worker) -> dict[str, float]:
    return metrics(worker.url)


def _served(workers) -> list[float]:
    """Requests each worker finished so far (its own counter)."""
    return [_metrics(w).get("labsupport:request_success_total", 0.0) for w in workers]


def _post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, float]:
    t0 = time.perf_counter()
    try:
        code = httpx.post(url + "/v1/completions", json=body, timeout=timeout).status_code
    except httpx.HTTPError as exc:
        code = type(exc).__name__
    return code, time.perf_counter() - t0


def _router_counters(router) -> dict[str, float]:
    """The router's retry and circuit-breaker counters, summed over their labels (``parse_metrics``' plain names)."""
    return {name: value for name, value in parse_metrics(router.metrics()).items()
            if "{" not in name and name.endswith("_total") and any(w in name for w in ("retr", "circuit", "cb_"))}


def _wait(predicate, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def _idle(worker) -> bool:
    """Nothing running, waiting or held for a pull, and no block in use (usage 0: every block free)."""
    m = _metrics(worker)
    return all(m.get(f"labsupport:{k}", 0) == 0 for k in ("num_requests_running", "num_requests_waiting",
                                                           "kv_requests_held", "kv_cache_usage_perc"))


def _after_the_kill(router, workers, victim, survivor, short, body, chunks, outcome, probes, progress) -> dict:
    """Acts 1 (what followed the kill) and 2 (the restart)."""
    acts = {}
    time.sleep(2.5)  # health checks every second, one failure marks the worker down
    before = _served([survivor])[0]
    codes = [_post(router.url, short)[0] for _ in range(probes)]
    acts["killed"] = {"chunks": chunks, "of": body["max_tokens"], "outcome": outcome, "then": codes,
                      "survivor_served": _served([survivor])[0] - before}
    progress(f"killed mid-stream after {chunks} of {body['max_tokens']} chunks: the client saw {outcome}; "
             f"the next {probes} requests got {codes}, {acts['killed']['survivor_served']:.0f} served by the "
             "survivor")
    # 2. recovery: the same worker restarted on its port
    t0 = time.perf_counter()
    victim.restart()
    back = _wait(lambda: httpx.get(router.url + "/health", timeout=2).status_code == 200, 10)
    time.sleep(2.0)  # one health check past success
    before = _served(workers)
    codes = [_post(router.url, short)[0] for _ in range(probes)]
    spread = [a - b for a, b in zip(_served(workers), before)]
    acts["recovered"] = {"restart_s": time.perf_counter() - t0, "router_healthy": back, "then": codes,
                         "served_by": spread}
    progress(f"restarted ({acts['recovered']['restart_s']:.0f} s): the next {probes} requests got {codes}, "
             f"served {spread[0]:.0f} / {spread[1]:.0f} by the two workers")
    return acts


def fault_drill(workers, model: str, request_timeout_s: int = 4, probes: int = 4, progress=print) -> dict:
    """The four acts (module docstring) against two started workers (``pd.cluster.Worker``); returns what each act
    saw. ``model``: the name the workers serve. ``progress``: called with one line per act."""
    if len(workers) != 2:
        raise ValueError("the drill needs two workers: one to fail, one to survive")
    down = [w.name for w in workers if not w.alive]
    if down:
        raise ValueError(f"start every worker before the drill: {', '.join(down)} not running")
    short = {"model": model, "prompt": "A router in front of two workers", "max_tokens": 4, "temperature": 0}
    acts = {}
    args = [*HEALTH, "--request-timeout-secs", str(int(request_timeout_s)), "--retry-max-retries", "2",
            "--retry-initial-backoff-ms", "50", "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "30"]
    with ProductionRouter(workers=workers, policy="round_robin", args=args) as router:
        # 1. killed mid-stream
        body = {**short, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        chunks, outcome, victim = 0, "finished", None
        try:
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
                try:
                    for line in r.iter_lines():
                        chunks += line.startswith("data: {")
                        if chunks == 5 and victim is None:
                            busy = [w for w in workers if _metrics(w).get("labsupport:num_requests_running") == 1]
                            if len(busy) != 1:
                                raise RuntimeError(f"expected one worker streaming, found {len(busy)}: is another "
                                                   "client using these workers?")
                            victim = busy[0]
                            victim.kill()
                        if line == "data: [DONE]":
                            break
                    else:
                        outcome = "cut (the connection closed without [DONE])"
                except httpx.HTTPError as exc:
                    outcome = f"error: {type(exc).__name__}"
            if victim is None:
                raise RuntimeError(f"the stream ended after {chunks} chunks, before a worker could be killed")
            survivor = next(w for w in workers if w is not victim)
            acts.update(_after_the_kill(router, workers, victim, survivor, short, body, chunks, outcome, probes,
                                        progress))
        finally:
            if victim is not None and not victim.alive:
                victim.restart()  # a failed act must not leave the caller a dead worker
        # 3. frozen: SIGSTOP to one worker's whole process group
        frozen = workers[0]
        counters0 = _router_counters(router)
        os.killpg(frozen.proc.pid, signal.SIGSTOP)
        try:
            tries = [_post(router.url, short, timeout=4 * request_timeout_s + 10) for _ in range(probes)]
        finally:
            os.killpg(frozen.proc.pid, signal.SIGCONT)
        counters = {k: v - counters0.get(k, 0.0) for k, v in _router_counters(router).items()}
        acts["frozen"] = {"codes": [c for c, _ in tries], "seconds": [round(s, 2) for _, s in tries],
                          "router_counters": {k: v for k, v in counters.items() if v}}
        progress(f"frozen (SIGSTOP) for {probes} requests: codes {acts['frozen']['codes']}, each in "
                 f"{', '.join(f'{s:.1f}' for s in acts['frozen']['seconds'])} s (request timeout "
                 f"{request_timeout_s:g} s); router counters that moved: {acts['frozen']['router_counters'] or 'none'}")
        _wait(lambda: _idle(frozen), 15)
    # 4. overload: one at a time, no queue (429), then a queue with a timeout (408)
    burst = 6
    slow = {**short, "max_tokens": 48, "ignore_eos": True}
    acts["overload"] = {}
    for label, queue in (("no queue", ["--queue-size", "0"]),
                         ("queue, 1 s timeout", ["--queue-size", "4", "--queue-timeout-secs", "1"])):
        with ProductionRouter(workers=workers, policy="round_robin",
                              args=[*HEALTH, "--max-concurrent-requests", "1", *queue]) as router:
            with concurrent.futures.ThreadPoolExecutor(burst) as pool:
                got = list(pool.map(lambda _: _post(router.url, slow), range(burst)))
        codes = dict(collections.Counter(c for c, _ in got))
        acts["overload"][label] = {"burst": burst, "codes": codes}
        progress(f"a burst of {burst} at a router holding 1 at a time, {label}: "
                 + ", ".join(f"{n} x {c}" for c, n in sorted(codes.items(), key=lambda kv: str(kv[0]))))
        _wait(lambda: all(_idle(w) for w in workers), 15)
    # nothing leaked
    leaked = {w.name: not _wait(lambda w=w: _idle(w), 15) for w in workers}
    acts["leaked"] = leaked
    progress("afterwards: " + ", ".join(
        f"{name}: {'blocks still held or requests running' if bad else 'every block free, nothing running'}"
        for name, bad in leaked.items()))
    return acts
