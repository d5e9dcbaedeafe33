"""The chapter 06 check (``check_goodput``) passes the notebook's reference and fails planted wrong ones."""
import time

import pytest

from labsupport import checks
from labsupport.bench.serving.serve_bench import benchmark
from labsupport.bench.serving.serve_datasets import sample_requests
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer

from notebook_tools import chapter, exercise_solutions

MEASURED = {"ttft": lambda r: r.ttft, "tpot": lambda r: r.tpot, "e2el": lambda r: r.latency}


@pytest.fixture(scope="module")
def reference_goodput():
    return exercise_solutions(chapter("06"))["goodput"]


@pytest.fixture(scope="module")
def real_runs(llm):
    """Two small real runs through the server and the load generator, as the notebook makes them."""
    requests = sample_requests(llm.tokenizer, "random", 6, input_len=16, output_len=6, seed=0)
    with BackgroundServer(create_app(llm, "smol")) as server:
        runs = [benchmark(server.url, "smol", requests, rate=rate, progress=False) for rate in (8.0, float("inf"))]
    assert all(run.summary["completed"] == 6 for run in runs)
    return runs


def test_reference_goodput_passes_on_hand_made_and_real_results(reference_goodput, real_runs, capsys):
    checks.check_goodput(reference_goodput, real_runs)
    assert "and on 2 real runs" in capsys.readouterr().out


def test_real_slos_split_the_real_results(real_runs):
    from labsupport.checks.serving import real_slos
    slos = real_slos(real_runs[0].requests)
    assert {k for slo in slos for k in slo} == {"ttft", "tpot", "e2el"}
    for slo in slos[:3]:  # each single limit lies between measured values: some requests pass, some fail
        (key, limit), = slo.items()
        values = [1000 * MEASURED[key](r) for r in real_runs[0].requests]
        assert min(values) < limit < max(values) and limit not in values


def test_failed_requests_in_real_results_are_compared_too(reference_goodput, real_runs):
    import copy
    run = copy.deepcopy(real_runs[1])
    run.requests[0].success, run.requests[0].error = False, "HTTP 500: planted"
    checks.check_goodput(reference_goodput, [run])
    with pytest.raises(checks.CheckFailed, match="failed request never counts"):
        checks.check_goodput(counts_failed_requests, [run])


# ---- planted wrong implementations: each must fail, with a message naming the case

def _good(r, slo, test=lambda value, limit: value * 1000 <= limit):
    return all(test(MEASURED[k](r), limit) for k, limit in slo.items())


def _known(slo):
    if set(slo) - set(MEASURED):
        raise ValueError(f"unknown SLO metrics {sorted(set(slo) - set(MEASURED))}")


def counts_failed_requests(results, slo, duration_s):
    _known(slo)
    return sum(_good(r, slo) for r in results) / duration_s if duration_s > 0 else 0.0


def any_slo_is_enough(results, slo, duration_s):
    _known(slo)
    good = [r for r in results if r.success and (not slo or any(MEASURED[k](r) * 1000 <= v for k, v in slo.items()))]
    return len(good) / duration_s if duration_s > 0 else 0.0


def compares_seconds_with_milliseconds(results, slo, duration_s):
    _known(slo)
    good = [r for r in results if r.success and _good(r, slo, lambda value, limit: value <= limit)]
    return len(good) / duration_s if duration_s > 0 else 0.0


def divides_by_zero_on_one_token(results, slo, duration_s):
    _known(slo)
    tpot = {"tpot": lambda r: (r.latency - r.ttft) / (r.output_tokens - 1)}
    good = [r for r in results if r.success
            and all({**MEASURED, **tpot}[k](r) * 1000 <= v for k, v in slo.items())]
    return len(good) / duration_s if duration_s > 0 else 0.0


def needs_every_slo_key(results, slo, duration_s):
    _known(slo)
    good = [r for r in results if r.success and all(MEASURED[k](r) * 1000 <= slo[k] for k in MEASURED)]
    return len(good) / duration_s if duration_s > 0 else 0.0


def missing_key_means_zero(results, slo, duration_s):
    _known(slo)
    good = [r for r in results if r.success and all(MEASURED[k](r) * 1000 <= slo.get(k, 0) for k in MEASURED)]
    return len(good) / duration_s if duration_s > 0 else 0.0


def strict_less_than(results, slo, duration_s):
    _known(slo)
    good = [r for r in results if r.success and _good(r, slo, lambda value, limit: value * 1000 < limit)]
    return len(good) / duration_s if duration_s > 0 else 0.0


def returns_a_count(results, slo, duration_s):
    _known(slo)
    return float(len([r for r in results if r.success and _good(r, slo)]))


def returns_a_fraction(results, slo, duration_s):
    _known(slo)
    good = [r for r in results if r.success and _good(r, slo)]
    return len(good) / len(results) if results else 0.0


def zero_duration_raises(results, slo, duration_s):
    _known(slo)
    return len([r for r in results if r.success and _good(r, slo)]) / duration_s


def ignores_unknown_keys(results, slo, duration_s):
    slo = {k: v for k, v in slo.items() if k in MEASURED}
    good = [r for r in results if r.success and _good(r, slo)]
    return len(good) / duration_s if duration_s > 0 else 0.0


def uses_total_latency_for_ttft(results, slo, duration_s):
    _known(slo)
    wrong = {**MEASURED, "ttft": lambda r: r.latency}
    good = [r for r in results if r.success and all(wrong[k](r) * 1000 <= v for k, v in slo.items())]
    return len(good) / duration_s if duration_s > 0 else 0.0


@pytest.mark.parametrize("wrong, message", [
    (counts_failed_requests, "failed request never counts.*check r.success"),
    (any_slo_is_enough, "every SLO given.*met any one SLO: it must meet all"),
    (compares_seconds_with_milliseconds, "milliseconds.*compared seconds with milliseconds"),
    (divides_by_zero_on_one_token, "ZeroDivisionError"),
    (needs_every_slo_key, "KeyError: 'e2el': a key absent from slo is no constraint"),
    (missing_key_means_zero, "got 0.0"),
    (strict_less_than, "exactly at the limit"),
    (returns_a_count, "returned a count"),
    (returns_a_fraction, "returned a fraction"),
    (zero_duration_raises, "ZeroDivisionError"),
    (ignores_unknown_keys, "must raise ValueError"),
    (uses_total_latency_for_ttft, "got"),
])
def test_planted_wrong_goodput_fails(wrong, message):
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_goodput(wrong)


def test_a_wrong_goodput_fails_on_real_results_alone(real_runs):
    """The real runs are compared too: a function right on every hand-made case (which have no
    inter-token gaps) but wrong on streamed results (it adds the gaps to TTFT) fails there."""
    def adds_the_gaps_to_ttft(results, slo, duration_s):
        _known(slo)
        wrong = {**MEASURED, "ttft": lambda r: r.ttft + sum(r.itl)}
        good = [r for r in results if r.success and all(wrong[k](r) * 1000 <= v for k, v in slo.items())]
        return len(good) / duration_s if duration_s > 0 else 0.0

    checks.check_goodput(adds_the_gaps_to_ttft)  # hand-made cases only: passes
    with pytest.raises(checks.CheckFailed, match="real run"):
        checks.check_goodput(adds_the_gaps_to_ttft, real_runs)


# ---- the hard exercise: RequestStream and deliver, plugged into a real AsyncEngine

@pytest.fixture(scope="module")
def reference_streams():
    solutions = exercise_solutions(chapter("06"))
    return solutions["RequestStream"], solutions["deliver"]


def test_reference_request_stream_passes_and_the_engine_keeps_its_own(reference_streams, llm, capsys):
    from labsupport.serve.async_engine import AsyncEngine, _deliver
    from labsupport.serve.request_stream import RequestStream
    checks.check_request_streams(*reference_streams, llm)
    assert "aborted and its blocks freed" in capsys.readouterr().out
    engine = AsyncEngine(llm)
    assert engine.stream_class is RequestStream and engine.deliver is _deliver   # the check's plug was its own
    stats = llm.engine.stats()
    assert stats["num_requests_running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_plugged_async_engine_restores_its_own_pieces_after_an_exception(llm, reference_streams):
    from labsupport.serve.async_engine import AsyncEngine, _deliver
    from labsupport.serve.request_stream import RequestStream
    engine = AsyncEngine(llm)
    with pytest.raises(RuntimeError, match="planted"):
        with engine.plugged(stream_class=reference_streams[0], deliver=reference_streams[1]):
            assert engine.stream_class is reference_streams[0]
            raise RuntimeError("planted")
    assert engine.stream_class is RequestStream and engine.deliver is _deliver


def direct_put(loop, items):
    """Calls put from the engine thread: sets an asyncio.Event from the wrong thread, nothing wakes the loop."""
    for stream, index, item in items:
        stream.put(index, item)


def reads_a_blocking_queue(stream_class, close_on_error: bool = False):
    """``stream_class`` with its outputs in a thread-safe ``queue.Queue`` read with a blocking ``get``: a reader
    that holds the event loop while it waits. Fed from the engine thread (``direct_put``) it stalls the loop until
    the next step's output; fed by deliver's callback, which needs that loop, nothing ever arrives (until the
    check puts the shutdown's error into it directly). ``close_on_error``: close the stream before raising."""
    import queue

    class ReadsABlockingQueue(stream_class):
        def __init__(self, abort, request_ids):
            super().__init__(abort, request_ids)
            self._queue = queue.Queue()

        def put(self, index, item):
            self._queue.put((index, item))

        async def __anext__(self):
            if not self.unfinished:
                raise StopAsyncIteration
            index, item = self._queue.get()            # the mistake under test: a blocking wait on the loop
            if isinstance(item, BaseException):
                if close_on_error:
                    self.close()
                raise item
            if item.finished:
                self.unfinished.discard(index)
            return {index: item}
    return ReadsABlockingQueue


def planted_streams(reference, mistake):
    """The reference stream and deliver with one mistake; returns (stream_class, deliver)."""
    stream_class, deliver = reference

    class LosesTheAbort(stream_class):
        def close(self):
            self.unfinished = set()                    # forgets to tell the engine

    class NeverEnds(stream_class):
        async def __anext__(self):
            await self._ready.wait()
            self._ready.clear()
            items, self._latest = self._latest, {}
            for item in items.values():
                if isinstance(item, BaseException):
                    raise item
            return items                               # never discards a finished choice, never stops

    class SwallowsErrors(stream_class):
        def put(self, index, item):
            if not isinstance(item, BaseException):    # drops the shutdown's error: the reader waits forever
                super().put(index, item)

    return {"blocks the loop": (reads_a_blocking_queue(stream_class, close_on_error=True), direct_put),
            "loses the abort": (LosesTheAbort, deliver),
            "misses the wake-up": (stream_class, direct_put), "never ends": (NeverEnds, deliver),
            "swallows errors": (SwallowsErrors, deliver)}[mistake]


@pytest.mark.parametrize("mistake, message", [
    ("blocks the loop", "late .* times.*blocks the loop"),
    ("loses the abort", "lost abort"),
    ("misses the wake-up", "missed wake-up"),
    ("never ends", "did not end"),
    ("swallows errors", "neither raised nor ended"),
])
def test_planted_wrong_request_stream_fails_and_cleans_up(reference_streams, llm, mistake, message):
    import time
    started = time.perf_counter()
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_request_streams(*planted_streams(reference_streams, mistake), llm)
    assert time.perf_counter() - started < 40                     # bounded: no hang on a planted mistake
    stats = llm.engine.stats()                                    # and the check's server is gone, its requests too
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def _polls_with_sleep(stream_class):
    class PollsWithSleep(stream_class):
        """Waits for an output by polling with time.sleep: the event loop never runs deliver's callback, so it
        waits forever (until the check raises into its thread)."""

        async def __anext__(self):
            if not self.unfinished:
                raise StopAsyncIteration
            while not self._latest:
                time.sleep(0.01)  # the mistake under test: a poll that blocks the event loop
            return await super().__anext__()
    return PollsWithSleep


@pytest.mark.parametrize("planted", [_polls_with_sleep, reads_a_blocking_queue])
def test_a_reader_stuck_in_anext_is_freed_and_leaves_no_thread(reference_streams, llm, monkeypatch, planted):
    import threading
    from labsupport.checks import serving
    monkeypatch.setattr(serving, "TOTAL_S", 6.0)  # the whole check's bound, shortened: the scene is the first
    with pytest.raises(checks.CheckFailed, match="did not finish"):
        checks.check_request_streams(planted(reference_streams[0]), reference_streams[1], llm)
    assert not [t for t in threading.enumerate() if t.name == "stream-check"]  # its thread ended, not left behind
    stats = llm.engine.stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
