"""The frontend: the one way in for a request, from ``LLM.generate`` and from the HTTP server alike.

A prompt (a string, chat messages, ``{"prompt": ...}`` or ``{"prompt_token_ids": [...]}``)
becomes token ids; they are checked against the engine's rules before anything is queued, so
a bad prompt is an error that loses nothing; the result cache's rule is applied (only
deterministic requests are looked up, through the cache's own ``get``, which honours the TTL;
only complete answers are stored); then the engine request is made.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .engine.request import Request, RequestMetrics, RequestOutput, SamplingParams, next_request_id
from .result_cache import ResultCache, is_deterministic, result_key


def is_chat(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def message_text(i: int, message) -> str:
    """A chat message's text: ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"message {i} must be a dict with a 'role' and a 'content'")
    content = message.get("content")
    if content is None and message.get("role") == "assistant" and message.get("tool_calls"):
        return ""  # an assistant's earlier tool calls (content null): the template renders the calls
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"message {i}: content parts must be {{'type': 'text', 'text': ...}} (text only)")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError(f"message {i} ({message['role']}) needs a 'content' string, got {content!r}")
    return content


TEMPLATE_KEYS = ("name", "tool_calls", "tool_call_id")  # a message's fields besides role and content


@dataclass
class PreparedRequest:
    """A checked request, ready for the engine, or already answered by the result cache."""

    prompt_token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    cache_salt: str | None = None
    cache_key: str | None = None  # set when the result cache may answer or store this request
    cached: RequestOutput | None = None  # the result cache's answer: the engine is not needed
    priority: int = 0  # scheduling_policy="priority": smaller is served first (checked by prepare)


class Frontend:
    def __init__(self, engine, model_name: str, result_cache: ResultCache | None = None):
        """``engine``: an ``LLMEngine``, or anything with its ``tokenizer``, ``limits`` and ``check_prompt``
        (``serve.core_client.RemoteEngine``: the engine in another process); ``submit`` and ``complete``
        need a real one."""
        self.engine, self.model_name, self.result_cache = engine, model_name, result_cache
        self.tokenizer = engine.tokenizer
        self._max_piece = None

    def at_least_tokens(self, chars: int) -> int:
        """A lower bound on the tokens of ``chars`` characters of text, without tokenizing it: no token
        covers more characters than its vocabulary's longest piece. It lets the server refuse a prompt
        that cannot fit the context before spending seconds of a core on tokenizing megabytes."""
        if self._max_piece is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_piece = max(map(len, vocab), default=1) or 1
        return chars // self._max_piece

    def tokenize(self, prompt) -> tuple[list[int], str | None]:
        """Return ``(token_ids, text)`` for any accepted prompt form."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), None
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
            prompt = prompt["prompt"]
        if is_chat(prompt):
            return self.chat_tokens(prompt)
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids, prompt
        raise ValueError(f"a prompt is a string, a chat message list or a dict, not {type(prompt).__name__}")

    def prepare(self, prompt, params: SamplingParams | None = None, cache_salt: str | None = None,
                use_result_cache: bool = True, priority: int = 0) -> PreparedRequest:
        """Tokenize and check; raises ValueError, saying what to change, before anything is queued."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        ids, text = self.tokenize(prompt)
        self.engine.check_prompt(ids)
        self.engine.check_params(params)
        self.engine.limits.check_priority(priority)
        if isinstance(prompt, dict) and cache_salt is None:
            cache_salt = prompt.get("cache_salt")
        prepared = PreparedRequest(ids, text, params, cache_salt, priority=int(priority))
        return self.with_params(prepared, params, use_result_cache)

    def chat_tokens(self, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None
                    ) -> tuple[list[int], str]:
        """``(token_ids, text)`` of a conversation through the model's chat template (with ``tools``, if
        given, for a template that shows them; a message's tool calls and tool-call id go to it too)."""
        messages = [{**{k: m[k] for k in TEMPLATE_KEYS if k in m}, "role": m["role"], "content": message_text(i, m)}
                    for i, m in enumerate(messages)]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **({"tools": tools} if tools else {}))
        return self.tokenizer(text, add_special_tokens=False).input_ids, text

    def with_params(self, prepared: PreparedRequest, params: SamplingParams,
                    use_result_cache: bool = True) -> PreparedRequest:
        """The same checked prompt with other sampling parameters (the server's choices where the engine
        cannot fork ``n`` samples differ by seed), looked up in the result cache afresh: tokenized and
        checked once, asked several times."""
        again = PreparedRequest(prepared.prompt_token_ids, prepared.prompt, params, prepared.cache_salt,
                                priority=prepared.priority)
        if self.result_cache is not None and use_result_cache and is_deterministic(params):
            again.cache_key = result_key(self.model_name, again.prompt_token_ids, params, again.cache_salt)
            hit = self.result_cache.get(again.cache_key)
            again.cached = None if hit is None else self._replayed(hit)
        return again

    def submit(self, prepared: PreparedRequest, request_id: str | None = None) -> Request:
        return self.engine.add_request(prepared.prompt_token_ids, prepared.params, request_id=request_id,
                                       prompt=prepared.prompt, cache_salt=prepared.cache_salt,
                                       prompt_checked=True, priority=prepared.priority)  # prepare() checked it

    def complete(self, prepared: PreparedRequest, req: Request) -> RequestOutput:
        """The finished request's output; a complete deterministic answer goes into the result cache."""
        return self.remember(prepared, self.engine.output(req))

    def remember(self, prepared: PreparedRequest, out: RequestOutput) -> RequestOutput:
        """Store a complete deterministic answer in the result cache; returns ``out`` (the cache locks
        itself: the server looks requests up on its tokenizing threads)."""
        if prepared.cache_key is not None and out.finish_reason in ("stop", "length"):
            self.result_cache.put(prepared.cache_key, out.copy())  # a copy: the caller may change what it got
        return out

    @staticmethod
    def _replayed(out: RequestOutput) -> RequestOutput:
        """A copy of the cached answer, with its own id and timings: it arrived and finished now. None of
        its prompt was computed, so all of it counts as cached (``usage.prompt_tokens_details``)."""
        now = time.perf_counter()
        metrics = RequestMetrics(arrival_time=now, first_scheduled_time=now, first_token_time=now,
                                 finished_time=now, token_times=[now] * len(out.token_ids))
        return out.copy(request_id=next_request_id(), metrics=metrics, cached=True,
                        num_cached_tokens=len(out.prompt_token_ids))
