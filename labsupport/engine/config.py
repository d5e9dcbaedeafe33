"""Engine options, with vLLM's names: one ``EngineConfig`` per engine, the one truth every part reads.

The scheduler reads it at every step, so a run-time change (chapter 04's ``max_num_seqs`` dial)
takes effect at the next step; it goes through ``LLMEngine.set_options``, which validates the
whole new configuration first. Options that size memory (``block_size``, ``num_blocks``,
``kv_cache``, ...) are fixed once the engine exists.
"""
from __future__ import annotations

from dataclasses import dataclass

from .request_queue import POLICIES

CPU_KV_CACHE_BYTES = 1 << 30  # the default KV budget on the CPU (on a GPU: gpu_memory_utilization)

POLICY_ALIASES = {"fcfs": "continuous"}  # vLLM's name for first come, first served: its habit works here too

RUNTIME_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                   "long_prefill_token_threshold", "scheduling_policy")


@dataclass
class EngineConfig:
    """Engine options, with vLLM's names. The scheduler reads this object at every step; change an
    option while the engine lives with ``LLMEngine.set_options``, which validates it first.

    The KV pool's size (``kv_cache="paged"``): ``num_blocks`` if given, else as many blocks as
    ``kv_cache_memory_bytes`` holds, else a default budget. On a GPU that default follows vLLM's
    ``gpu_memory_utilization``: the fraction of the device's *total* memory this engine may use
    for its weights, an activation reserve (estimated from ``max_num_batched_tokens`` and the
    model's widths) and its KV cache; the KV cache gets what is left. Our default is 0.2, not
    vLLM's 0.92: a chapter runs two to four engines in one kernel and may start vLLM beside them,
    so each engine takes a fifth of the device (four engines leave a fifth for anything else;
    give vLLM its own ``gpu_memory_utilization`` of at most what is left). The engine raises
    ValueError, naming the option to change, if the share cannot hold the weights or one
    ``max_model_len`` sequence, or if less memory is free than the share needs. On the CPU the
    default budget is a fixed 1 GiB (``CPU_KV_CACHE_BYTES``), and ``gpu_memory_utilization`` is unused.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None  # default: the model's own context length, at most 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    kv_cache: str = "paged"  # "paged" (blocks, ch. 02), "contiguous" (per request, ch. 01), "none" (ch. 00)
    block_size: int = 16
    num_blocks: int | None = None  # wins over both below; default: as many as the KV budget holds
    kv_cache_memory_bytes: int | None = None  # the KV budget in bytes; wins over gpu_memory_utilization
    gpu_memory_utilization: float = 0.2  # GPU only: this engine's share of the device's *total* memory
    enable_prefix_caching: bool = False
    cpu_offload_blocks: int = 0  # CPU tier for blocks evicted from the pool (needs prefix caching)
    enable_chunked_prefill: bool = False
    long_prefill_token_threshold: int = 0  # with chunked prefill: cap on one request's chunk per step (0: none)
    chunk_cost_context: int | str = 0  # with chunked prefill, 0: off. A prompt token that attends to c earlier tokens
    # takes 1 + c / chunk_cost_context of the step's token budget (Scheduler.step_cost): late in a long prompt its
    # attention, not its products, is what makes a step long, so a late chunk is smaller. "auto" (the server's
    # default): from the model's widths (build.chunk_cost_context). Without chunked prefill it does nothing
    scheduling_policy: str = "continuous"  # first come, first served (vLLM's "fcfs"); "static": the baseline of
    # chapter 04; "priority": vLLM's, a request's priority (add_request) first, then its arrival (request_queue.py)
    enforce_eager: bool = False  # True: every layer from Python; else a GPU replays decode steps from CUDA graphs
    # (kernels/cuda_graphs.py) and a CPU runs small float32 decode steps a C++ call a layer (kernels/cpu_decode_layers.py)
    kv_transfer_config: dict | None = None  # chapter 07: a KV connector, as vLLM's --kv-transfer-config
    speculative_config: dict | None = None  # chapter 09: {"method": "ngram"|"draft_model", ...}, as vLLM's
    quantization: str | None = None  # chapter 09: weight-only "int8" (per channel) or "int4" (groups of 32)
    detokenize: bool = True  # False: text and stop strings are the caller's (the server's frontend process does
    # them for its engine-core process, as vLLM V1's API server does); the engine gives token ids only
    cpu_decode_kernel: bool = True  # CPU, paged, float32: attention read in place by compiled C++ kernels, the
    # decode rows' and the prefills' (kernels/cpu_attention.py)

    def __post_init__(self):
        if self.kv_cache not in ("paged", "contiguous", "none"):
            raise ValueError(f"kv_cache must be 'paged', 'contiguous' or 'none', got {self.kv_cache!r}")
        self.scheduling_policy = POLICY_ALIASES.get(self.scheduling_policy, self.scheduling_policy)
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES} (or vLLM's 'fcfs', which is "
                             f"'continuous'), got {self.scheduling_policy!r}")
        non_negative = ("cpu_offload_blocks", "long_prefill_token_threshold", "chunk_cost_context")
        optional = ("num_blocks", "max_model_len", "kv_cache_memory_bytes")  # None: the engine picks
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size") + non_negative + optional:
            value, low = getattr(self, name), 0 if name in non_negative else 1
            if value is None and name in optional or (name == "chunk_cost_context" and value == "auto"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or isinstance(util, bool) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1] of the GPU's total memory, "
                             f"got {util!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "cpu_decode_kernel", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if (self.enable_prefix_caching or self.cpu_offload_blocks) and self.kv_cache != "paged":
            raise ValueError("prefix caching and the CPU tier need kv_cache='paged'")
        if self.enable_chunked_prefill and self.kv_cache == "none":
            raise ValueError("chunked prefill needs a KV cache (kv_cache='paged' or 'contiguous'): without one "
                             "a chunk's keys and values are gone before the next chunk needs them")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill=True")
        if self.kv_transfer_config is not None and (not isinstance(self.kv_transfer_config, dict)
                                                    or self.kv_cache != "paged"):
            raise ValueError("kv_transfer_config must be a dict (vLLM's --kv-transfer-config) and needs kv_cache='paged'")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be None, 'int8' or 'int4' (weight-only), got {self.quantization!r}")
        if self.speculative_config is not None:
            from .spec_decode import check_speculative_config
            self.speculative_config = check_speculative_config(self.speculative_config)
            if self.kv_cache != "paged" or self.kv_transfer_config is not None:
                raise ValueError("speculative decoding needs kv_cache='paged' (guesses are verified through the "
                                 "paged KV cache) and no kv_transfer_config")
        if self.cpu_offload_blocks and not self.enable_prefix_caching:
            raise ValueError("cpu_offload_blocks needs enable_prefix_caching=True: the CPU tier holds cached blocks")


def gpu_kv_cache_bytes(c: EngineConfig, model, weight_bytes: int, per_block: int, free: int, total: int) -> int:
    """vLLM's rule for the default KV budget on a GPU: the engine's share of the device's *total*
    memory (``gpu_memory_utilization``), less its weights and an activation reserve.

    ``model`` is the ``ModelConfig``; ``c.max_model_len`` must be set (the engine's resolved config);
    ``free``/``total`` are the device's bytes (``device_memory``). Weights shared with another engine
    count for each (a safe overestimate). The reserve is a few float32 [tokens, width] tensors of the
    largest step (``max_num_batched_tokens``) and its logits. Raises ValueError, naming the option to
    change, when the share cannot hold the weights and one ``max_model_len`` sequence, or when less
    memory is free than the share asks for."""
    gib = 2**30
    share = int(c.gpu_memory_utilization * total)
    width = 2 * model.hidden_size + 2 * model.intermediate_size + (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    reserve = 4 * (c.max_num_batched_tokens * width + c.max_num_seqs * model.vocab_size)
    kv_bytes = share - weight_bytes - reserve
    one_seq = -(-c.max_model_len // c.block_size) * per_block
    said = (f"gpu_memory_utilization={c.gpu_memory_utilization} gives this engine {share / gib:.2f} GiB of the device's "
            f"{total / gib:.2f} GiB; its weights take {weight_bytes / gib:.2f} GiB, activations {reserve / gib:.2f} GiB")
    if kv_bytes <= 0:
        raise ValueError(f"{said}: nothing is left for the KV cache. Raise gpu_memory_utilization "
                         "(or lower max_num_batched_tokens), or give kv_cache_memory_bytes or num_blocks")
    if kv_bytes < one_seq:
        raise ValueError(f"{said}, leaving {kv_bytes / gib:.2f} GiB for the KV cache, but one sequence of "
                         f"max_model_len={c.max_model_len} tokens needs {one_seq / gib:.2f} GiB. Raise "
                         "gpu_memory_utilization or lower max_model_len, or give kv_cache_memory_bytes or num_blocks")
    if kv_bytes + reserve > free:
        raise ValueError(f"{said}, its KV cache {kv_bytes / gib:.2f} GiB, but only {free / gib:.2f} GiB of the device "
                         "is free (other engines or processes hold the rest). Lower gpu_memory_utilization, or free "
                         "memory: llm.shutdown() an engine you no longer need")
    return kv_bytes
