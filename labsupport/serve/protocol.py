"""The OpenAI request bodies the server accepts, as pydantic models, and the OpenAI error shape.

Field names and defaults follow OpenAI's API and vLLM's extensions (``top_k``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``cache_salt``), so the official ``openai`` client and
``vllm bench serve`` work unchanged. The models check *shapes* and *ranges*; the engine's own
rules (``SamplingParams``, the prompt check) run afterwards and also answer 400. NaN and
infinity are refused here (``allow_inf_nan=False``): JSON allows them as extensions, and a NaN
temperature reaching the sampler would fail every request sharing its step. Unknown fields are
ignored, as OpenAI and vLLM do, so newer clients keep working.
"""
from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: top-k lists cost a sort per token and step
MAX_CHOICES = 128  # n x prompts in one request: beyond this, send several requests


class APIError(Exception):
    """An answer with an HTTP status and OpenAI's error body; raised anywhere in a route."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param), status_code=status)


def error_body(status: int, message: str, type_: str = "invalid_request_error", param=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


class Strict(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]  # OpenAI's API allows a list of parts; vllm bench serve sends one

    def as_dict(self) -> dict:
        """The frontend's message form; ``developer`` is OpenAI's newer name for ``system``."""
        content = self.content if isinstance(self.content, str) else [p.model_dump() for p in self.content]
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class StreamOptions(Strict):
    include_usage: bool = False


class GenerationRequest(Strict):
    """What chat and text completions share: the model, sampling, stopping, streaming, tenant."""

    model: str | None = None  # None: the served model (as vLLM allows)
    max_tokens: int | None = None  # checked by SamplingParams (the offline API says the same)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)  # -1 or 0: no top-k
    min_tokens: int = Field(0, ge=0)
    seed: int | None = None  # range checked by SamplingParams (a signed 64-bit integer)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = 0.0  # accepted only at 0: this engine has no penalties
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # no cached KV/results across salts
    skip_result_cache: bool = False  # bypass the result cache for this request
    user: str | None = None  # accepted and ignored, as OpenAI's end-user id
    kv_transfer_params: dict | None = None  # PD (chapter 07): vLLM's field, set by the router

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def limit(self) -> int | None:
        """The client's cap on output tokens, if it gave one."""
        return self.max_tokens


class ChatCompletionRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name; vllm bench serve sends it
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    # text, token ids, or a list of either: one choice (n choices) per prompt
    prompt: str | list[int | str | list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty: give text, token ids, or a list of either", param="prompt")
        ints = [isinstance(x, int) for x in p]
        if all(ints):
            return [p]
        if any(ints):
            raise APIError(400, "prompt mixes token ids with other prompts: give one list of token ids, "
                                "or a list of prompts (each text or a list of token ids)", param="prompt")
        return list(p)

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(Strict):
    """vLLM's ``/tokenize``: a ``prompt`` (text) or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True  # messages only
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
