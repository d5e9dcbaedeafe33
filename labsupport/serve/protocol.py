"""The OpenAI request bodies the server accepts, as pydantic models, and the OpenAI error shape.

Field names and defaults follow OpenAI's API and vLLM's extensions (``top_k``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``cache_salt``, ``priority``), so the official ``openai`` client
(``extra_body``) and ``vllm bench serve`` work unchanged. The models check *shapes* and *ranges*; the
engine's own rules (``SamplingParams``, the prompt check, ``check_priority``) run afterwards and also
answer 400. NaN and infinity are refused here (``allow_inf_nan=False``): JSON allows them as
extensions, and a NaN temperature reaching the sampler would fail every request sharing its step. Types are strict
(``strict=True``): ``"stream": "yes"``, ``"max_tokens": "4"`` or ``"prompt": [true, false]`` is a
400, not a guess (an integer is still a valid float). A string anywhere in a body, keys included,
must be valid Unicode text: JSON's ``"\\ud800"`` escape decodes to a lone surrogate, which no
tokenizer can encode and no answer can echo, so ``RequestBody`` refuses it once, for every field,
before any field is read. Unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep
working; fields we know and cannot honour (``suffix``, ``tools`` without a parser) are refused by
the routes with a 400 that says so.
"""
from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

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
    model_config = ConfigDict(allow_inf_nan=False, strict=True)


def is_valid_text(text: str) -> bool:
    """False for a string holding a lone surrogate (U+D800-U+DFFF): UTF-8 cannot encode it."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_at(body) -> str | None:
    """The path (``messages.0.content``) of the first string in a parsed JSON body, dict keys included,
    that holds a lone surrogate; None if there is none. A stack, not recursion: a deeply nested body
    cannot raise RecursionError here."""
    stack = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str) and not is_valid_text(value):
            return where or "body"
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not is_valid_text(key):
                    return where or "body"
                stack.append((item, f"{where}.{key}" if where else str(key)))
        elif isinstance(value, list):
            stack += [(item, f"{where}.{i}" if where else str(i)) for i, item in enumerate(value)]
    return None


class RequestBody(Strict):
    """A route's whole body: no string in it may hold a lone surrogate (checked once, before the fields)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        where = lone_surrogate_at(data)
        if where is not None:
            raise PydanticCustomError("lone_surrogate", "{where}: a string holds a lone surrogate (a \\ud800-\\udfff "
                                      "escape without its pair), which is not valid Unicode text", {"where": where})
        return data


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # a list of parts is OpenAI's too; vllm bench serve sends one
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (OpenAI's shape), for the chat template
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _content_unless_tool_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content' (only an assistant message with "
                             "'tool_calls' may have content null)")
        return self


class StreamOptions(Strict):
    include_usage: bool = False


class GenerationRequest(RequestBody):
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
    presence_penalty: float | None = None  # OpenAI's penalties, ranges checked by SamplingParams ([-2, 2])
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's (> 0; 1 is off)
    logit_bias: dict[str, float] | None = None  # {token id as a string: bias}, OpenAI's form
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}: serve/structured.py
    structured_outputs: dict | None = None  # vLLM's: {"json": ...} | {"regex": ...} | {"choice": [...]} | ...
    guided_json: str | dict | None = None  # vLLM's older names for structured_outputs' kinds
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # "xgrammar" or "auto" (the only one here)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # no cached KV/results across salts
    skip_result_cache: bool = False  # bypass the result cache for this request
    user: str | None = None  # accepted and ignored, as OpenAI's end-user id
    kv_transfer_params: dict | None = None  # PD (chapter 07): vLLM's field, set by the router
    priority: int = Field(0, ge=-(1 << 63), lt=1 << 63)  # vLLM's: smaller is served first, with --scheduling-policy
    # priority only (the route refuses another value than 0 under any other policy, in vLLM's words)

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
    tools: list[dict] | None = None  # accepted with tool_choice "none" only: no tool-call parser (serve/tools.py)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    # text, token ids, or a list of either: one choice (n choices) per prompt
    prompt: str | list[int | str | list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None  # refused: no fill-in-the-middle template here

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


class TokenizeRequest(RequestBody):
    """vLLM's ``/tokenize``: a ``prompt`` (text) or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True  # messages only
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
