"""The engine core: a process that owns the ``LLMEngine`` and steps it, as vLLM V1's ``EngineCore``.

Why a process and not chapter 06's thread (``async_engine.py``): in one process the event loop
(parsing requests, tokenizing, detokenizing, writing SSE for every stream) and the engine's Python
between kernels take turns on one GIL, and with 64 streams the turns add up to whole steps. Here
the core does nothing but schedule, run the model and sample; the frontend process does all the
text work. They exchange one message per turn each way (``messages.py``) over ZeroMQ sockets:

* in: everything the frontend gathered since the last turn (new requests as token ids, requests to
  end, questions such as ``/metrics``), drained between steps;
* out: after each step, every request's new token ids (and logprobs, and how it ended). An ``n > 1``
  request's samples, once forked, are reported and ended each under its own id (``sample_request_id``),
  as the frontend keys its choices.

The loop never waits while it has requests; idle, it sleeps in ``poll`` until the frontend writes.
The core lives only as long as its frontend: it asks the kernel for a signal when its parent dies,
and watches its parent's pid as well, so a killed server (or a restarted notebook kernel) never
leaves an engine holding memory and cores. Ctrl-C reaches the whole process group; the core
ignores it and lets the frontend, which answers the clients, decide how to stop.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from ..engine.request import sample_request_id
from ..procs import die_with_parent
from .host_common import call_hook, step_record, timeline
from .messages import Answer, Call, CoreInput, CoreOutputs, Failed, FinishRequest, Ready, RequestDelta


@dataclass
class CoreSpec:
    """What the frontend hands the spawned core (pickled once, at start)."""

    engine_options: dict  # ``EngineConfig`` keyword arguments
    model_name: str | None  # the served name, for ``/metrics`` labels (None: the model folder's name)
    input_address: str  # the frontend binds both sockets; the core connects
    output_address: str
    parent_pid: int
    metrics: bool = True


def run_engine_core(spec: CoreSpec):
    """The core process's main function (``multiprocessing`` spawns it)."""
    die_with_parent(spec.parent_pid)  # a kernel restart or kill -9 of the server takes the core with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import torch
    if cpus and cpus < torch.get_num_threads():  # pinned by --cpu-affinity: one thread per CPU it may use
        torch.set_num_threads(cpus)
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block a step on a frontend that reads late
    inbox.connect(spec.input_address)
    outbox.connect(spec.output_address)
    encoder = msgspec.msgpack.Encoder()
    options = dict(spec.engine_options)
    events_config = options.pop("kv_events_config", None)  # the core's, not the engine's: it publishes per step
    kv_events = None
    try:
        from ..engine.config import EngineConfig
        from ..engine.engine import LLMEngine
        engine = LLMEngine(EngineConfig(**options, detokenize=False))
        if events_config is not None:
            from .kv_events import KVEvents
            try:
                kv_events = KVEvents(events_config, engine)
            except Exception:
                engine.shutdown()
                raise
    except Exception as exc:  # a bad option (ValueError) or a model that will not load
        outbox.send(encoder.encode(Failed(f"{exc}" if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}",
                                          bad_option=isinstance(exc, ValueError))))
        outbox.close(linger=2000)
        return
    metrics = None
    if spec.metrics:
        from .metrics import ServerMetrics
        metrics = ServerMetrics(spec.model_name or engine.model_path.name, max_model_len=engine.max_model_len)
    outbox.send(encoder.encode(Ready(str(engine.model_path), engine.limits,
                                     engine.config.max_num_seqs, str(engine.device))))
    try:
        EngineCore(engine, inbox, outbox, metrics, kv_events).run()
    finally:
        engine.shutdown()
        if kv_events is not None:
            kv_events.close()  # its ports go with the core
        inbox.close(linger=0)
        outbox.close(linger=1000)
        context.term()


@dataclass
class _Track:
    """A request the core runs for the frontend: how much of it was sent."""

    req: object
    tokens: int = 0
    logprobs: int = 0
    started: bool = False  # its first delta (first scheduled time, prompt logprobs) went out
    forked: bool = False  # n > 1: its samples have forked and have tracks of their own


class EngineCore:
    """The loop: drain the inbox, step, send what moved; sleep in ``poll`` when there is nothing to do."""

    def __init__(self, engine, inbox, outbox, metrics=None, kv_events=None):
        self.engine, self.inbox, self.outbox, self.metrics = engine, inbox, outbox, metrics
        self.kv_events = kv_events  # KV-cache events for routers (kv_events.py): one batch per step
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreInput)
        self.live: dict[str, _Track] = {}  # by request id, a forked sample's too
        self.answers: list[Answer] = []
        self.stopping = False
        self.step_log: deque = deque(maxlen=4096)  # recent steps in wall-clock time (chapter 07's timeline)
        self._wall = time.time() - time.perf_counter()
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)

    def run(self):
        from ..engine.request import SamplingParams  # noqa: F401  (imported once, before the first request)
        call_hook(self.metrics, "on_step", self.engine, [], None)  # the gauges from the start: an idle pool is all free
        while not self.stopping:
            busy = bool(self.live)
            if busy:
                timeout = 0
            elif self.engine.has_pending_transfers():
                timeout = 50  # held blocks wait for a pull or their lease: poll the connector now and then
            else:
                timeout = None
            if self.poller.poll(timeout):
                self._drain()
            if self.stopping:
                break
            if self.live or self.engine.has_pending_transfers():
                self._step()
            if self.kv_events is not None:
                self.kv_events.flush()  # what the step (or an abort) stored and removed; sent off this thread
            if self.answers:
                self._send(CoreOutputs(answers=self._take_answers()))

    # ------------------------------------------------------------------ in

    def _drain(self):
        while True:
            try:
                message = self.decoder.decode(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            for add in message.adds:
                self._add(add)
            for finish in message.finishes:
                self._finish(finish)
            for call in message.calls:
                self.answers.append(self._answer(call))
            self.stopping = self.stopping or message.shutdown

    def _add(self, add):
        from ..engine.request import SamplingParams
        try:
            req = self.engine.add_request(add.prompt_token_ids, SamplingParams(**add.params),
                                          request_id=add.request_id, cache_salt=add.cache_salt, priority=add.priority)
        except Exception as exc:  # the frontend checked first, so rare: say why, never die of it
            self._send(CoreOutputs(deltas=[RequestDelta(add.request_id, finish_reason="error",
                                                        error=f"{type(exc).__name__}: {exc}")]))
            return
        # the frontend process saw it arrive: its latencies count from there (set before its first step)
        req.metrics.arrival_time = add.arrival_time or req.metrics.arrival_time
        self.live[add.request_id] = _Track(req)

    def _finish(self, finish: FinishRequest):
        track = self.live.pop(finish.request_id, None)
        if track is None:
            return  # finished already: its last delta is on its way
        req = track.req
        if finish.keep_tokens is not None:  # the frontend found a stop string: the tokens past it never were
            self.engine.scheduler.lifecycle.drop_tokens_after(req, finish.keep_tokens)
        stopped = finish.reason == "stop"  # one sample's stop string ends that sample; an abort ends them all
        self.engine.abort_requests([req], finish.reason, with_samples=not stopped)
        call_hook(self.metrics, "on_finished", req)
        for sample in [] if stopped else req.samples:
            if self.live.pop(sample.request_id, None) is not None:
                call_hook(self.metrics, "on_finished", sample)

    def _answer(self, call: Call) -> Answer:
        try:
            if call.name == "metrics":
                value = None if self.metrics is None else self.metrics.render()[0]
            elif call.name == "timeline":
                value = timeline(self.engine.connector, list(self.step_log), call.since)
            else:  # "stats": the name's three values are checked when the message is decoded
                value = self.engine.stats()
            return Answer(call.call_id, msgspec.Raw(self.encoder.encode(value)))
        except Exception as exc:
            return Answer(call.call_id, error=f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ step and out

    def _step(self):
        engine = self.engine
        before = engine.num_steps
        try:
            got = engine.step()
        except Exception:  # the engine failed this step's requests ("error") and logged why; go on
            got = []
        ran = engine.num_steps > before
        if ran:
            self.step_log.append(step_record(engine.last_step, self._wall))
            call_hook(self.metrics, "on_step", engine, got, engine.last_step)
        else:
            call_hook(self.metrics, "on_step", engine, [], None)
        deltas = []
        for rid, track in list(self.live.items()):
            req = track.req
            if req.samples and not track.forked:  # n > 1 forked this step: each sample is reported on its own
                track.forked = True
                self.live.update((s.request_id, _Track(s, forked=True)) for s in req.samples)
            if len(req.output_token_ids) > track.tokens or req.is_finished:
                deltas.append(self._delta(track))
                if req.is_finished:
                    del self.live[rid]
                    call_hook(self.metrics, "on_finished", req)
                    if not track.forked:  # ended before it forked (aborted, failed): so did its samples
                        deltas += [RequestDelta(sample_request_id(rid, i), finish_reason=req.finish_reason,
                                                finished_time=req.metrics.finished_time)
                                   for i in range(1, req.params.n)]
        if ran or deltas:
            queues = engine.scheduler.queues
            waiting = len(queues.waiting) + sum(not r.is_finished for r in queues.loading.values())
            self._send(CoreOutputs(deltas, self._take_answers(), len(queues.running), waiting))
        elif self.live:
            self.poller.poll(10)  # nothing could be scheduled now (KV on its way): do not spin

    def _delta(self, track: _Track) -> RequestDelta:
        req = track.req
        delta = RequestDelta(req.request_id, req.output_token_ids[track.tokens:],
                             num_cached_tokens=req.metrics.num_cached_tokens)
        if req.params.logprobs is not None:
            delta.new_logprobs = req.logprobs.output[track.logprobs:]
            track.logprobs = len(req.logprobs.output)
        if len(req.output_token_ids) > track.tokens:
            delta.token_time = req.metrics.token_times[-1]
        track.tokens = len(req.output_token_ids)
        if not track.started and (track.tokens or req.is_finished):
            track.started = True
            delta.first_scheduled_time = req.metrics.first_scheduled_time
            delta.prompt_logprobs = req.logprobs.prompt
        if req.is_finished:
            delta.finish_reason, delta.finished_time = req.finish_reason, req.metrics.finished_time
            delta.kv_transfer_params = req.remote_kv.transfer_params
        return delta

    def _take_answers(self) -> list[Answer]:
        answers, self.answers = self.answers, []
        return answers

    def _send(self, outputs: CoreOutputs):
        self.outbox.send(self.encoder.encode(outputs))

