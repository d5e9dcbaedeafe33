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
from ..llm import LLM
from .result_cache import is_deterministic, result_key


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


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


def create_app(llm: LLM, served_model_name: str | None = None) -> FastAPI:
    name = served_model_name or llm.engine.model_path.name
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

    def check(req: CompletionParams, prompt):
        if req.model != name:
            raise APIError(404, f"The model `{req.model}` does not exist. Served: `{name}`.", "not_found_error", "model")
        try:
            params = req.sampling_params()
            ids, text = llm.tokenize(prompt)
            llm.engine.check_prompt(ids)  # the engine's own rules, answered as a 400 before any work
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        return ids, text, params

    def run(ids, text, params, on_token=None, salt=None):
        with lock:
            req = llm.engine.add_request(ids, params, prompt=text, cache_salt=salt)
            try:
                while not req.is_finished:
                    llm.engine.step()
                    if on_token and not on_token(req):
                        llm.engine.abort(req)  # the client went away: stop spending compute on it
            finally:
                llm.engine.abort(req)
            return req

    def usage(out):
        p, c = len(out.prompt_token_ids), len(out.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def respond(req_body: CompletionParams, prompt, chat: bool):
        ids, text, params = check(req_body, [m.model_dump() for m in prompt] if chat else prompt)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        cache = llm.result_cache if not req_body.skip_result_cache and is_deterministic(params) else None
        key = result_key(name, ids, params, req_body.cache_salt) if cache is not None else None
        if not req_body.stream or (cache is not None and key in cache.entries):
            req = cache.get(key) if cache is not None else None
            if req is None:
                req = llm.engine.output(await run_in_threadpool(run, ids, text, params, None, req_body.cache_salt))
                if cache is not None and req.finish_reason in ("stop", "length"):
                    cache.put(key, req.copy())
            if req_body.stream:  # a cached answer streams as one chunk
                return EventSourceResponse(replay(rid, created, req, chat, req_body), sep="\n")
            choice = ({"index": 0, "message": {"role": "assistant", "content": req.text}} if chat
                      else {"index": 0, "text": req.text})
            return {"id": rid, "object": obj, "created": created, "model": name,
                    "choices": [{**choice, "finish_reason": req.finish_reason}], "usage": usage(req)}
        return EventSourceResponse(stream(rid, created, ids, text, params, chat, req_body),
                                   ping=15, sep="\n")

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

    async def stream(rid, created, ids, text, params, chat, body):
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        state = {"sent": 0, "connected": True}

        def on_token(req):
            delta = req.text[state["sent"]:]
            state["sent"] = len(req.text)
            loop.call_soon_threadsafe(queue.put_nowait, (delta, req.finish_reason))
            return state["connected"]

        def work():
            try:
                return run(ids, text, params, on_token, body.cache_salt)
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
                req = llm.engine.output(await task)
            except Exception as exc:
                yield json.dumps({"error": {"message": f"internal error: {type(exc).__name__}",
                                            "type": "internal_error", "param": None, "code": 500}})
                return
            if body.stream_options and body.stream_options.include_usage:
                yield usage_json(rid, created, body, chat, req)
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
                                            "max_model_len": llm.engine.max_model_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app
