"""The OpenAI-compatible server over an ``LLM``, with vLLM's extra routes.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    GET /health   GET /version   GET /metrics   POST /tokenize   POST /detokenize

Requests go through the same ``Frontend`` as ``LLM.generate`` (chat template, prompt checks,
result cache), then to an engine that steps all clients' requests together (continuous
batching): the engine core in a process of its own (``EngineCoreClient``, what ``python -m
labsupport serve`` runs), or chapter 06's engine-loop thread in this process (``AsyncEngine``,
for an ``LLM`` a notebook holds, and ``serve --engine-in-process``). The app's lifespan starts
it and, on shutdown, stops it: in-flight requests end with an error, new ones get 503.

Prompts are tokenized off the event loop once they are more than a few thousand characters
(a 4 MB prompt takes seconds to tokenize; on the loop it would freeze every stream for as
long), and one that cannot fit the context even at the vocabulary's longest piece per token is
refused before it is tokenized at all.

Every error is OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``), never a
traceback: 400 bad request, 401 no valid key, 404 unknown model or route, 413 body too large,
429 waiting queue full, 500 a step failed, 503 shutting down or the engine loop died.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from .async_engine import AsyncEngine, EngineUnavailableError, QueueFullError, RequestFailedError
from .completions import Completion, context_error, prompt_chars
from .guard import DEFAULT_MAX_BODY_BYTES, Guard, bearer_token, cancel_on_disconnect, tenant_salt
from .loop_lag import LoopLag
from .openai_format import TokenText
from .openapi import document_errors
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       error_response)
from .tools import template_message

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 2.0  # on SIGTERM, a stream gets this long to send its error and [DONE] before it is cut
STREAM_SEND_TIMEOUT_S = 30.0  # a client whose socket takes no bytes for this long is dropped (its request aborted)
INLINE_TOKENIZE_CHARS = 4096  # shorter prompts are tokenized on the event loop (well under a millisecond per 1k)
RETRY_AFTER_S = 1  # 429's Retry-After: a waiting request usually gets a slot within a few steps


def make_metrics(model_name: str, max_model_len: int):
    """``ServerMetrics`` for ``/metrics`` (its token-count buckets follow ``max_model_len``, as vLLM's)."""
    from .metrics import ServerMetrics
    return ServerMetrics(model_name, max_model_len=max_model_len)


def version() -> str:
    try:
        return metadata.version("labsupport")
    except metadata.PackageNotFoundError:
        return "unknown"


def create_app(source, served_model_name: str | None = None, *, api_keys=(), max_waiting_requests: int | None = 1024,
               max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES, metrics="auto",
               stream_send_timeout: float | None = STREAM_SEND_TIMEOUT_S) -> FastAPI:
    """The app over ``source``: an ``LLM`` (stepped by an engine-loop thread in this process) or an
    ``EngineCoreClient`` (its engine core in a process of its own). ``app.state.engine`` is that
    engine (started by the lifespan).

    ``api_keys``: if any, ``/v1`` (and ``/tokenize``, ``/detokenize``, ``/pd``) needs one, and each key
    is a tenant with its own cache salt. ``metrics``: "auto" (``ServerMetrics``), None, or an object
    with the hooks (in-process engines only: an engine core keeps its own). ``stream_send_timeout``:
    seconds a stream may wait on a client that reads nothing before it is dropped (None: never)."""
    from .core_client import EngineCoreClient
    if isinstance(source, EngineCoreClient):
        llm, engine = None, source
        name = served_model_name or source.model_name
    else:
        llm = source
        name = served_model_name or llm.frontend.model_name
        engine = AsyncEngine(llm, max_waiting_requests,
                             make_metrics(name, llm.engine.max_model_len) if metrics == "auto" else metrics)
    frontend = engine.frontend
    token_text = TokenText(frontend.tokenizer)
    tokenizing = ThreadPoolExecutor(2, thread_name_prefix="tokenize")
    lag = LoopLag()

    @contextlib.asynccontextmanager
    async def lifespan(_):
        engine.start()
        watcher = asyncio.create_task(lag.run())
        try:
            yield
        finally:
            watcher.cancel()
            engine.shutdown()
            tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="LLM Serving Lab", version=version(), lifespan=lifespan)
    app.state.engine, app.state.llm, app.state.model_name = engine, llm, name
    app.add_middleware(Guard, api_keys=list(api_keys), max_body_bytes=max_request_body_bytes)
    add_error_handlers(app)
    document_errors(app)  # /openapi.json: 400 with OpenAI's error body where FastAPI would say 422

    def check_model(model: str | None):
        if model is not None and model != name:
            raise APIError(404, f"The model `{model}` does not exist. Served: `{name}`.", "not_found_error", "model")

    async def off_loop(chars: int, work):
        """``work()`` on a tokenizing thread when the text is long, else here (a thread hop costs more)."""
        if chars <= INLINE_TOKENIZE_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(tokenizing, work)

    def refuse_oversized(chars: int):
        least = frontend.at_least_tokens(chars)
        if least >= frontend.engine.limits.max_model_len:
            raise context_error(frontend.engine.limits.max_model_len, least, chars)

    async def complete(body, request: Request):
        check_model(body.model)
        chars = prompt_chars(body)
        refuse_oversized(chars)
        key = bearer_token(request.headers) if api_keys else None
        salt = tenant_salt(key, body.cache_salt)
        completion = await off_loop(chars, lambda: Completion(body, frontend, name, salt, token_text))
        completion.submit(engine)
        if body.stream:
            return EventSourceResponse(completion.events(), ping=0, send_timeout=stream_send_timeout,
                                       shutdown_grace_period=SHUTDOWN_GRACE_S)
        return await cancel_on_disconnect(request, completion.response())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await complete(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await complete(body, request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "labsupport", "root": frontend.model_name,
                                            "max_model_len": frontend.engine.limits.max_model_len}]}

    @app.get("/health")
    async def health():
        if not engine.is_healthy:
            return error_response(503, engine.unavailable_reason(), "service_unavailable")
        return {"status": "ok"}

    @app.get("/version")
    async def get_version():
        return {"version": version()}

    @app.get("/metrics")
    async def get_metrics():
        rendered = await engine.render_metrics()
        if rendered is None:
            raise APIError(404, "metrics are not available on this server", "not_found_error")
        body, content_type = rendered
        return Response(body + lag.render(), media_type=content_type)  # the engine's, then this process's

    @app.get("/pd/timeline")
    async def pd_timeline(since: float = 0.0):
        """This worker's recent steps and KV transfers (wall-clock seconds after ``since``): chapter 07's
        timeline widget draws prefill and decode lanes from several workers' answers."""
        return await engine.pd_timeline(since)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either 'prompt' (text) or 'messages' (a conversation)", param="prompt")

        def work() -> bytes:  # the answer's JSON too: 800k token ids take seconds to encode
            if body.messages is not None:
                ids = frontend.chat_tokens([template_message(m) for m in body.messages], body.add_generation_prompt)[0]
            else:
                special = True if body.add_special_tokens is None else body.add_special_tokens
                ids = frontend.tokenizer(body.prompt, add_special_tokens=special).input_ids
            strs = frontend.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
            return json.dumps({"count": len(ids), "max_model_len": frontend.engine.limits.max_model_len,
                               "tokens": ids, "token_strs": strs}).encode()

        chars = prompt_chars(body)
        refuse_oversized(chars)  # as /v1 does: counting megabytes that can never be a prompt costs a core for seconds
        try:
            return Response(await off_loop(chars, work), media_type="application/json")
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = len(frontend.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must lie in [0, {vocab})", param="tokens")
        return {"prompt": frontend.tokenizer.decode(body.tokens)}

    return app


def add_error_handlers(app: FastAPI):
    @app.exception_handler(RequestValidationError)
    async def bad_request(_, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return error_response(400, f"{where}: {first['msg']}" if where else first["msg"],
                              param=where or (first.get("ctx") or {}).get("where"))

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404
                              else "invalid_request_error")

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(QueueFullError)
    async def queue_full(_, exc: QueueFullError):
        response = error_response(429, str(exc), "rate_limit_error")
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(EngineUnavailableError)
    async def unavailable(_, exc: EngineUnavailableError):
        return error_response(503, str(exc), "service_unavailable")

    @app.exception_handler(RequestFailedError)
    async def failed(_, exc: RequestFailedError):
        return error_response(500, str(exc), "server_error")

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        log.exception("unexpected error while serving a request")
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
