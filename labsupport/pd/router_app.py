"""The router's HTTP face: ``create_router_app`` (the FastAPI app around a ``router.Router``) and the
``python -m labsupport router`` command line.

Kept apart from ``router.py``, which decides where a request goes and talks to the workers: this
file only turns HTTP requests into ``Router.handle`` calls (body checks, headers carried on, a
hang-up or SIGTERM ending the request) and exposes ``/v1/models``, ``/health`` and ``/metrics``.

The body is checked as the server checks it, so that no body a worker would refuse with a 4xx can
make the router itself fail: at most ``--max-request-body-bytes`` (the server's ``Guard``, before a
byte is buffered past the limit: a body buffered whole took the router's process to several times the body's size), JSON that Python can
parse without recursing out of stack (``MAX_DEPTH``), and strings that are Unicode (JSON's
``"\\ud800"`` parses to a lone surrogate, which cannot be sent on as UTF-8).
The command's ``--help`` is ``router.py``'s docstring, which says what the router does.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..serve.guard import DEFAULT_MAX_BODY_BYTES, Guard, cancel_on_disconnect
from ..serve.protocol import APIError
from .router import KV_PARAMS, READ_TIMEOUT_S, UNAVAILABLE, Router, error_response, log
from .router import __doc__ as ROUTER_DOC  # the command's --help
from .routing import POLICIES


MAX_DEPTH = 100  # nesting levels a body may have (an OpenAI request needs a handful; a JSON schema a few dozen)


def no_nan(constant: str):
    raise ValueError(f"{constant} is not a number JSON allows")


def parse_body(raw: bytes) -> dict:
    """The request's JSON object, or ``APIError(400)`` saying what is wrong with it."""
    try:
        body = json.loads(raw, parse_constant=no_nan)
    except RecursionError:
        raise APIError(400, f"the body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    todo = [(body, 1, "")]
    while todo:
        value, depth, where = todo.pop()
        if depth > MAX_DEPTH:
            raise APIError(400, f"the body nests deeper than {MAX_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            path = f"{where}.{key}" if where else str(key)
            for text in (key, item):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as exc:
                        path = path.encode("utf-8", "backslashreplace").decode()  # the answer must be UTF-8 too
                        raise APIError(400, f"{path}: not valid Unicode: a lone surrogate "
                                            f"{text[exc.start]!r} (a \\uD800-\\uDFFF escape without its pair)",
                                       param=path) from None
            if isinstance(item, (dict, list)):
                todo.append((item, depth + 1, path))
    return body


def create_router_app(prefill=(), decode=(), instances=(), policy="round_robin", health_interval=1.0,
                      request_timeout=600.0, prefix_chars=256, max_imbalance=4, kv_params="required",
                      read_timeout=READ_TIMEOUT_S, max_request_body_bytes=DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The router's app; ``app.state.router`` is its ``Router``. Workers are base URLs (``http://host:port``)."""
    router = Router(*([u.rstrip("/") for u in urls] for urls in (prefill, decode, instances)), policy,
                    health_interval, request_timeout, prefix_chars, max_imbalance, kv_params, read_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="LLM Serving Lab router", lifespan=lifespan)
    app.add_middleware(Guard, max_body_bytes=max_request_body_bytes)  # keys are the workers' to check
    app.state.router = app.state.engine = router  # serve() and BackgroundServer call engine.shutdown() on stop

    async def generate(request: Request, path: str):
        router.requests.labels(path).inc()
        if router.stopping:
            return error_response(503, "the router is shutting down", UNAVAILABLE)
        try:
            body = parse_body(await request.body())
        except APIError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)
        headers = {"X-Request-Id": request.headers.get("x-request-id") or uuid.uuid4().hex}  # same on both legs
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        try:  # a hang-up cancels the request; so does the router stopping, with a 503
            return await cancel_on_disconnect(request, router.unless_stopping(router.handle(path, body, headers)))
        except APIError as exc:
            return error_response(exc.status, exc.message, exc.type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        router.requests.labels("/v1/models").inc()
        healthy = [w.url for w in router.workers.by_url.values() if w.healthy]
        if not healthy:
            return error_response(503, "no healthy worker", UNAVAILABLE)
        auth = {k: v for k, v in request.headers.items() if k == "authorization"}
        try:
            r = await router.client.get(healthy[0] + "/v1/models", headers=auth, timeout=10)
        except httpx.HTTPError as exc:
            err = router.upstream_error(healthy[0], exc)
            return error_response(err.status, err.message, err.type)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type", "application/json"))

    @app.get("/health")
    async def health():
        why, workers = router.status(), router.workers.table()
        return error_response(503, why, UNAVAILABLE, workers=workers) if why else {"status": "ok", "workers": workers}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404
                              else "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        log.exception("unexpected error while routing a request")
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")

    return app


def url_list(text: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    return [u if "://" in u else "http://" + u for u in urls]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m labsupport router", description=ROUTER_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", type=url_list, default=[], help="PD mode: prefill workers URL[,URL] (round robin)")
    p.add_argument("--decode", type=url_list, default=[], help="PD mode: decode workers URL[,URL] (least loaded)")
    p.add_argument("--instances", type=url_list, default=[], help="instance mode: colocated servers URL,URL,...")
    p.add_argument("--kv-params", default="required", choices=KV_PARAMS, help="PD mode: 'optional' passes a "
                   "prefill answer without kv_transfer_params on to decode without them (KV found by the prompt, "
                   "as with vLLM's ExampleConnector); 'required' answers 502")
    p.add_argument("--policy", default="round_robin", choices=POLICIES, help="instance mode: how to pick")
    p.add_argument("--prefix-chars", type=int, default=256, help="prefix_aware: prompt characters hashed")
    p.add_argument("--max-imbalance", type=int, default=4, help="prefix_aware: leave the sticky instance when it "
                   "has this many more requests in flight than the least loaded")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between /health probes")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds to wait for a worker's answer to begin, or for a whole non-streamed answer")
    p.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S,
                   help="seconds a stream may send nothing between events before it ends with an error")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = p.parse_args(argv)
    try:
        for flag in ("request_timeout", "read_timeout", "max_request_body_bytes"):
            if getattr(args, flag) <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be positive, not {getattr(args, flag)}")
        app = create_router_app(args.prefill, args.decode, args.instances, args.policy, args.health_interval,
                                args.request_timeout, args.prefix_chars, args.max_imbalance, args.kv_params,
                                args.read_timeout, args.max_request_body_bytes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    from ..serve.server import serve
    return serve(app, args.host, args.port, args.log_level)
