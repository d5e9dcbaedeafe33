"""One chat or text completion request, from its JSON body to OpenAI's answer, whole or streamed.

Everything that can be refused is refused before the response starts, so it still has a status
code: the model name (404), the prompt and the sampling values (400), the context length (400,
with both numbers, as vLLM says it), a full waiting queue (429), a server going down (503).
Only then does streaming begin; an error after that point is sent as an SSE ``error`` event
followed by ``[DONE]``, which the ``openai`` client raises as an ``APIError``.

``n`` choices of one prompt are one engine request with ``SamplingParams(n=n)``: its samples fork
once the prompt is computed (chapter 04), so the prompt runs once and its blocks are shared,
copied on write. Sample ``i`` is choice ``index`` i, streamed or not; usage counts the prompt
once and sums the choices' tokens, as vLLM and OpenAI do. With a ``seed``, sample ``i`` draws from
its own generator seeded with ``seed + i`` (``SamplingParams.for_sample``, vLLM's rule): the
choices are reproducible and differ from one another, and each equals a request alone with that
seed. Forked samples run together, so ``n`` above ``max_num_seqs`` is a 400 that names both.
Where the engine cannot fork (contiguous KV, speculative decoding: ``EngineLimits.forks_samples``)
the choices are ``n`` engine requests with those same seeds instead, queued like any others: a
client asking for ``n`` gets ``n`` choices, and the same ones, whatever the server's configuration;
only the prompt is computed ``n`` times (less its cached blocks). ``kv_transfer_params`` takes
``n=1`` only: a PD hand-off moves one sequence's KV. A list of prompts (text completions) gives
``n`` choices per prompt, indexed prompt-major.

Streamed deltas are cut from cumulative outputs whose text the engine already holds back where
a stop string might still begin or a character is still incomplete, so the deltas join to
exactly the text a non-streamed request returns.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

from ..engine.limits import ContextLengthError
from ..engine.request import SamplingParams
from ..frontend import PreparedRequest
from . import openai_format as fmt
from .async_engine import EngineUnavailableError, RequestFailedError
from .protocol import MAX_CHOICES, APIError, ChatCompletionRequest, CompletionRequest, error_body
from .structured import structured_outputs
from .tools import check_tools, template_message, template_tools

log = logging.getLogger(__name__)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for text completions


def context_error(max_model_len: int, at_least: int, chars: int) -> APIError:
    """The 400 for a prompt refused before tokenizing: it has at least ``at_least`` tokens."""
    return APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                         f"at least {at_least} input tokens ({chars} characters). Please reduce the length of the "
                         "input messages.",
                    param="messages")


def prompt_chars(body) -> int:
    """How much text a request asks to tokenize (its prompts or messages), counted without tokenizing."""
    def size(x) -> int:
        if isinstance(x, str):
            return len(x)
        if isinstance(x, (list, tuple)):
            return sum(size(y) for y in x)
        if isinstance(x, dict):
            return sum(size(v) for v in x.values())
        return size(getattr(x, "content", None)) + size(getattr(x, "text", None)) if hasattr(x, "__dict__") else 0
    messages = getattr(body, "messages", None)
    return size(messages if messages is not None else getattr(body, "prompt", None))


def sampling_params(body, max_tokens: int, vocab_size: int, logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's parameters for the body's ``n`` choices of one prompt; a value it refuses is a 400 saying why."""
    extras = {"top_k": min(body.top_k, vocab_size) if body.top_k > 0 else None, "min_tokens": body.min_tokens or None,
              "stop_token_ids": body.stop_token_ids, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
              "kv_transfer_params": body.kv_transfer_params, "presence_penalty": body.presence_penalty,
              "frequency_penalty": body.frequency_penalty, "repetition_penalty": body.repetition_penalty,
              "logit_bias": body.logit_bias, "structured_outputs": structured_outputs(body)}
    extras = {k: v for k, v in extras.items() if v is not None}  # only what was asked for
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                              stop=body.stop, ignore_eos=body.ignore_eos, n=body.n, **extras)
    except TypeError as exc:  # an engine without these options yet
        raise APIError(400, f"this engine does not support {sorted(extras)} yet ({exc})") from exc
    except ValueError as exc:
        raise APIError(400, str(exc), param=param_named(str(exc), ("seed", "n", *extras))) from exc


def param_named(message: str, names) -> str | None:
    """The body field an engine message is about: the one it starts with (``n=9 samples ...``, ``seed ...``)."""
    return next((k for k in names if message.startswith(k) and message[len(k):len(k) + 1] in (" ", "=", "")), None)


def sse(*payloads: str) -> bytes:
    """Server-sent events, one per payload, as one write."""
    return "".join(f"data: {p}\n\n" for p in payloads).encode()


@dataclass
class Choice:
    """What a stream has sent of one choice so far."""

    chars: int = 0
    tokens: int = 0
    opened: bool = False  # something of it was sent
    offset: int = 0  # legacy logprobs: where the next token's text begins


class Completion:
    """One request: its checked engine requests, then its answer (``response``) or its stream (``events``)."""

    def __init__(self, body: ChatCompletionRequest | CompletionRequest, frontend, model_name: str,
                 cache_salt: str | None, token_text: fmt.TokenText):
        self.body, self.frontend, self.model_name, self.token_text = body, frontend, model_name, token_text
        self.chat = isinstance(body, ChatCompletionRequest)
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.num_top = body.num_logprobs()
        self.echo = not self.chat and body.echo
        if self.chat:
            check_tools(body)
        elif body.suffix is not None:
            raise APIError(400, "suffix is not supported: this server has no fill-in-the-middle template for its "
                                "model; put the text in the prompt", param="suffix")
        prompts = [[template_message(m) for m in body.messages]] if self.chat else body.prompts()
        has_connector = frontend.engine.limits.has_connector
        if body.kv_transfer_params is not None and (len(prompts) * body.n != 1 or not has_connector):
            raise APIError(400, "kv_transfer_params needs one prompt with n=1, on a server started with --role "
                                "(a KV connector)" if not has_connector else
                                "kv_transfer_params needs one prompt with n=1", param="kv_transfer_params")
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={body.n} choices is too many for one request "
                                f"(max {MAX_CHOICES}): send several requests")
        self.requests: list[PreparedRequest] = []  # engine requests: one per prompt (n forked samples), or n
        for prompt in prompts:
            self.requests += self._prepare(prompt, cache_salt)
        self.request_ids = [f"{self.id}-{k}" for k in range(len(self.requests))]
        # choice i's prompt and engine request: each engine request gives params.n choices, in order
        self.prepared = [p for p in self.requests for _ in range(p.params.n)]

    def _prepare(self, prompt, cache_salt) -> list[PreparedRequest]:
        engine = self.frontend.engine
        prompt_field = "messages" if self.chat else "prompt"
        try:
            if self.chat:
                ids, text = self.frontend.chat_tokens(prompt, tools=template_tools(self.body))
            else:
                ids, text = self.frontend.tokenize({"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt)
            limit = self.body.limit()
            if limit is None and not self.chat:
                limit = DEFAULT_COMPLETION_MAX_TOKENS
            if limit == 0 and not self.echo:
                raise APIError(400, "max_tokens must be at least 1 (0 only with echo=true on /v1/completions: the "
                                    "prompt and its logprobs come back and nothing is generated)", param="max_tokens")
            max_tokens = engine.check_prompt(ids, limit)  # every prompt rule, once (EngineLimits.check_prompt)
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param=prompt_field if exc.field == "prompt" else exc.field) from exc
        except ValueError as exc:
            raise APIError(400, str(exc), param=prompt_field) from exc
        try:
            engine.limits.check_priority(self.body.priority)  # not 0 without the priority policy: refused, as vLLM
        except ValueError as exc:
            raise APIError(400, str(exc), param="priority") from exc
        if text is None and self.echo:
            text = self.frontend.tokenizer.decode(ids)
        first = PreparedRequest(ids, text, SamplingParams(), cache_salt, priority=self.body.priority)
        limits = engine.limits
        prompt_logprobs = self.num_top if self.echo else None
        if max_tokens == 0 and prompt_logprobs is None:  # echo, max_tokens=0: a prompt-only engine request
            prompt_logprobs = 0
        params = sampling_params(self.body, max_tokens, limits.vocab_size, self.num_top, prompt_logprobs)
        # n > 1 forks in the engine where it can; elsewhere n requests of one sample each, seeded as the fork
        # would seed them (for_sample), so the choices are the same either way
        choices = [params] if params.n == 1 or limits.forks_samples else [params.for_sample(i) for i in range(params.n)]
        for p in choices:
            try:
                limits.check_params(p)  # the engine's rules for them (vocabulary, n and the slots, options it lacks)
            except ValueError as exc:
                raise APIError(400, str(exc), param=param_named(str(exc), ("n", "stop_token_ids", "logit_bias",
                                                                           "kv_transfer_params"))) from exc
        return [self.frontend.with_params(first, p, use_result_cache=not self.body.skip_result_cache)
                for p in choices]

    # ------------------------------------------------------------------ running

    def submit(self, engine):
        """Queue what the result cache did not answer; raises QueueFullError/EngineUnavailableError."""
        self.outputs, self.choice_of, todo = {}, [], []  # choice_of: the stream's index -> the choice's
        first = 0  # the first choice of each engine request
        for k, p in enumerate(self.requests):
            if p.cached is not None:  # n = 1 only: a request of n > 1 samples is never looked up
                self.outputs[first] = p.cached
            else:
                todo.append(k)
                self.choice_of += range(first, first + p.params.n)
            first += p.params.n
        self.stream = engine.submit([self.requests[k] for k in todo], [self.request_ids[k] for k in todo])

    async def _batches(self):
        """``{choice index: latest output}``; cached answers first, all at once."""
        if self.outputs:
            yield dict(self.outputs)
        async for batch in self.stream:
            batch = {self.choice_of[k]: out for k, out in batch.items()}
            for i, out in batch.items():
                self.outputs[i] = out
                if out.finished and not out.cached:
                    self.frontend.remember(self.prepared[i], out)
            yield batch

    async def response(self) -> dict:
        try:
            async for _ in self._batches():
                pass
        finally:
            self.stream.close()
        choices = []
        for i in range(len(self.prepared)):
            out = self.outputs[i]
            lp = self._logprobs(i, out, Choice())
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": out.text},
                                "logprobs": lp, "finish_reason": out.finish_reason})
            else:
                text = (self.prepared[i].prompt + out.text) if self.echo else out.text
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason})
        answer = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                  "created": self.created, "model": self.model_name, "choices": choices, "usage": self._usage()}
        if self.body.kv_transfer_params is not None:  # PD (n = 1): where the decode worker fetches this prompt's KV
            answer["kv_transfer_params"] = self.outputs[0].kv_transfer_params
        return answer

    async def events(self):
        """The SSE stream as bytes, one write per engine step (every choice that moved, together); closing
        this generator aborts what still runs.

        A chat choice's first chunk carries its role *and* its first token, sent when that token exists:
        clients (``vllm bench serve``, guidellm, the ``openai`` SDK's users) time the first token at the
        first chunk, so a role chunk sent before any token is computed would report a prefill as free.
        No keep-alive comments either: a parser that strips each network read glues the next events onto
        a lone ``: ping`` line and loses them."""
        sent = {i: Choice() for i in range(len(self.prepared))}
        try:
            async for batch in self._batches():
                chunks = [chunk for i, out in batch.items() if (chunk := self._delta(i, out, sent[i])) is not None]
                if chunks:
                    yield sse(*chunks)
            if self.body.include_usage:
                yield sse(json.dumps({"id": self.id, "object": self._chunk_object(), "created": self.created,
                                      "model": self.model_name, "choices": [], "usage": self._usage()}))
        except (RequestFailedError, EngineUnavailableError) as exc:
            status = 503 if isinstance(exc, EngineUnavailableError) else 500
            yield sse(json.dumps(error_body(status, str(exc), "server_error")))
        except Exception as exc:  # a bug: the client still gets an error and [DONE], never a cut stream
            log.exception("streaming %s failed", self.id)
            yield sse(json.dumps(error_body(500, f"internal error: {type(exc).__name__}", "internal_error")))
        finally:
            self.stream.close()
        yield sse("[DONE]")

    # ------------------------------------------------------------------ formatting

    def _delta(self, i: int, out, sent: Choice) -> str | None:
        text, new_tokens = out.text[sent.chars:], out.token_ids[sent.tokens:]
        if self.echo and not sent.opened:  # an echoing stream's first text is the prompt's
            text = self.prepared[i].prompt + text
        finish = out.finish_reason if out.finished else None
        logprobs = self._logprobs(i, out, sent)
        opening = self.chat and not sent.opened  # its role goes with its first token, even one with no text yet
        sent.chars, sent.tokens, sent.opened = len(out.text), len(out.token_ids), True
        if opening:
            return self._chunk(i, {"role": "assistant", "content": text}, finish, logprobs)
        if not text and finish is None and not (logprobs and new_tokens):
            return None
        return self._chunk(i, text, finish, logprobs)

    def _chunk(self, i: int, content, finish: str | None = None, logprobs=None) -> str:
        if self.chat:
            delta = content if isinstance(content, dict) else ({"content": content} if content else {})
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": i, "text": content, "logprobs": logprobs, "finish_reason": finish}
        return json.dumps({"id": self.id, "object": self._chunk_object(), "created": self.created,
                           "model": self.model_name, "choices": [choice]})

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _logprobs(self, i: int, out, sent: Choice):
        """Log probabilities of the tokens after ``sent.tokens``; an echoing choice's first ones start
        with the prompt's (``prompt_logprobs``, the first ``None``)."""
        if self.num_top is None:
            return None
        lps = getattr(out, "logprobs", None) or []
        ids, new = out.token_ids[sent.tokens:len(lps)], lps[sent.tokens:]
        if self.chat:
            return {"content": fmt.chat_logprobs(self.token_text, ids, new, self.num_top)}
        parts = []
        if self.echo and not sent.opened:
            prompt = self.prepared[i].prompt_token_ids
            prompt_lps = getattr(out, "prompt_logprobs", None) or [None] * len(prompt)
            parts.append(fmt.completion_logprobs(self.token_text, prompt, prompt_lps, self.num_top, 0))
            sent.offset = len(self.prepared[i].prompt)  # the output's text begins right after the prompt's
        parts.append(fmt.completion_logprobs(self.token_text, ids, new, self.num_top, sent.offset))
        if parts[-1]["tokens"]:
            sent.offset = parts[-1]["text_offset"][-1] + len(parts[-1]["tokens"][-1])
        return fmt.join_completion_logprobs(parts)

    def _usage(self) -> dict:
        n, prompt_tokens, cached = self.body.n, 0, 0
        for first in range(0, len(self.prepared), n):  # the prompt counts once, not once per choice
            prompt_tokens += len(self.prepared[first].prompt_token_ids)
            cached += fmt.cached_tokens(self.outputs[first])
        completion = sum(len(out.token_ids) for out in self.outputs.values())
        return fmt.usage(prompt_tokens, completion, cached)
