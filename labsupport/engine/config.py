"""Engine options, with vLLM's names: one ``EngineConfig`` per engine, the one truth every part reads.

The scheduler reads it at every step, so a run-time change (chapter 04's ``max_num_seqs`` dial)
takes effect at the next step; it goes through ``LLMEngine.set_options``, which validates the
whole new configuration first. Options that size memory (``block_size``, ``num_blocks``,
``kv_cache``, ...) are fixed once the engine exists.
"""
from __future__ import annotations

from dataclasses import dataclass

RUNTIME_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                   "long_prefill_token_threshold", "scheduling_policy")


@dataclass
class EngineConfig:
    """Engine options, with vLLM's names. The scheduler reads this object at every step; change an
    option while the engine lives with ``LLMEngine.set_options``, which validates it first."""

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None  # default: the model's own context length, at most 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    kv_cache: str = "paged"  # "paged" (blocks, ch. 02), "contiguous" (per request, ch. 01), "none" (ch. 00)
    block_size: int = 16
    num_blocks: int | None = None  # default: as many as kv_cache_memory_bytes holds
    kv_cache_memory_bytes: int | None = None  # default: 1 GiB on CPU, 90% of free GPU memory
    enable_prefix_caching: bool = False
    cpu_offload_blocks: int = 0  # CPU tier for blocks evicted from the pool (needs prefix caching)
    enable_chunked_prefill: bool = False
    long_prefill_token_threshold: int = 0  # with chunked prefill: cap on one request's chunk per step (0: none)
    scheduling_policy: str = "continuous"  # or "static": the baseline of chapter 04

    def __post_init__(self):
        if self.kv_cache not in ("paged", "contiguous", "none"):
            raise ValueError(f"kv_cache must be 'paged', 'contiguous' or 'none', got {self.kv_cache!r}")
        if self.scheduling_policy not in ("continuous", "static"):
            raise ValueError(f"scheduling_policy must be 'continuous' or 'static', got {self.scheduling_policy!r}")
        non_negative = ("cpu_offload_blocks", "long_prefill_token_threshold")
        optional = ("num_blocks", "max_model_len", "kv_cache_memory_bytes")  # None: the engine picks
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size") + non_negative + optional:
            value, low = getattr(self, name), 0 if name in non_negative else 1
            if value is None and name in optional:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if (self.enable_prefix_caching or self.cpu_offload_blocks) and self.kv_cache != "paged":
            raise ValueError("prefix caching and the CPU tier need kv_cache='paged'")
        if self.enable_chunked_prefill and self.kv_cache == "none":
            raise ValueError("chunked prefill needs a KV cache (kv_cache='paged' or 'contiguous'): without one "
                             "a chunk's keys and values are gone before the next chunk needs them")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill=True")
        if self.cpu_offload_blocks and not self.enable_prefix_caching:
            raise ValueError("cpu_offload_blocks needs enable_prefix_caching=True: the CPU tier holds cached blocks")
