"""What the chapter 06 server exposes, as data: vLLM's metric names (after the prefix), help texts,
labels and histogram buckets, the few metrics that are ours alone, and the vLLM metrics we leave out
(``NOT_IMPLEMENTED``, with why).

Apart from ``metrics.py`` because it is the contract with vLLM, read as a table and checked against
vLLM's own list (``tests/test_metrics.py``); ``metrics.ServerMetrics`` builds its registry from it and
feeds it from the engine. Everything here is importable from ``labsupport.serve.metrics`` as before.
"""
from __future__ import annotations

PREFIX = "labsupport:"
LABELS = ("model_name", "engine")  # vLLM's: the served model name, the engine index (always "0" here)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason strings
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vLLM's sources
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")  # vLLM's CacheHitSource values
WAITING_REASONS = ("capacity", "deferred")  # vLLM's: queued for room; deferred (here: its KV on the way)
DEFAULT_MAX_MODEL_LEN = 8192  # the engine's default cap on max_model_len

# vLLM's bucket families (vllm/v1/metrics/buckets.py, v0.32.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10


# name (after the prefix) -> help text (vLLM's own, word for word, for vLLM's names)
GAUGES = {
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "kv_cache_free_blocks": "Free KV-cache blocks (cached blocks no request holds count as free); "
                            "0 without a paged KV cache.",  # ours
    "kv_requests_held": "Finished requests whose KV blocks wait for another engine's pull (chapter 07).",  # ours
}
COUNTERS = {  # prometheus_client appends _total on exposition, as for vLLM's
    "prompt_tokens": "Number of prefill tokens processed.",
    "generation_tokens": "Number of generation tokens processed.",
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "num_preemptions": "Cumulative number of preemption from the engine.",
    "prompt_tokens_cached": "Number of cached prompt tokens (local + external).",
    "prompt_tokens_computed": "Prompt tokens run through the model: prefix-cache hits excluded, "
                              "recomputation after a preemption counted again.",  # ours
    # ours, chapter 07's KV connector (0 without one)
    "kv_transfer_bytes_sent": "KV bytes other engines pulled from this one.",
    "kv_transfer_bytes_received": "KV bytes this engine pulled from others.",
    "kv_leases_expired": "Finished requests whose held KV blocks were freed unpulled when their lease expired.",
    "kv_loads_failed": "KV pulls that failed (then kv_load_failure_policy applied).",
}
SPEC_COUNTERS = {  # chapter 09's speculative decoding (vLLM's names and help; 0 without it)
    "spec_decode_num_drafts": "Number of spec decoding drafts.",
    "spec_decode_num_draft_tokens": "Number of draft tokens.",
    "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
}
COUNTERS |= SPEC_COUNTERS
CONNECTOR_COUNTERS = ("kv_transfer_bytes_sent", "kv_transfer_bytes_received", "kv_leases_expired", "kv_loads_failed")
LABELLED_COUNTERS = {  # name -> (help, extra label, its values)
    "request_success": ("Count of successfully processed requests.", "finished_reason", FINISH_REASONS),
    "prompt_tokens_by_source": ("Number of prompt tokens by source.", "source", PROMPT_TOKEN_SOURCES),
    # device: the KV pool's prefix cache; host: the CPU tier (chapter 03); p2p: another engine (chapter 07)
    "prompt_tokens_cached_by_source": ("Prefix-cache hit tokens by the cache tier that supplied them: "
                                       "device (local HBM), host (offloaded to DRAM), disk, p2p "
                                       "(transferred from another vLLM instance) or "
                                       "external_unspecified. Counted at admission; sums to "
                                       "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
                                       "source", CACHE_HIT_SOURCES),
}
LABELLED_GAUGES = {
    "num_requests_waiting_by_reason": ("Number of waiting requests by reason. "
                                       "Reason labels: 'capacity' = waiting for scheduling capacity; "
                                       "'deferred' = deferred by transient constraints "
                                       "(LoRA budget, KV transfer, blocked status). "
                                       "Sum of all reasons equals vllm:num_requests_waiting.",
                                       "reason", WAITING_REASONS),
}
# vLLM's info gauge (always 1): its labels are the engine's cache settings under vLLM's CacheConfig names
INFO = {"cache_config_info": "Information of the LLMEngine CacheConfig"}
CACHE_CONFIG_LABELS = ("block_size", "gpu_memory_utilization", "cache_dtype", "num_gpu_blocks_override",
                       "enable_prefix_caching", "num_gpu_blocks", "num_cpu_blocks", "kv_cache_memory_bytes", "engine")
HISTOGRAMS = {  # name -> (help, buckets; None: the request-token series up to max_model_len)
    "time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TIME_TO_FIRST_TOKEN_BUCKETS),
    "inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS),
    "request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.",
                                              INTER_TOKEN_LATENCY_BUCKETS),
    "e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    "request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.",
                                   REQUEST_LATENCY_BUCKETS),
    "request_inference_time_seconds": ("Histogram of time spent in RUNNING phase for request.",
                                       REQUEST_LATENCY_BUCKETS),
    "request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.",
                                     REQUEST_LATENCY_BUCKETS),
    "request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.",
                                    REQUEST_LATENCY_BUCKETS),
    "request_prompt_tokens": ("Number of prefill tokens processed.", None),
    "request_generation_tokens": ("Number of generation tokens processed.", None),
    "request_prefill_kv_computed_tokens": ("Histogram of new KV tokens computed during prefill "
                                           "(excluding cached tokens).", None),
    "request_num_preemptions": ("Histogram of the number of times a request was preempted.",
                                REQUEST_NUM_PREEMPTIONS_BUCKETS),
    "request_params_max_tokens": ("Histogram of the max_tokens request parameter.", None),
    # once per request when its last sample finishes (n = 1 too), as vLLM observes them for parallel sampling
    "request_params_n": ("Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS),
    "request_max_num_generation_tokens": ("Histogram of maximum number of requested generation tokens.", None),
    "iteration_tokens_total": ("Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS),
}
OWN = ("kv_cache_free_blocks", "prompt_tokens_computed", "kv_requests_held", *CONNECTOR_COUNTERS)  # ours: vLLM has no such metric

# vLLM metrics (names after "vllm:") we do not expose, and why
NOT_IMPLEMENTED = {
    "num_requests_kv_fetch_by_stage": "not tracked (kv_requests_held and num_requests_waiting are)",
    "engine_sleep_state": "no sleep mode",
    "corrupted_requests": "no NaN-in-logits detection",
    "watermark_requests": "no watermarking",
    "external_prefix_cache_queries": "not counted separately (prompt_tokens_by_source has external_kv_transfer)",
    "external_prefix_cache_hits": "not counted separately (prompt_tokens_by_source has external_kv_transfer)",
    "mm_cache_queries": "no multi-modal inputs",
    "mm_cache_hits": "no multi-modal inputs",
    "admission_rejections": "no queue limits in the frontend",
    "kv_block_lifetime_seconds": "no KV block residency sampling",
    "kv_block_idle_before_evict_seconds": "no KV block residency sampling",
    "kv_block_reuse_gap_seconds": "no KV block residency sampling",
    "lora_requests_info": "no LoRA",
}
