"""A minimal OpenAI-compatible server over ``LLM``: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, ``/health``. Chapter 06 replaces the lock below with an async engine that
batches concurrent requests; the HTTP surface stays the same.

Errors look like OpenAI's (``{"error": {"message", "type", "param", "code"}}``) with the right
status: 400 for a bad request, 404 for an unknown model. Never a traceback.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Literal

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from ..engine.request import SamplingParams
from ..frontend import Frontend, PreparedRequest


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]  # OpenAI's API allows a list of parts; vllm bench serve sends one


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionParams(BaseModel):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)
    cache_salt: str | None = None  # tenant: no cached KV or results are shared across salts (as in vLLM)
    skip_result_cache: bool = False  # bypass the result cache for this request

    def sampling_params(self) -> SamplingParams:
        limit = next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None), 256)
        return SamplingParams(max_tokens=limit,
                              temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                              stop=self.stop, ignore_eos=self.ignore_eos)


class ChatCompletionRequest(CompletionParams):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(CompletionParams):
    prompt: str


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_response(status: int, message: str, type_: str, param=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


def create_app(llm, served_model_name: str | None = None) -> FastAPI:
    """The app over an ``LLM``: requests go through its ``Frontend``, the same path ``generate`` takes."""
    frontend: Frontend = llm.frontend
    engine = frontend.engine
    name = served_model_name or frontend.model_name
    app = FastAPI(title="LLM Serving Lab")
    lock = threading.Lock()  # one generation at a time: the minimal server does not batch yet

    @app.exception_handler(RequestValidationError)
    async def bad_request(_, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return error_response(400, f"{where}: {first['msg']}", "invalid_request_error", where or None)

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")

    def check(body: CompletionParams, prompt) -> PreparedRequest:
        if body.model != name:
            raise APIError(404, f"The model `{body.model}` does not exist. Served: `{name}`.", "not_found_error",
                           "model")
        try:  # the frontend's rules, answered as a 400 before any work
            return frontend.prepare(prompt, body.sampling_params(), cache_salt=body.cache_salt,
                                    use_result_cache=not body.skip_result_cache)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def run(prepared: PreparedRequest, on_token=None):
        with lock:
            req = frontend.submit(prepared)
            try:
                while not req.is_finished:
                    engine.step()
                    if on_token and not on_token(req):
                        engine.abort(req)  # the client went away: stop spending compute on it
            finally:
                engine.abort(req)  # a no-op once finished; frees everything if the step raised
            return frontend.complete(prepared, req)

    def usage(out):
        p, c = len(out.prompt_token_ids), len(out.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def respond(body: CompletionParams, prompt, chat: bool):
        prepared = check(body, [m.model_dump() for m in prompt] if chat else prompt)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if prepared.cached is not None and body.stream:  # a cached answer streams as one chunk
            return EventSourceResponse(replay(rid, created, prepared.cached, chat, body), sep="\n")
        if body.stream:
            return EventSourceResponse(stream(rid, created, prepared, chat, body), ping=15, sep="\n")
        out = prepared.cached or await run_in_threadpool(run, prepared)
        choice = ({"index": 0, "message": {"role": "assistant", "content": out.text}} if chat
                  else {"index": 0, "text": out.text})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": name, "choices": [{**choice, "finish_reason": out.finish_reason}], "usage": usage(out)}

    def chunk_json(rid, created, body, chat, delta=None, finish=None, role=False):
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
            choice = {"index": 0, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish}
        obj = "chat.completion.chunk" if chat else "text_completion"
        return json.dumps({"id": rid, "object": obj, "created": created, "model": body.model, "choices": [choice]})

    def usage_json(rid, created, body, chat, req):
        obj = "chat.completion.chunk" if chat else "text_completion"
        return json.dumps({"id": rid, "object": obj, "created": created, "model": body.model,
                           "choices": [], "usage": usage(req)})

    async def replay(rid, created, req, chat, body):
        if chat:
            yield chunk_json(rid, created, body, chat, role=True)
        yield chunk_json(rid, created, body, chat, req.text, req.finish_reason)
        if body.stream_options and body.stream_options.include_usage:
            yield usage_json(rid, created, body, chat, req)
        yield "[DONE]"

    async def stream(rid, created, prepared, chat, body):
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        state = {"sent": 0, "connected": True}

        def on_token(req):
            text = req.streamable_text()  # holds back what a stop string may still cut
            delta = text[state["sent"]:]
            state["sent"] = len(text)
            loop.call_soon_threadsafe(queue.put_nowait, (delta, req.finish_reason))
            return state["connected"]

        def work():
            try:
                return run(prepared, on_token)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)  # always wake the stream up

        task = loop.run_in_executor(None, work)
        def chunk(delta=None, finish=None, role=False):
            return chunk_json(rid, created, body, chat, delta, finish, role)

        try:
            if chat:
                yield chunk(role=True)
            while (item := await queue.get()) is not None:
                delta, finish = item
                if delta or finish:
                    yield chunk(delta, finish)
            try:
                out = await task
            except Exception as exc:
                yield json.dumps({"error": {"message": f"internal error: {type(exc).__name__}",
                                            "type": "internal_error", "param": None, "code": 500}})
                return
            if body.stream_options and body.stream_options.include_usage:
                yield usage_json(rid, created, body, chat, out)
            yield "[DONE]"
        finally:
            state["connected"] = False  # on disconnect the engine thread aborts at its next token

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await respond(body, body.messages, True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await respond(body, body.prompt, False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "labsupport",
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app
