"""Check for chapter 06: the attendee's ``goodput(results, slo, duration_s)``.

Goodput is the rate of requests that succeeded *and* met every latency target (SLO) given:
``slo`` maps ``"ttft"``, ``"tpot"``, ``"e2el"`` to milliseconds, while a ``RequestResult``
holds seconds. The check compares the attendee's function with the reference
(``labsupport.bench.serving.serve_bench.goodput``) on hand-made results, each built to catch one
mistake (a failed request counted, ``any`` instead of ``all``, seconds compared with
milliseconds, a one-token answer's TPOT divided by zero, an SLO key that is not there, the
boundary, an empty run), then on real benchmark runs at SLOs set between measured values.
"""
from __future__ import annotations

import asyncio
import ctypes
import math
import threading
import time

from ..bench.serving.serve_bench import RequestResult
from ..bench.serving.serve_bench import goodput as reference_goodput
from ..serve.request_stream import EngineUnavailableError
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


# ---------------------------------------------------------------------------------------------------------------
# The hard exercise: the stream between the engine-loop thread and one client (``RequestStream`` and ``deliver``)

STEP_PAUSE_S = 0.5   # each step of the check's engine first sleeps this long with the GIL free: a bigger model's
                     # forward pass. A loop blocked until the next output then shows a lag of a whole step.
LAG_LIMIT_S = 0.25   # the event loop may wake a sleeping task this late (half a padded step) at most once: a stream
                     # that blocks it does so at every step, a busy machine now and then
WAKE_LIMIT_S = 0.5   # an output handed over must reach its reader within this (well under two padded steps)
WAIT_S = 2.0         # the longest the check waits for any one output or end of stream
ABORT_WAIT_S = 1.5   # after a client leaves, its request must be out of the engine within this
TOTAL_S = 60.0       # the whole check, whatever the code under test does


class _Timeline:
    """When ``deliver`` handed each stream something (engine thread), so a reader's wait can be judged."""

    def __init__(self, deliver):
        self.deliver, self.handed = deliver, []

    def __call__(self, loop, items):
        now = time.perf_counter()
        self.handed.extend((now, stream) for stream, _, _ in items)
        self.deliver(loop, items)

    def first_since(self, stream, since: float) -> float | None:
        return min((t for t, s in list(self.handed) if s is stream and t >= since), default=None)


async def _read(engine, timeline, prepared, rid, *, leave_after=None) -> list:
    """One client: submit, then read its stream as the server's handler does (each wait bounded), and close it
    on the way out — what a disconnect does. Returns the outputs read; raises CheckFailed saying what went wrong."""
    stream = engine.submit([prepared], [rid])
    outputs, since = [], time.perf_counter()
    try:
        while True:
            asked = time.perf_counter()
            try:
                batch = await asyncio.wait_for(stream.__anext__(), WAIT_S)
            except StopAsyncIteration:
                return outputs
            except asyncio.TimeoutError:
                if outputs and outputs[-1].finished:
                    raise CheckFailed(f"[{rid}] its request finished (the last output had finish_reason "
                                      f"{outputs[-1].finish_reason!r}) but the stream did not end within {WAIT_S:g} s: "
                                      "once every request of a stream has finished, __anext__ must raise "
                                      "StopAsyncIteration") from None
                if timeline.first_since(stream, since) is not None:
                    raise CheckFailed(f"[{rid}] deliver() handed this stream an output, but its reader saw nothing "
                                      f"for {WAIT_S:g} s: a missed wake-up. The engine thread must wake the event loop "
                                      "(loop.call_soon_threadsafe), and put() must set the event the reader awaits"
                                      ) from None
                raise CheckFailed(f"[{rid}] no output within {WAIT_S:g} s, and deliver() was never called for this "
                                  "stream: does submit() reach the engine (stream_class(abort, request_ids))?") from None
            received = time.perf_counter()
            handed = timeline.first_since(stream, since)
            if handed is not None and received - max(asked, handed) > WAKE_LIMIT_S:
                raise CheckFailed(f"[{rid}] an output reached its reader {received - max(asked, handed):.2f} s after "
                                  "deliver() handed it over, while the reader was waiting: a missed wake-up (the loop "
                                  "slept until something else woke it). Hand outputs over with "
                                  "loop.call_soon_threadsafe, never by calling stream.put from the engine thread")
            since = received
            if not isinstance(batch, dict) or set(batch) - {0}:
                raise CheckFailed(f"[{rid}] a batch must be a dict {{index: latest output}}, got {batch!r:.80}")
            if isinstance(batch.get(0), BaseException):
                raise CheckFailed(f"[{rid}] the stream yielded an exception instead of raising it: {batch[0]!r}")
            if 0 in batch:
                outputs.append(batch[0])
            if leave_after is not None and len(outputs) >= leave_after:
                return outputs            # the client hangs up: the finally below is the server's disconnect path
    finally:
        stream.close()


async def _probe_lag(stop: asyncio.Event, interval: float = 0.01) -> list[float]:
    """How late a task asking to sleep ``interval`` woke, each time: how long the loop was busy elsewhere."""
    loop, lags = asyncio.get_running_loop(), []
    while not stop.is_set():
        asked = loop.time()
        await asyncio.sleep(interval)
        lags.append(max(0.0, loop.time() - asked - interval))
    return lags


async def _idle_within(llm, seconds: float) -> dict:
    """The engine's stats once nothing runs or waits and every KV block is free, or after ``seconds``."""
    deadline = time.perf_counter() + seconds
    while True:
        stats = llm.engine.stats()
        idle = stats["num_requests_running"] == stats["num_requests_waiting"] == 0
        if (idle and stats["kv_blocks_free"] == stats["kv_blocks_total"]) or time.perf_counter() > deadline:
            return stats
        await asyncio.sleep(0.02)


async def _scenario(engine, timeline, llm, clients: int, tokens: int) -> dict:
    from ..engine.request import SamplingParams

    def prepared(i, n):
        return llm.frontend.prepare(f"Client {i}: name a colour.", SamplingParams(max_tokens=n, temperature=0,
                                                                                 ignore_eos=True))

    def complete(rid, outputs):
        if not outputs or not outputs[-1].finished or len(outputs[-1].token_ids) != tokens:
            last = outputs[-1] if outputs else None
            raise CheckFailed(f"[{rid}] the stream ended without the finished output: last output "
                              f"{None if last is None else (len(last.token_ids), last.finish_reason)}, expected "
                              f"{tokens} tokens and finish_reason 'length' (outputs are cumulative; the last has them all)")
        counts = [len(o.token_ids) for o in outputs]
        if counts != sorted(counts):
            raise CheckFailed(f"[{rid}] outputs went backwards ({counts} tokens): keep only the latest of each choice")

    # 1. one client on a quiet event loop: nothing else would wake it, so a missed wake-up stalls
    alone = await _read(engine, timeline, prepared(0, tokens), "alone")
    complete("alone", alone)
    # 2. clients at once, one of them hanging up after its first output, while a probe times the loop
    stop = asyncio.Event()
    probe = asyncio.create_task(_probe_lag(stop))
    readers = [_read(engine, timeline, prepared(i, tokens), f"client-{i}") for i in range(1, clients + 1)]
    leaver = _read(engine, timeline, prepared(99, 64 * tokens), "leaves-early", leave_after=1)
    try:
        *done, left = await asyncio.gather(*readers, leaver)
    finally:
        stop.set()
        lags = await probe
    for i, outputs in enumerate(done, 1):
        complete(f"client-{i}", outputs)
    lag, late = max(lags, default=0.0), sum(lag > LAG_LIMIT_S for lag in lags)
    if late > 1:
        raise CheckFailed(f"with {clients + 1} streams the event loop woke a 10 ms sleep over {1000 * LAG_LIMIT_S:.0f} ms "
                          f"late {late} times, at worst {1000 * lag:.0f} ms (a step takes over {1000 * STEP_PAUSE_S:.0f} "
                          "ms): something "
                          "blocks the loop while the engine steps — a blocking get (queue.Queue, threading.Event.wait) "
                          "or time.sleep in __anext__. Await an asyncio.Event instead")
    stats = await _idle_within(llm, ABORT_WAIT_S)
    if stats["num_requests_running"] or stats["kv_blocks_free"] != stats["kv_blocks_total"]:
        raise CheckFailed(f"{ABORT_WAIT_S:g} s after its client hung up, the abandoned request still runs "
                          f"({stats['num_requests_running']} running, {stats['kv_blocks_total'] - stats['kv_blocks_free']}"
                          " KV blocks held): a lost abort. close() must call abort(request_id) for every request that "
                          "has not finished")
    # 3. the server shuts down under a reader: the error it delivers must end the stream, raised
    stream = engine.submit([prepared(100, 64 * tokens)], ["shut-down"])
    try:
        await asyncio.wait_for(stream.__anext__(), WAIT_S)
        engine.shutdown(wait=False)
        try:
            async def drain():
                async for _ in stream:
                    pass
            await asyncio.wait_for(drain(), WAIT_S)
        except asyncio.TimeoutError:
            raise CheckFailed(f"the server shut down under a reader, and its stream neither raised nor ended within "
                              f"{WAIT_S:g} s: an exception put() into the stream must be raised by __anext__") from None
        except EngineUnavailableError:
            pass
        else:
            raise CheckFailed("the server shut down under a reader, and its stream ended as if the answer were complete: "
                              "an exception put() into the stream must be raised by __anext__")
    finally:
        stream.close()
    return {"lag": lag, "left": len(left[-1].token_ids) if left else 0, "steps": engine.num_steps}


RELEASE_S = 5.0  # after the check's time is up, how long its thread gets to unwind once told to


class _Abandoned(Exception):
    """Raised inside the check's thread when its time is up, to unwind a reader stuck in the attendee's code."""


def _unblock(engine, streams):
    """Free a reader blocked inside an attendee's ``__anext__`` after the check's time is up. A blocked event loop
    never runs what ``deliver`` hands it (``loop.call_soon_threadsafe``), so the engine's shutdown alone cannot
    reach the stream: its error is also put straight into each stream, from this thread, which wakes a stream
    waiting on a thread-safe queue or event."""
    engine.shutdown(wait=False)
    for stream in streams:
        for index in range(len(getattr(stream, "request_ids", ())) or 1):
            try:
                stream.put(index, EngineUnavailableError("the check's time is up"))
            except Exception:  # noqa: BLE001 -- the attendee's put may itself be the broken piece
                pass


def _run_bounded(coro_fn, seconds: float, unblock=None):
    """Run ``coro_fn()`` in a fresh event loop on a thread of its own (a notebook's loop is already running), for
    at most ``seconds``: (result, error, stuck): (result, None, False), (None, exception, False), or, when it
    did not finish, (None, None, stuck).

    A thread cannot be killed, so one that overruns is freed as far as Python allows, then joined (bounded):
    ``unblock()`` first (wakes a reader waiting on something), then ``_Abandoned`` raised inside the thread,
    which ends Python code that loops or sleeps in steps (``while not ready: time.sleep(0.01)``); its event
    loop is closed on the way out. ``stuck`` says the thread is still alive after that: a wait in C with no
    timeout, which only its process's end frees."""
    box = {}

    def target():
        try:
            box["result"] = asyncio.run(coro_fn())
        except _Abandoned:
            pass
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller, who reports it
            box["error"] = exc

    thread = threading.Thread(target=target, name="stream-check", daemon=True)
    thread.start()
    thread.join(seconds)
    if not thread.is_alive():
        return box.get("result"), box.get("error"), False
    if unblock is not None:
        unblock()
    thread.join(RELEASE_S / 2)
    deadline = time.monotonic() + RELEASE_S / 2
    while thread.is_alive() and time.monotonic() < deadline:
        # asynchronously raised: the thread sees it at its next Python instruction (again, if its code catches one)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Abandoned))
        thread.join(0.1)
    return None, None, thread.is_alive()


def check_request_streams(stream_class, deliver, llm, clients: int = 4, tokens: int = 4):
    """Chapter 06: the attendee's ``RequestStream`` class and ``deliver(loop, items)``, plugged into a real
    ``AsyncEngine`` on ``llm`` (no other server may own it meanwhile; the engine's own pieces are not touched).

    Three scenes, each wait bounded: one client alone (a missed wake-up stalls it; a stream that never ends is
    caught after its last output), ``clients`` clients at once with one more hanging up after its first output
    (the loop's lag, every answer complete, the abandoned request's blocks freed), and a shutdown under a reader
    (its stream raises). Every step is padded with ``STEP_PAUSE_S`` of sleep outside the GIL, as a bigger
    model's forward pass would be, so a loop blocked for a step cannot pass for noise."""
    from ..serve.async_engine import AsyncEngine

    engine = AsyncEngine(llm, max_waiting_requests=None)
    step = engine._step

    def padded_step():
        time.sleep(STEP_PAUSE_S)
        step()

    engine._step = padded_step
    submit, streams = engine.submit, []

    def recorded_submit(prepared, request_ids):
        streams.append(submit(prepared, request_ids))  # kept to unblock a reader stuck in __anext__ (see below)
        return streams[-1]

    engine.submit = recorded_submit
    timeline = _Timeline(deliver)
    started = time.perf_counter()
    try:
        with engine.plugged(stream_class=stream_class, deliver=timeline):
            result, error, stuck = _run_bounded(lambda: _scenario(engine, timeline, llm, clients, tokens), TOTAL_S,
                                                lambda: _unblock(engine, streams))
    finally:
        engine.shutdown()
    if stuck:
        raise CheckFailed(f"the check did not finish in {TOTAL_S:g} s, and its thread is still blocked inside your "
                          "__anext__ (a blocking wait nothing can interrupt: restart the kernel to free it). __anext__ "
                          "must await an asyncio.Event, never block the event loop")
    if error is not None:
        if isinstance(error, CheckFailed):
            raise error
        raise CheckFailed(f"the check's clients raised {type(error).__name__}: {error}") from error
    if result is None:
        raise CheckFailed(f"the check did not finish in {TOTAL_S:g} s: the event loop is blocked for good — __anext__ "
                          "waits (time.sleep, a blocking get) for something only the loop itself can deliver")
    stats = llm.engine.stats()
    if stats["num_requests_running"] or stats["num_requests_waiting"]:
        raise CheckFailed(f"after the server shut down, {stats['num_requests_running']} requests still run")
    passed(f"your stream served {clients + 2} clients through the engine thread in {time.perf_counter() - started:.1f} s "
           f"({result['steps']} steps): every answer complete, the event loop at most {1000 * result['lag']:.0f} ms "
           f"late, the client that hung up after {result['left']} token(s) aborted and its blocks freed, and a shutdown "
           "raised in its reader")
