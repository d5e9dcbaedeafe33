"""``python -m labsupport router``: one OpenAI endpoint in front of several workers.

* **PD mode** (``--prefill URL[,URL] --decode URL[,URL]``): prefill/decode disaggregation with
  vLLM's proxy protocol and field names, so the same router drives our servers here and vLLM's
  in chapter 08. Each request runs twice. A prefill worker (round robin) gets a copy capped at
  one token with ``kv_transfer_params: {"do_remote_decode": true, ...}``: it computes the
  prompt's KV, keeps the blocks and answers where to fetch them (``remote_host``,
  ``remote_port``, ``remote_block_ids``, ...). A decode worker (least loaded) gets the original
  request with those params, pulls the KV instead of recomputing it, and generates; its answer
  (JSON, or the SSE stream byte for byte) goes back to the client. A prefill answer without
  ``kv_transfer_params`` is a 502, unless ``--kv-params optional``: connectors that find the KV by
  the prompt itself (vLLM's ExampleConnector, through shared storage) answer ``null`` there, and
  the decode request then goes out without them, as vLLM's own toy proxy does.
* **Instance mode** (``--instances URL,URL --policy ...``): load balancing over colocated
  servers (``routing.py`` says why each policy exists).

Workers fail. A background task probes every worker's ``/health``; one that fails a probe or a
request is skipped until ``/health`` answers 200 again (a restarted worker comes back by
itself), and while no worker of a role is up, new requests get 503 at once. A request whose
worker dies under it gets OpenAI's 503 JSON or, once its stream has started, an SSE ``error``
event and ``[DONE]``: the client learns at once instead of waiting on a stream that will never
end. A worker that hangs instead of dying (frozen: its socket still accepts, nothing comes back)
is caught by the probe too: every request in flight on it ends the same way as soon as it fails
a probe (about two seconds with the defaults), and a stream that sends nothing for
``--read-timeout`` seconds ends with a 504 event whatever the probe says. A refused connection
is retried on another worker (the request never reached the first). A client hanging up closes the upstream request, so the worker aborts
it and frees its blocks. ``x-pd-route`` on every answer says where the request went. On SIGTERM
the router does what a worker does: new requests get 503, and those in flight end at once with
503 JSON or, mid-stream, an SSE ``error`` event and ``[DONE]`` (their workers abort them).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import anyio
import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.background import BackgroundTask

from ..serve.protocol import APIError, error_body
from .routing import Policy, Shed, Workers

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 2.0  # a worker that does not accept within this is down: fail over, do not hang
PROBE_TIMEOUT_S = 1.0
READ_TIMEOUT_S = 60.0  # a stream silent this long between events ends (past what a long prefill elsewhere stalls it)
# what vLLM's proxy sends the prefill worker: "compute the prompt, keep its KV for a remote decode"
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
UNAVAILABLE = "service_unavailable"
KV_PARAMS = ("required", "optional")  # may a prefill answer come without kv_transfer_params?


class Upstream:
    """One open request on a worker; ``close()`` (idempotent) ends it there and in the policy's count.
    ``down`` is set when the worker is found down while the request is open."""

    def __init__(self, url: str, response: httpx.Response, policy: Policy, down: asyncio.Event | None = None):
        self.url, self.response, self.policy, self.closed, self.down = url, response, policy, False, down
        self.content, self.kv = b"", None  # a prefill's answer, read whole, and its kv_transfer_params

    async def close(self):
        if not self.closed:
            self.closed = True
            self.policy.done(self.url)
            await self.response.aclose()


class Router:
    """The state behind the app: the workers (``routing.Workers``), one HTTP client, the metrics."""

    def __init__(self, prefill=(), decode=(), instances=(), policy="round_robin", health_interval=1.0,
                 request_timeout=600.0, prefix_chars=256, max_imbalance=4, kv_params="required",
                 read_timeout=READ_TIMEOUT_S):
        if kv_params not in KV_PARAMS:
            raise ValueError(f"kv_params must be one of {KV_PARAMS}, not {kv_params!r}")
        self.kv_params = kv_params
        self.workers = Workers(prefill, decode, instances, policy, prefix_chars, max_imbalance)
        self.pd = "prefill" in self.workers.pools
        self.health_interval, self.request_timeout, self.read_timeout = health_interval, request_timeout, read_timeout
        self.down: dict[str, asyncio.Event] = {}  # per worker: set when it goes down, fresh when it is back
        self.client, self.health_task, self.stopping = None, None, False
        self.loop, self.stopped = None, None  # the event loop, and the Event that ends requests in flight
        self.registry = r = CollectorRegistry()  # one per router: several in one process do not clash
        self.requests = Counter("labsupport_router:requests", "Requests received, by route.", ["route"], registry=r)
        self.errors = Counter("labsupport_router:worker_errors", "Worker failures seen: refused or broken "
                              "connections, timeouts, failed probes.", ["worker"], registry=r)
        in_flight = Gauge("labsupport_router:in_flight", "Requests sent to the worker and not finished.",
                          ["worker", "role"], registry=r)
        healthy = Gauge("labsupport_router:worker_healthy", "1: the worker is used; 0: skipped as down.",
                        ["worker", "role"], registry=r)
        for role, (urls, pol) in self.workers.pools.items():
            for url in urls:
                in_flight.labels(url, role).set_function(lambda p=pol, u=url: p.in_flight[u])
                healthy.labels(url, role).set_function(lambda w=self.workers.by_url[url]: float(bool(w.healthy)))
                self.errors.labels(url)

    async def start(self):
        self.loop, self.stopped = asyncio.get_running_loop(), asyncio.Event()
        self.down = {url: asyncio.Event() for url in self.workers.by_url}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout, connect=CONNECT_TIMEOUT_S),
                                        limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512))
        await self.probe_all()
        self.health_task = asyncio.create_task(self.health_loop())

    async def stop(self):
        self.health_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.health_task
        await self.client.aclose()

    def shutdown(self, wait: bool = False):
        """On SIGTERM (``serve.server.serve`` calls it): new requests get 503, those in flight end with an
        error. Only flags: safe in a signal handler and from another thread."""
        self.stopping = True
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.stopped.set)

    async def unless_stopping(self, awaitable):
        """``await awaitable``, unless the router stops first: then it is cancelled and a 503 raised."""
        return await self.until(awaitable)

    async def until(self, awaitable, url: str | None = None, down: asyncio.Event | None = None,
                    timeout: float | None = None):
        """``await awaitable`` (work on worker ``url``), unless first the router stops (503), ``down`` is set:
        the worker failed a probe or another request (503), or ``timeout`` seconds pass (504). Then the work
        is cancelled, and has unwound (closed its socket), before the error is raised."""
        if self.stopped is None:
            return await awaitable
        work = asyncio.ensure_future(awaitable)
        stops = {asyncio.ensure_future(self.stopped.wait()): APIError(503, "the router is shutting down", UNAVAILABLE)}
        if down is not None:
            stops[asyncio.ensure_future(down.wait())] = APIError(
                503, f"worker {url} stopped answering (it failed a health probe): the request was cut", UNAVAILABLE)
        try:
            await asyncio.wait({work, *stops}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for stop in stops:
                stop.cancel()
            if not work.done():
                work.cancel()
                with anyio.CancelScope(shield=True):  # let it unwind (close its socket) before we go on
                    await asyncio.wait({work})
        if not work.cancelled():
            return work.result()
        if url is not None:
            self.errors.labels(url).inc()
        for stop, err in stops.items():
            if stop.done() and not stop.cancelled():
                raise err
        if timeout is None:  # cancelled from inside: nothing of ours to say
            raise asyncio.CancelledError()
        raise APIError(504, f"worker {url} sent nothing for {timeout:g} s (the router's --read-timeout)", "timeout")

    async def probe_all(self):
        for url in await self.workers.probe_all(self.client, PROBE_TIMEOUT_S):
            self.errors.labels(url).inc()
            self.went_down(url)

    def went_down(self, url: str):
        """Every request in flight on ``url`` ends now, with a 503 (``until``): the probe found it down. (A request
        that fails alone does not do this: one broken connection does not make a worker dead, and a dead
        worker's other connections break by themselves.)"""
        if url in self.down:
            self.down[url].set()

    async def health_loop(self):
        while True:
            await asyncio.sleep(self.health_interval)
            await self.probe_all()

    def upstream_error(self, url: str, exc: httpx.HTTPError) -> APIError:
        """The answer for a worker failing under a request; a broken worker is skipped until it probes healthy."""
        self.errors.labels(url).inc()
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return APIError(504, f"worker {url} did not answer within {self.request_timeout:g} s", "timeout")
        message = f"worker {url} failed: {type(exc).__name__}: {exc}".rstrip(": ")
        self.workers.set_healthy(url, False, message)  # skipped; its other requests end only if the probe agrees
        return APIError(503, message, UNAVAILABLE)

    def status(self) -> str | None:
        """Why the router cannot serve now, or None."""
        missing = self.workers.missing_roles()
        return "the router is shutting down" if self.stopping else \
            f"no healthy {' or '.join(missing)} worker" if missing else None

    # ------------------------------------------------------------------ requests

    async def open(self, role: str, path: str, body: dict, headers: dict, route: dict) -> Upstream:
        """Send ``body`` to a healthy worker of ``role`` chosen by the role's policy (``route[role]``: which);
        returns once the answer's headers are in. A worker refusing the connection is marked down and the
        next one tried."""
        urls, policy = self.workers.pools[role]
        tried = set()
        while True:
            candidates = self.workers.candidates(role, exclude=tried)
            if not candidates:
                raise APIError(503, f"no healthy {role} worker (of {len(urls)})", UNAVAILABLE)
            try:
                url = route[role] = policy.choose(candidates, body)
            except Shed as exc:  # refused at once: a client can retry elsewhere or later, not wait to miss
                raise APIError(429, str(exc), "rate_limit_exceeded") from None
            down = self.down.get(url)
            if down is not None and down.is_set():  # it fell and is back (it is a candidate): a fresh start
                down = self.down[url] = asyncio.Event()
            try:
                request = self.client.build_request("POST", url + path, json=body, headers=headers)
                return Upstream(url, await self.until(self.client.send(request, stream=True), url, down), policy, down)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached it: another may take it
                policy.done(url)
                self.upstream_error(url, exc)
                tried.add(url)
            except httpx.HTTPError as exc:
                policy.done(url)
                raise self.upstream_error(url, exc) from exc
            except BaseException:  # cancelled: the client hung up
                policy.done(url)
                raise

    async def read(self, up: Upstream) -> bytes:
        try:
            return await self.until(up.response.aread(), up.url, up.down)
        except httpx.HTTPError as exc:
            raise self.upstream_error(up.url, exc) from exc
        finally:
            await up.close()

    async def handle(self, path: str, body: dict, headers: dict) -> Response:
        route = {}  # role -> worker, for x-pd-route
        try:
            if why := self.status():  # a role with no worker up: say so now, not after a prefill for nothing
                raise APIError(503, why, UNAVAILABLE)
            if self.pd:
                up = await self.prefill(path, body, headers, route)
                if up.response.status_code != 200:  # the prefill worker's own error, passed through
                    return passthrough(up, up.content, route)
                if up.kv is not None:
                    body = {**body, "kv_transfer_params": up.kv}
            role = "decode" if self.pd else "instance"
            up = await self.open(role, path, body, headers, route)
            if body.get("stream") and up.response.status_code == 200 and \
                    up.response.headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(self.relay(up), media_type="text/event-stream", headers=route_header(route),
                                         background=BackgroundTask(up.close))
            return passthrough(up, await self.read(up), route)
        except APIError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param, headers=route_header(route))

    async def prefill(self, path: str, body: dict, headers: dict, route: dict) -> Upstream:
        """Step one of PD: the prompt's KV on a prefill worker; ``.kv`` of the answer says where it is."""
        if body.get("n", 1) != 1:
            raise APIError(400, "n must be 1 with prefill/decode disaggregation", param="n")
        request = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": dict(PREFILL_KV_PARAMS)}
        if "max_completion_tokens" in body:
            request["max_completion_tokens"] = 1
        request.pop("stream_options", None)
        up = await self.open("prefill", path, request, headers, route)
        up.content = await self.read(up)
        if up.response.status_code == 200:
            try:
                up.kv = json.loads(up.content).get("kv_transfer_params")
            except (ValueError, AttributeError):
                up.kv = None
            if not isinstance(up.kv, dict):
                up.kv = None
            if up.kv is None and self.kv_params == "required":
                raise APIError(502, f"prefill worker {up.url} answered without kv_transfer_params (is it running "
                                    "with a KV connector?)", "bad_gateway")
        return up

    async def relay(self, up: Upstream):
        """The worker's SSE bytes, unchanged, cut at event boundaries so that a stream breaking mid-event
        never hands the client half an event; a break becomes an ``error`` event and ``[DONE]``."""
        pending, chunks = b"", up.response.aiter_bytes()
        try:
            while (chunk := await self.until(anext(chunks, None), up.url, up.down, self.read_timeout)) is not None:
                pending += chunk
                if cut := events_end(pending):
                    yield pending[:cut]
                    pending = pending[cut:]
            if pending:
                yield pending
        except (httpx.HTTPError, APIError) as exc:  # the worker broke, or the router is stopping
            err = exc if isinstance(exc, APIError) else self.upstream_error(up.url, exc)
            yield f"data: {json.dumps(error_body(err.status, err.message, err.type))}\n\ndata: [DONE]\n\n".encode()
        finally:
            with anyio.CancelScope(shield=True):  # even when cancelled: the worker must learn we left
                await up.close()


def events_end(buf: bytes) -> int:
    """Where the last complete SSE event in ``buf`` ends (0: none yet); an event ends with a blank line."""
    return max(buf.rfind(b"\n\n") + 2 if b"\n\n" in buf else 0, buf.rfind(b"\r\n\r\n") + 4 if b"\r\n\r\n" in buf else 0)


def route_header(route: dict) -> dict:
    return {"x-pd-route": ";".join(f"{role}={url}" for role, url in route.items())} if route else {}


def passthrough(up: Upstream, content: bytes, route: dict) -> Response:
    return Response(content, up.response.status_code, headers=route_header(route),
                    media_type=up.response.headers.get("content-type", "application/json"))


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, headers=None,
                   **extra) -> JSONResponse:
    """OpenAI's error JSON (``extra``: more top-level keys, as ``workers`` for ``/health``)."""
    return JSONResponse({**error_body(status, message, type_, param), **extra}, status, headers=headers)

