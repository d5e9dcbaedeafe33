"""AsyncEngine: many HTTP clients, one engine loop, continuous batching between them.

Why a thread and not an asyncio task: ``engine.step()`` is a blocking torch call of 10-100 ms.
Run on the event loop, it would freeze everything else the loop does (parsing requests, writing
SSE chunks, noticing disconnects) for the whole step, every step. In its own thread it does
not: torch releases the GIL inside its operators, so the event loop keeps serving while the
forward pass runs, and requests that arrive meanwhile join the next step.

The thread owns the engine exclusively; nothing else calls into it while the server runs
(``llm.generate`` on the same LLM at the same time would race it). The event loop talks to it
through an inbox of typed messages (``AddRequest``, ``AbortRequest``) that the thread drains at
the top of each iteration, and it sleeps on a ``threading.Event`` when it has nothing to do.
Outputs go back to one ``RequestStream`` per HTTP request as ``Delivery`` items, one per choice
(an ``n > 1`` request's samples are choices of their own, keyed by ``sample_request_id``), all of a step's
in one ``loop.call_soon_threadsafe`` (the only safe way to wake an event loop from another
thread; one wake-up per step, not one per stream). Every output is cumulative (all the text and tokens so far), so a stream keeps only the
latest of each request and a consumer that falls behind skips the rest.

This is chapter 06's first design, and ``--engine-in-process`` keeps it. Its cost is the GIL: the
event loop's JSON and SSE work and the engine's Python between kernels take turns on one lock.
``core_client.py`` moves the engine into a process of its own, as vLLM V1 does.

Failure has three sizes. A step that raises fails only its own requests (``LLMEngine`` does
that); their clients get an error, the others go on. If the loop thread itself dies, every
pending request gets an error and ``is_healthy`` turns False (``/health`` answers 503). And
``shutdown()`` stops accepting, aborts what is in flight with an error, and joins the thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, NamedTuple

from ..engine.plug_points import PlugPoint, PlugRegistry
from ..engine.request import Request, RequestOutput, sample_request_id
from ..frontend import PreparedRequest
from .host_common import call_hook, refuse_when_full, step_record, timeline, waiting_after
from .request_stream import EngineUnavailableError, QueueFullError, RequestFailedError, RequestStream

__all__ = ["AbortRequest", "AddRequest", "AsyncEngine", "Delivery", "EngineUnavailableError", "QueueFullError",
           "RequestFailedError", "RequestStream"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequest:
    """Event loop -> loop thread: run ``prepared`` as ``request_id``; its outputs go to ``stream`` on the event
    loop ``loop``, at ``index`` (one stream may carry several requests), its samples 1 .. n-1 after it."""

    prepared: PreparedRequest
    request_id: str
    loop: asyncio.AbstractEventLoop
    stream: RequestStream
    index: int


@dataclass(frozen=True)
class AbortRequest:
    """Any thread -> loop thread: stop ``request_id`` (a request, or one sample of one) and free its memory
    (a client went away)."""

    request_id: str


class Delivery(NamedTuple):
    """Loop thread -> a consumer's event loop: one output (or the error that ends the request) for ``stream``.
    A named tuple, so chapter 06's ``deliver(loop, items)`` may still unpack ``stream, index, item``."""

    stream: RequestStream
    index: int
    item: RequestOutput | Exception


@dataclass
class _Live:
    """A request the loop thread runs for a consumer: where its outputs go."""

    req: Request
    loop: asyncio.AbstractEventLoop
    stream: RequestStream
    index: int
    forked: bool = False  # n > 1: its samples have forked and been given entries of their own


class AsyncEngine:
    """Serve an ``LLM`` to many concurrent asyncio consumers from one engine-loop thread.

    ``metrics``: an object with ``on_step(engine, got_token_requests, scheduler_output)`` (after each
    step that ran) and ``on_finished(request)`` (each request that leaves: finished, aborted or
    failed), called from the loop thread; ``serve.metrics.ServerMetrics`` is one.
    """

    PLUG_POINTS = {  # chapter 06's exercise: how outputs reach a client
        "stream_class": PlugPoint("stream_class", "stream_class(abort, request_ids): what a request's consumer reads"),
        "deliver": PlugPoint("deliver", "deliver(loop, [Delivery(stream, index, item), ...]): the hand-over from "
                             "the loop thread"),
    }

    def __init__(self, llm, max_waiting_requests: int | None = 1024, metrics=None):
        self.llm, self.engine, self.frontend = llm, llm.engine, llm.frontend
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._lock = threading.RLock()  # guards the inbox and _closed; reentrant: RequestStream.__del__
        self._inbox: deque[AddRequest | AbortRequest] = deque()
        self._queued = 0  # sequences added to the inbox: waiting, but not yet in the scheduler's queue
        self._closed = False  # no more requests: shut down, or the loop died
        self._stopping = False
        self._wake = threading.Event()
        self._live: dict[str, _Live] = {}  # loop thread only; by request id, a forked sample's too
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        if self.engine.connector is not None:
            self.engine.connector.transfer_listeners.append(self._wake.set)  # a finished KV transfer wakes the loop
        self.dead_reason: BaseException | None = None
        self.num_steps = 0  # steps this loop ran
        self.step_log: deque = deque(maxlen=4096)  # recent steps in wall-clock time, for timelines (step_record)
        self._wall = time.time() - time.perf_counter()  # perf_counter -> time.time(): one clock across processes
        self.peak_batch_size = 0  # the most requests one step ran: > 1 means clients shared steps
        # how outputs reach a client: its stream, and the hand-over from this thread (chapter 06 plugs its own)
        self.stream_class, self.deliver = RequestStream, _deliver
        self.plug_points = PlugRegistry(self, describe="the serving loop")

    # ------------------------------------------------------------------ the event loop's side

    def start(self) -> "AsyncEngine":
        with self._lock:
            if not self._thread.is_alive() and not self._closed and self._thread.ident is None:
                self._thread.start()
        return self

    def plugged(self, stream_class=None, deliver=None):
        """``with engine.plugged(stream_class=MyStream, deliver=my_deliver): ...`` serves new requests through
        chapter 06's pieces (``PLUG_POINTS``; None keeps the engine's own). The engine's own pieces come back on
        exit, also after an exception."""
        pieces = {"stream_class": stream_class, "deliver": deliver}
        return self.plug_points.plugged({name: piece for name, piece in pieces.items() if piece is not None})

    @property
    def is_healthy(self) -> bool:
        return not self._closed and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests accepted that will wait for a slot: those in the inbox or the scheduler's queue beyond
        the sequence slots free now (a burst that fits the free slots waits for nobody, so it is not
        counted against ``max_waiting_requests``: it would have been refused while slots were free)."""
        return self._waiting_with(0)

    def _waiting_with(self, new: int) -> int:
        scheduler, slots = self.engine.scheduler, self.engine.config.max_num_seqs
        # running past a max_num_seqs lowered on a live engine keep the slots they hold: none of them waits
        in_flight = self._queued + len(scheduler.waiting) + min(len(scheduler.running), slots)
        return waiting_after(in_flight, new, slots)

    async def render_metrics(self) -> tuple[bytes, str] | None:
        """``GET /metrics``: (body, content type), or None without metrics."""
        return None if self.metrics is None else self.metrics.render()

    async def pd_timeline(self, since: float) -> dict:
        """This worker's recent steps and KV transfers, wall-clock seconds after ``since`` (chapter 07)."""
        connector = self.engine.connector
        return timeline(connector, list(self.step_log), since)

    def submit(self, prepared: list[PreparedRequest], request_ids: list[str]) -> RequestStream:
        """Queue engine requests now (called on the event loop); raises before anything is queued if the
        engine is unavailable or the waiting queue is full, so the server can still answer 503/429. The
        stream has a choice per sample: request ``k``'s ``n`` samples are consecutive indices."""
        self.start()
        loop = asyncio.get_running_loop()
        choice_ids = [sample_request_id(rid, i) for p, rid in zip(prepared, request_ids) for i in range(p.params.n)]
        stream = self.stream_class(self.abort, choice_ids)
        seqs = sum(p.params.n for p in prepared)  # each sample takes a sequence slot
        with self._lock:
            if self._closed:
                raise EngineUnavailableError(self.unavailable_reason())
            refuse_when_full(self.max_waiting_requests, self._waiting_with, seqs)
            index = 0
            for p, rid in zip(prepared, request_ids):
                self._inbox.append(AddRequest(p, rid, loop, stream, index))
                index += p.params.n
            self._queued += seqs
        self._wake.set()
        return stream

    async def generate(self, prepared: PreparedRequest, request_id: str) -> AsyncIterator[RequestOutput]:
        """One request's outputs, cumulative, the last one finished. Closing the iterator early aborts it."""
        stream = self.submit([prepared], [request_id])
        try:
            async for batch in stream:
                yield batch[0]
        finally:
            stream.close()

    def abort(self, request_id: str):
        """Abort a request from any thread; a no-op once it has finished (or the loop has ended)."""
        with self._lock:
            if self._closed:
                return  # the loop aborts everything it still holds on its way out
            self._inbox.append(AbortRequest(request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0, wait: bool = True):
        """Stop accepting requests, abort those in flight with an error, and (``wait``) join the thread.

        ``wait=False`` only starts it: safe in a signal handler on the event loop. Idempotent. The
        LLM itself stays usable (``llm.generate`` works again once the thread is gone)."""
        with self._lock:
            self._closed = self._stopping = True
        self._wake.set()
        if wait and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def unavailable_reason(self) -> str:
        if self.dead_reason is not None:
            return f"the engine loop died ({type(self.dead_reason).__name__}: {self.dead_reason}); restart the server"
        return "the server is shutting down"

    # ------------------------------------------------------------------ the loop thread's side

    def _run(self):
        # the gauges from the start: an idle pool is all free, not 0
        call_hook(self.metrics, "on_step", self.engine, [], None)
        try:
            while True:
                self._wake.clear()  # cleared before draining: a request added after the drain wakes us
                self._drain_inbox()
                if self._stopping:
                    break
                if self._live:
                    self._step()
                elif self.engine.has_pending_transfers():  # held blocks wait for a pull or their lease
                    self._step()
                    self._wake.wait(0.05)
                else:
                    self._wake.wait()
        except BaseException as exc:  # a bug here, or an exit inside a step: nothing can be served
            self.dead_reason = exc
            log.exception("the engine loop died")
        finally:
            if self.engine.connector is not None:  # a later loop on this engine adds its own
                self.engine.connector.transfer_listeners.remove(self._wake.set)
            self._fail_everything(EngineUnavailableError(self.unavailable_reason()))

    def _drain_inbox(self):
        with self._lock:
            items, self._inbox = self._inbox, deque()
            self._queued -= sum(item.prepared.params.n for item in items if isinstance(item, AddRequest))
        for item in items:
            if isinstance(item, AddRequest):
                try:
                    req = self.frontend.submit(item.prepared, item.request_id)
                except Exception as exc:  # checked before, so rare: the engine was shut down under us
                    error = RequestFailedError(f"{type(exc).__name__}: {exc}")
                    self.deliver(item.loop, [Delivery(item.stream, item.index, error)])
                    continue
                self._live[item.request_id] = _Live(req, item.loop, item.stream, item.index)
            else:
                live = self._live.pop(item.request_id, None)
                if live is not None:
                    self.engine.abort(live.req)  # an n > 1 request's samples go with it
                    for req in [live.req, *live.req.samples]:
                        if req is live.req or self._live.pop(req.request_id, None) is not None:
                            self._finished(req)

    def _step(self):
        steps_before = self.engine.num_steps
        try:
            got = self.engine.step()
        except Exception:  # the engine failed this step's requests ("error") and logged why; go on
            got = []
        ran = self.engine.num_steps > steps_before
        if ran:
            self.num_steps += 1
            self.peak_batch_size = max(self.peak_batch_size, len(self.engine.last_step.requests))
            self.step_log.append(self.step_record(self.engine.last_step))
            call_hook(self.metrics, "on_step", self.engine, got, self.engine.last_step)
        else:
            # nothing ran, but blocks may have come back (aborts, PD)
            call_hook(self.metrics, "on_step", self.engine, [], None)
        self._add_forked_samples()
        moved = {r.request_id for r in got}
        outputs: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}  # one hand-over per event loop and step
        for rid, live in list(self._live.items()):
            if live.req.is_finished:
                del self._live[rid]
                self._finished(live.req)
                item = self._final(live.req)
            elif rid in moved:
                item = dataclasses.replace(self.engine.output(live.req, with_samples=False),
                                           text=live.req.streamable_text())
            else:
                continue
            # an n > 1 request that ended before it forked (aborted, failed) ends its samples' choices too
            choices = 1 if live.forked else live.req.params.n
            outputs.setdefault(live.loop, []).extend(Delivery(live.stream, live.index + i, item)
                                                     for i in range(choices))
        for loop, items in outputs.items():
            self.deliver(loop, items)
        if not ran and self._live:
            self._wake.wait(0.01)  # nothing could be scheduled now: do not spin

    def _add_forked_samples(self):
        """An ``n > 1`` request forks once its prompt is computed: each sample is a choice of its own from then
        on (outputs, finish, abort), at the indices after the request's."""
        for live in list(self._live.values()):
            if live.req.samples and not live.forked:
                live.forked = True
                for i, sample in enumerate(live.req.samples, 1):
                    self._live[sample.request_id] = _Live(sample, live.loop, live.stream, live.index + i, forked=True)

    def step_record(self, out) -> dict:
        return step_record(out, self._wall)

    def _final(self, req: Request):
        if req.finish_reason in ("stop", "length"):
            return self.engine.output(req, with_samples=False)
        why = "a step failed" if req.finish_reason == "error" else f"finish reason {req.finish_reason!r}"
        return RequestFailedError(f"the engine could not complete request {req.request_id}: {why}")

    def _finished(self, req: Request):
        call_hook(self.metrics, "on_finished", req)

    def _fail_everything(self, error: Exception):
        """The loop is ending: refuse new requests, abort every one in flight, tell every consumer."""
        with self._lock:
            self._closed = True
            items, self._inbox = self._inbox, deque()
            self._queued = 0
        for item in items:
            if isinstance(item, AddRequest):
                self.deliver(item.loop, [Delivery(item.stream, item.index, error)])
        lives, self._live = list(self._live.values()), {}
        try:
            self.engine.abort_requests([live.req for live in lives])
        except Exception:
            log.exception("aborting the requests in flight failed")
        for live in lives:
            self._finished(live.req)
            self.deliver(live.loop, [Delivery(live.stream, live.index, error)])


def _put_all(items: list[Delivery]):
    for d in items:
        d.stream.put(d.index, d.item)


def _deliver(loop: asyncio.AbstractEventLoop, items: list[Delivery]):
    """Hand outputs (or errors) to their consumers' event loop, from the engine thread."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass
