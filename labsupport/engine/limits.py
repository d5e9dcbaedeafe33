"""What a prompt must satisfy to run on an engine, as data that can cross a process boundary.

A prompt the engine could never run (longer than the context, more blocks than the pool holds,
a token outside the vocabulary) must be refused before it is queued, with a message that says
what to change: found later, inside a step, it would fail the step's other requests too. When
the server's engine runs in a process of its own (``serve/engine_core.py``), the frontend that
tokenizes and answers 400 has no engine to ask; the engine core sends it these limits once at
start-up instead, and both sides call the same ``check_prompt``, so there is one rule.

The length rule is said in vLLM's OpenAI-server wording ("This model's maximum context length is
...", with both numbers): clients parse it to shorten and retry, so the offline ``LLM`` says the
same. ``check_prompt(ids, max_tokens)`` also returns the output budget the server sends to the
engine: the prompt is checked once, on its way in, and the engine trusts that check
(``LLMEngine.add_request(prompt_checked=True)``). ``check_params`` holds the rules for the sampling
parameters, ``n`` parallel samples among them (``forks_samples``).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from .block_pool import blocks_needed
from .kv_connector import connector_class


class ContextLengthError(ValueError):
    """The prompt, or the prompt with ``max_tokens``, does not fit the context. ``field`` says which to
    shorten ("prompt" or "max_tokens"): the server names it as the 400's ``param``."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    vocab_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    num_blocks: int | None = None  # paged KV: the pool's blocks (None: no pool, nothing to count)
    block_size: int | None = None
    connector: str | None = None  # chapter 07: the KV connector's name (kv_connector.py); it takes kv_transfer_params
    speculative: bool = False  # chapter 09: speculative decoding is on
    max_num_seqs: int | None = None  # sequence slots of a step (None: not counted here)
    scheduling_policy: str = "continuous"  # "priority": requests may carry a priority (check_priority)

    @property
    def has_connector(self) -> bool:
        return self.connector is not None

    @property
    def forks_samples(self) -> bool:
        """Can ``n > 1`` run as one request whose samples fork after the prompt (chapter 03)? They share the
        prompt's blocks, so the KV must be paged; a speculative step verifies one sequence's guesses, not
        forked ones, so not with speculative decoding."""
        return self.num_blocks is not None and not self.speculative

    def output_budget(self, prompt_len: int, max_tokens: int | None = None) -> int:
        """``max_tokens``, or with None what the context leaves after the prompt; ContextLengthError, in
        vLLM's wording with both numbers, when the prompt (and ``max_tokens``) cannot fit."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ContextLengthError(f"This model's maximum context length is {limit} tokens. However, your request "
                                     f"has {prompt_len} input tokens. Please reduce the length of the input "
                                     "messages.", "prompt")
        if max_tokens is None:
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise ContextLengthError(f"This model's maximum context length is {limit} tokens. However, you "
                                     f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                                     f"{max_tokens} in the completion). Please reduce the length of the messages "
                                     "or completion.", "max_tokens")
        return max_tokens

    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int | None = None) -> int:
        """Raise ValueError, saying what to change, for a prompt this engine can never run (with
        ``max_tokens``, also one whose output cannot fit after it); else return the output budget
        (``output_budget``)."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        if not set(map(type, prompt_token_ids)) <= {int}:  # exactly int: not bool, not a float (in C: long prompts)
            raise ValueError("prompt token ids must be integers")
        n = len(prompt_token_ids)
        budget = self.output_budget(n, max_tokens)
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise ValueError(f"the prompt has {n} tokens, more than max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}: raise it or set enable_chunked_prefill=True")
        if self.num_blocks is not None and blocks_needed(n + 1, self.block_size) > self.num_blocks:
            raise ValueError(f"the prompt needs more KV blocks than the pool has ({self.num_blocks}): "
                             "raise num_blocks or kv_cache_memory_bytes, or shorten the prompt")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        return budget

    def check_params(self, params):
        """Raise ValueError for ``SamplingParams`` this engine cannot follow (the object checked the rest when
        it was made): token ids outside the vocabulary, options its configuration lacks."""
        vocab = self.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab}), got {params.stop_token_ids}")
        outside = sorted(t for t in params.logit_bias or () if t >= vocab)
        if outside:
            raise ValueError(f"logit_bias has token ids outside the vocabulary [0, {vocab}): {outside[:10]}")
        if self.speculative:
            from .logits_processors import needs_processing
            if needs_processing(params) or params.structured_outputs is not None:
                raise ValueError("logit_bias, penalties and structured outputs are not supported with speculative "
                                 "decoding here (its verification step does not apply them): leave them at their "
                                 "defaults")
        if params.kv_transfer_params is not None:  # chapter 07: a PD hand-off needs a connector that can follow it
            if not self.has_connector:
                raise ValueError("kv_transfer_params needs an engine with a KV connector (kv_transfer_config)")
            connector_class(self.connector).check_params(params.kv_transfer_params)
        if params.n > 1:  # chapter 03: samples fork after the prompt and copy shared blocks on write
            if self.num_blocks is None or params.kv_transfer_params is not None:
                raise ValueError("n > 1 (parallel samples) needs kv_cache='paged' and no kv_transfer_params")
            if self.speculative:
                raise ValueError("n > 1 (parallel samples) and speculative decoding do not go together here")
            if self.max_num_seqs is not None and params.n > self.max_num_seqs:
                raise ValueError(f"n={params.n} samples run together and need {params.n} sequence slots, but "
                                 f"max_num_seqs is {self.max_num_seqs}: ask for n <= {self.max_num_seqs}, or send "
                                 "several requests")

    def check_priority(self, priority):
        """Raise ValueError for a ``priority`` this engine would not honour: not a 64-bit integer, or not 0
        while the policy ignores priorities. Silently serving it first come, first served would hide the
        mistake, so vLLM refuses it too; the message starts with vLLM's own words (its v0 input processor
        raised them, and 0.32's protocol still promises "Any priority other than 0 will raise an error if
        the served model does not use priority scheduling"), so clients that match on them keep working."""
        integer = isinstance(priority, numbers.Integral) and not isinstance(priority, bool)
        if not integer or not -(1 << 63) <= priority < 1 << 63:
            raise ValueError(f"priority must be an integer (a signed 64-bit one; smaller is served first), "
                             f"got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled. Start the engine "
                             f"with scheduling_policy='priority' (serve: --scheduling-policy priority), or send "
                             f"priority 0 (this one's policy is {self.scheduling_policy!r})")
