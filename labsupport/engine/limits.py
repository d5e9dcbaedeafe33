"""What a prompt must satisfy to run on an engine, as data that can cross a process boundary.

A prompt the engine could never run (longer than the context, more blocks than the pool holds,
a token outside the vocabulary) must be refused before it is queued, with a message that says
what to change: found later, inside a step, it would fail the step's other requests too. When
the server's engine runs in a process of its own (``serve/engine_core.py``), the frontend that
tokenizes and answers 400 has no engine to ask; the engine core sends it these limits once at
start-up instead, and both sides call the same ``check_prompt``, so there is one rule.
"""
from __future__ import annotations

from dataclasses import dataclass

from .block_pool import blocks_needed
from .kv_connector import connector_class


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

    @property
    def has_connector(self) -> bool:
        return self.connector is not None

    def check_prompt(self, prompt_token_ids: list[int]):
        """Raise ValueError, saying what to change, for a prompt this engine can never run."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
            raise ValueError("prompt token ids must be integers")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but max_model_len is {self.max_model_len}: shorten the "
                             "prompt or raise max_model_len")
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise ValueError(f"the prompt has {n} tokens, more than max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}: raise it or set enable_chunked_prefill=True")
        if self.num_blocks is not None and blocks_needed(n + 1, self.block_size) > self.num_blocks:
            raise ValueError(f"the prompt needs more KV blocks than the pool has ({self.num_blocks}): "
                             "raise num_blocks or kv_cache_memory_bytes, or shorten the prompt")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")

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
