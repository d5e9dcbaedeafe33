"""The frontend's side of an engine core in its own process: ``EngineCoreClient``, vLLM V1's ``AsyncLLM``.

It offers the server what the thread engine (``async_engine.py``) offers — ``submit`` a request and
read its ``RequestStream``, ``abort``, ``num_waiting`` for the 429 rule, ``is_healthy``, ``/metrics``
and ``/pd/timeline`` — so ``api.py`` serves either. What differs is where the work runs:

* the engine core (``engine_core.py``) runs in a spawned child process and sees token ids only;
* this process keeps the text work: it tokenized the prompt before ``submit``, and here it turns each
  step's new token ids into text (one ``IncrementalDetokenizer`` per request, as the engine does
  in-process), finds stop strings (and tells the core to stop that request, with the tokens to keep),
  and builds the cumulative ``RequestOutput`` the streams hold. An ``n > 1`` request is one
  ``AddRequest``; its samples are tracked here as choices of their own from the start, under the ids
  the core reports them by (``sample_request_id``), each with its own detokenizer and stop strings.

Messages are batched both ways: every ``submit`` and ``abort`` of one event-loop tick leaves in one
``CoreInput`` (``_flush`` runs once per tick), and each core step arrives as one ``CoreOutputs``.
The core's output socket is read on the event loop itself (its file descriptor is watched with
``add_reader``: ZeroMQ signals readiness edge-triggered, so each wake-up drains everything), so a
token reaches its stream with no thread hop. If the core process dies, its sentinel wakes the loop at
once: every stream ends with an error, new requests get 503 and ``/health`` says why.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import msgspec
import zmq

from .. import procs
from ..engine.detokenizer import IncrementalDetokenizer, catch_up
from ..engine.limits import EngineLimits
from ..engine.request import RequestMetrics, RequestOutput, sample_request_id
from ..engine.stopping import streamable
from ..frontend import Frontend, PreparedRequest
from .engine_core import CoreSpec, run_engine_core
from .messages import FIRST, AddRequest, Call, CoreInput, CoreOutputs, Failed, FinishRequest
from .host_common import refuse_when_full, waiting_after
from .request_stream import EngineUnavailableError, RequestFailedError, RequestStream

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # loading a large checkpoint from disk can take minutes; the core's death ends the wait


class EngineCoreStartError(RuntimeError):
    """The engine core could not be built; ``bad_option``: a ValueError about the options (the CLI exits 2)."""

    def __init__(self, message: str, bad_option: bool = False):
        super().__init__(message)
        self.bad_option = bad_option


class RemoteEngine:
    """What the ``Frontend`` asks of an engine it cannot reach directly: its tokenizer and its limits."""

    def __init__(self, tokenizer, limits: EngineLimits):
        self.tokenizer, self.limits = tokenizer, limits
        self.max_model_len = limits.max_model_len

    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int | None = None) -> int:
        return self.limits.check_prompt(prompt_token_ids, max_tokens)


@dataclass
class _Track:
    """A request (or one sample of an ``n > 1`` request) in flight, frontend side: its text so far and where
    its outputs go."""

    stream: RequestStream
    index: int
    prepared: PreparedRequest
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0


class EngineCoreClient:
    """Start an engine core process for these engine options and serve it to asyncio consumers.

    Blocks until the engine is built (raises ``EngineCoreStartError`` if it cannot be); then
    ``frontend`` tokenizes and checks prompts with the core's limits. ``start()`` (on the server's
    event loop) begins reading the core's outputs; ``shutdown()`` stops the core.
    """

    def __init__(self, engine_options: dict, served_model_name: str | None = None,
                 max_waiting_requests: int | None = 1024, result_cache=None, metrics: bool = True):
        self.max_waiting_requests = max_waiting_requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dir = tempfile.mkdtemp(prefix="labsupport-core-")
        self._context = zmq.Context()
        self._to_core, self._from_core = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        inp, out = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # no cap: a flood of requests during a long step waits in memory
        self._to_core.bind(inp)
        self._from_core.bind(out)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreOutputs)
        spec = CoreSpec(dict(engine_options), served_model_name, inp, out, os.getpid(), metrics)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(spec,), name="labsupport-engine-core", daemon=True)
        procs.from_long_lived_thread(self.process.start)  # Linux's death signal follows the forking thread
        try:
            ready = self._wait_ready()
        except BaseException:
            self._close_sockets()
            raise
        from ..models.loader import load_tokenizer
        self.model_path = ready.model_path
        self.limits = ready.limits
        self.max_num_seqs, self.device = ready.max_num_seqs, ready.device
        tokenizer = load_tokenizer(ready.model_path)
        model_name = os.path.basename(ready.model_path.rstrip("/"))
        self.frontend = Frontend(RemoteEngine(tokenizer, self.limits), model_name, result_cache)
        self.model_name = served_model_name or model_name
        self._live: dict[str, _Track] = {}  # by request id, each sample's too
        self._pending = CoreInput()
        self._flush_scheduled = False
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._core_waiting = 0
        self._closed = False
        self.dead_reason: str | None = None

    def _wait_ready(self):
        decoder = msgspec.msgpack.Decoder(FIRST)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._from_core.poll(200):
                first = decoder.decode(self._from_core.recv())
                if isinstance(first, Failed):
                    self.process.join(5)
                    raise EngineCoreStartError(first.error, first.bad_option)
                return first
            if not self.process.is_alive():
                raise EngineCoreStartError(f"the engine core exited while starting (exit code {self.process.exitcode})")
        self.process.kill()
        raise EngineCoreStartError(f"the engine core did not start within {START_TIMEOUT_S:.0f} s")

    # ------------------------------------------------------------------ the server's side

    def start(self) -> "EngineCoreClient":
        """Read the core's outputs on the running event loop (idempotent)."""
        if self._loop is None and not self._closed:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._from_core.getsockopt(zmq.FD), self._read)
            self._loop.add_reader(self.process.sentinel, self._core_exited)
            self._read()  # messages may have arrived before the reader: the edge is gone
        return self

    @property
    def is_healthy(self) -> bool:
        return not self._closed and self.process.is_alive()

    def unavailable_reason(self) -> str:
        if self.dead_reason is not None:
            return self.dead_reason
        return "the server is shutting down"

    @property
    def num_waiting(self) -> int:
        """Requests accepted that will wait for a slot (see ``AsyncEngine.num_waiting``): the core's own
        queue, or what is in flight beyond its sequence slots, whichever is more."""
        return self._waiting_with(0)

    def _waiting_with(self, new: int) -> int:
        return waiting_after(len(self._live), new, self.max_num_seqs, reported_waiting=self._core_waiting)

    def submit(self, prepared: list[PreparedRequest], request_ids: list[str]) -> RequestStream:
        """Send engine requests to the core (on the event loop); raises 503/429 errors before anything is sent.
        The stream has a choice per sample: request ``k``'s ``n`` samples are consecutive indices."""
        self.start()
        if self._closed or not self.process.is_alive():
            raise EngineUnavailableError(self.unavailable_reason())
        seqs = sum(p.params.n for p in prepared)  # each sample takes a sequence slot
        refuse_when_full(self.max_waiting_requests, self._waiting_with, seqs)
        choice_ids = [sample_request_id(rid, i) for p, rid in zip(prepared, request_ids) for i in range(p.params.n)]
        stream = RequestStream(self.abort, choice_ids)
        now = time.perf_counter()
        index = 0
        for p, rid in zip(prepared, request_ids):
            for i in range(p.params.n):
                detok = IncrementalDetokenizer(self.frontend.tokenizer, p.prompt_token_ids, p.params.stop,
                                               p.params.min_tokens)
                self._live[choice_ids[index]] = _Track(stream, index, p, detok, RequestMetrics(arrival_time=now),
                                                       logprobs=None if p.params.logprobs is None else [])
                index += 1
            self._pending.adds.append(AddRequest(rid, p.prompt_token_ids, dataclasses.asdict(p.params),
                                                 p.cache_salt, now, p.priority))
        self._schedule_flush()
        return stream

    def abort(self, request_id: str):
        """End a request (from any thread); a no-op once it has finished."""
        loop = self._loop
        if loop is None or self._closed:
            return
        try:
            if asyncio.get_running_loop() is loop:
                return self._end(request_id, "abort")
        except RuntimeError:
            pass
        try:
            loop.call_soon_threadsafe(self._end, request_id, "abort")
        except RuntimeError:  # the loop is closed: the core went with it
            pass

    def _end(self, request_id: str, reason: str, keep_tokens: int | None = None):
        if self._live.pop(request_id, None) is not None:
            self._pending.finishes.append(FinishRequest(request_id, reason, keep_tokens))
            self._schedule_flush()

    async def render_metrics(self) -> tuple[bytes, str] | None:
        from prometheus_client import CONTENT_TYPE_LATEST
        body = await self._call("metrics")
        return None if body is None else (body, CONTENT_TYPE_LATEST)

    async def pd_timeline(self, since: float) -> dict:
        return await self._call("timeline", since=since)

    async def stats(self) -> dict:
        return await self._call("stats")

    def shutdown(self, timeout: float = 10.0, wait: bool = True):
        """Stop accepting, end every stream with an error, and stop the core; ``wait``: join it too.

        ``wait=False`` only starts it and is safe anywhere (a signal handler, another thread): the
        streams are ended on the event loop's own thread. Idempotent."""
        if not self._closed:
            self._closed = True
            loop = self._loop
            if wait or loop is None or loop.is_closed():
                self._stop_now()
            else:
                loop.call_soon_threadsafe(self._stop_now)
        if wait:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
            self._close_sockets()

    def _stop_now(self):
        self._fail_all(EngineUnavailableError(self.unavailable_reason()))
        try:
            self._to_core.send(self._encoder.encode(CoreInput(shutdown=True)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # ------------------------------------------------------------------ talking to the core

    def _schedule_flush(self):
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self):
        self._flush_scheduled = False
        message, self._pending = self._pending, CoreInput()
        if self._closed or not (message.adds or message.finishes or message.calls):
            return
        try:
            self._to_core.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the core stopped reading: it is gone or wedged
            self._lost(f"the engine core does not take messages ({exc}); restart the server")

    async def _call(self, name: str, since: float = 0.0, timeout: float = 30.0):
        if self._closed or not self.process.is_alive():
            raise EngineUnavailableError(self.unavailable_reason())
        self.start()
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._pending.calls.append(Call(call_id, name, since))
        self._schedule_flush()
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    def _read(self):
        """Drain the core's socket (edge-triggered: everything now, or the next message never wakes us)."""
        sock = self._from_core
        while not self._closed:
            try:
                outputs = self._decoder.decode(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            self._core_waiting = outputs.num_waiting
            for delta in outputs.deltas:
                try:
                    self._apply(delta)
                except Exception as exc:  # a bug here fails this request, never the others in the message
                    log.exception("applying the core's output for %s failed", delta.request_id)
                    track = self._live.get(delta.request_id)
                    self._end(delta.request_id, "abort")  # the core frees it
                    if track is not None:
                        track.stream.put(track.index, RequestFailedError(f"internal error: {type(exc).__name__}"))
            for answer in outputs.answers:
                future = self._calls.get(answer.call_id)
                if future is not None and not future.done():
                    if answer.error is not None:
                        future.set_exception(RuntimeError(answer.error))
                    else:
                        future.set_result(msgspec.msgpack.decode(answer.value))

    def _apply(self, delta):
        """One request's step: new tokens -> new text (and a stop string?) -> its stream's latest output."""
        track = self._live.get(delta.request_id)
        if track is None:
            return  # ended here already (aborted, or stopped at a stop string)
        if delta.error is not None:  # the core refused the request: none of its samples will run either
            for i in range(track.prepared.params.n):
                self._live.pop(sample_request_id(delta.request_id, i), None)
            track.stream.put(track.index, RequestFailedError(f"the engine refused request {delta.request_id}: "
                                                             f"{delta.error}"))
            return
        new, m = delta.new_token_ids, track.metrics
        track.token_ids += new
        if delta.new_logprobs and track.logprobs is not None:
            track.logprobs += delta.new_logprobs
        if new:
            m.token_times += [delta.token_time] * len(new)
            m.first_token_time = m.first_token_time or delta.token_time
        if delta.first_scheduled_time is not None:
            m.first_scheduled_time = delta.first_scheduled_time
            track.prompt_logprobs = delta.prompt_logprobs
        track.num_cached_tokens = delta.num_cached_tokens
        finish = delta.finish_reason
        cut = catch_up(track.detok, track.token_ids, len(new), finish is not None, finish)
        if cut is not None:  # a stop string: the text ends at it; the core stops the request too
            del track.token_ids[cut:], m.token_times[cut:]
            if track.logprobs is not None:
                del track.logprobs[cut:]
            if finish is None:
                self._end(delta.request_id, "stop", cut)
            finish = "stop"
        if finish is not None:
            m.finished_time = delta.finished_time or time.perf_counter()
            self._live.pop(delta.request_id, None)
        if finish is not None and finish not in ("stop", "length"):
            why = "a step failed" if finish == "error" else f"finish reason {finish!r}"
            track.stream.put(track.index, RequestFailedError(
                f"the engine could not complete request {delta.request_id}: {why}"))
            return
        p = track.prepared
        text = streamable(track.detok.text, p.params.stop, finish is not None)
        track.stream.put(track.index, RequestOutput(
            delta.request_id, p.prompt, p.prompt_token_ids, text, list(track.token_ids), finish, m,
            logprobs=None if track.logprobs is None else list(track.logprobs),
            prompt_logprobs=track.prompt_logprobs, num_cached_tokens=track.num_cached_tokens,
            kv_transfer_params=delta.kv_transfer_params))

    def _core_exited(self):
        self._lost(f"the engine core process died (exit code {self.process.exitcode}); restart the server")

    def _lost(self, reason: str):
        if self.dead_reason is None:
            self.dead_reason = reason
            log.error(reason)
        self._closed = True
        self._fail_all(EngineUnavailableError(reason))
        self._unwatch()

    def _fail_all(self, error: Exception):
        lives, self._live = list(self._live.values()), {}
        for track in lives:
            track.stream.put(track.index, error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineUnavailableError(str(error)))

    def _unwatch(self):
        if self._loop is not None and not self._loop.is_closed():
            for fd in (self.process.sentinel, self._fd()):
                if fd is not None:
                    try:
                        self._loop.remove_reader(fd)
                    except (ValueError, OSError):
                        pass

    def _fd(self):
        try:
            return self._from_core.getsockopt(zmq.FD)
        except zmq.ZMQError:
            return None

    def _close_sockets(self):
        self._unwatch()
        for sock in (self._to_core, self._from_core):
            sock.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
