"""Where each mechanism of the course lives in vLLM: a map to read vLLM's source with, checked against it.

Chapter 08 reads vLLM as the production version of what chapters 00-07 built. Three tables:

* ``MECHANISMS``: a mechanism, our file and name, vLLM's file and name, and one line on how they differ;
* ``CONNECTOR_METHODS``: our ``KVConnectorBase`` (chapter 07) method for method against vLLM's
  ``KVConnectorBase_V1``, and where ``ExampleConnector`` and ``NixlConnector`` implement each one;
* ``NOT_IN_OURS``: what vLLM does that our engine does not, each with a pointer into vLLM and a pattern for its
  entry point that no code of ``labsupport/`` may match (``present_in_ours``).

A reference is ``"path:Name"``, ``"path:Class.member"`` or a bare path: vLLM's paths are relative to the
installed ``vllm`` package, ours to ``labsupport/``. vLLM moves fast (0.32 made NixlConnector a package
and an alias, and deprecated ``vllm.entrypoints.openai.api_server``), so a map written from memory would
rot silently. ``missing_paths()`` checks every reference against the installed source instead, without
importing vLLM (that needs its own torch, in its own venv): a scoped grep in which ``Class.member`` must
be a ``class``, ``def`` or assignment inside ``class Class``, so aliases (``NixlConnector =
NixlPullConnector``), config fields and enum members count, and a name elsewhere in the file does not.
"""
from __future__ import annotations

import functools
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KV = "distributed/kv_transfer/kv_connector/v1/"  # vLLM's KV connectors
NIXL = KV + "nixl/"
SCHED = "v1/core/sched/scheduler.py:Scheduler"
CHAT = "entrypoints/openai/chat_completion/"

# (mechanism, chapter, our references, vLLM's references, how they differ); references are space-separated
MECHANISMS = [dict(zip(("mechanism", "chapter", "ours", "vllm", "differs"), (m, ch, ours.split(), theirs.split(), d)))
              for m, ch, ours, theirs, d in [
    ("Offline entry point", "00", "llm.py:LLM.generate", "entrypoints/llm.py:LLM.generate",
     "same call shape; vLLM's LLM drives an EngineCore that may run in another process"),
    ("The engine step", "00", "engine/engine.py:LLMEngine.step",
     "v1/engine/core.py:EngineCore.step v1/engine/llm_engine.py:LLMEngine.step",
     "ours schedules, runs, updates and detokenizes in one loop; vLLM detokenizes in the front-end process"),
    ("A request and num_computed_tokens", "00", "engine/request.py:Request", "v1/request.py:Request",
     "the same one counter drives both; vLLM's also tracks speculative tokens, encoder inputs, streamed input"),
    ("Model runner", "00", "engine/runner.py:ModelRunner.execute",
     "v1/worker/gpu_model_runner.py:GPUModelRunner.execute_model v1/worker/cpu_model_runner.py:CPUModelRunner",
     "ours builds each step's tensors anew; vLLM keeps a persistent input batch and updates what changed"),
    ("Sampler", "00", "engine/sampler.py:Sampler.sample engine/request.py:SamplingParams",
     "sampling_params.py:SamplingParams v1/sample/sampler.py:Sampler v1/sample/ops/topk_topp_sampler.py:TopKTopPSampler "
     "v1/sample/logits_processor/builtin.py:MinTokensLogitsProcessor",
     "same order (temperature, top-k, top-p), raw logprobs, min_tokens; vLLM samples the whole batch at once and "
     "adds penalties, logit bias, structured outputs"),
    ("Incremental detokenizer", "00", "engine/detokenizer.py:IncrementalDetokenizer.update",
     "v1/engine/detokenizer.py:FastIncrementalDetokenizer tokenizers/detokenizer_utils.py:detokenize_incrementally",
     "same prefix/read offsets; vLLM uses the tokenizers library's DecodeStream when it can"),
    ("Llama model", "00", "models/llama.py:LlamaForCausalLM", "model_executor/models/llama.py:LlamaForCausalLM",
     "vLLM's layers are tensor-parallel and quantization-aware"),
    ("KV budget", "01", "engine/config.py:gpu_kv_cache_bytes kv_memory.py:kv_bytes_per_token",
     "v1/worker/gpu_worker.py:Worker.determine_available_memory v1/worker/cpu_worker.py:CPUWorker.determine_available_memory "
     "v1/core/kv_cache_utils.py:get_kv_cache_configs",
     "vLLM profiles a dummy forward pass for peak activations; ours estimates them from the model's widths"),
    ("Block pool and free list", "02", "engine/block_pool.py:BlockAllocator",
     "v1/core/block_pool.py:BlockPool v1/core/kv_cache_utils.py:FreeKVCacheBlockQueue v1/core/kv_cache_utils.py:KVCacheBlock",
     "both: reference counts, least recently freed first; vLLM's free list is a linked list of block objects"),
    ("Block table and slot mapping", "02", "engine/block_pool.py:slot_mapping",
     "v1/worker/block_table.py:BlockTable.compute_slot_mapping", "vLLM computes the whole batch's slots on the device"),
    ("KV cache manager", "02", "engine/kv_cache_manager.py:KVCacheManager.allocate",
     "v1/core/kv_cache_manager.py:KVCacheManager.allocate_slots v1/core/single_type_kv_cache_manager.py:FullAttentionManager",
     "vLLM manages groups of layers with different KV kinds (full, sliding window, Mamba); ours one group"),
    ("Paged attention", "02", "engine/paged_attention.py:PagedAttention kernels/cpu_attention.py:cpu_decode_attention "
     "kernels/cpu_attention.py:cpu_prefill_attention",
     "v1/attention/backends/cpu_attn.py:CPUAttentionBackendImpl v1/attention/backends/flash_attn.py:FlashAttentionImpl "
     "_custom_ops.py:reshape_and_cache_flash",
     "both read K/V in place through the block table; ours: on the CPU one C++ call per layer for the decode rows and "
     "one for every prompt and chunk, on a GPU Triton for decode rows; vLLM's one launch serves both kinds"),
    ("Triton decode kernel", "02", "kernels/triton_attention.py:triton_decode_attention",
     "v1/attention/ops/triton_unified_attention.py:unified_attention v1/attention/backends/triton_attn.py:TritonAttentionImpl",
     "vLLM's one kernel serves prefill and decode rows and splits long contexts into segments"),
    ("Prefix hashes", "03", "engine/prefix_cache.py:chain_hashes",
     "v1/core/kv_cache_utils.py:hash_block_tokens v1/core/kv_cache_utils.py:get_request_block_hasher",
     "both chain full blocks; vLLM trusts a SHA-256 hash (prefix_caching_hash_algo), ours also compares tokens"),
    ("Prefix-cache lookup", "03", "engine/kv_cache_manager.py:KVCacheManager.find_cached_prefix "
     "engine/prefix_cache.py:PrefixCache",
     "v1/core/kv_cache_manager.py:KVCacheManager.get_computed_blocks v1/core/block_pool.py:BlockHashToBlockMap",
     "both keep cached blocks on the free list until reused; on by default in both servers (off in our EngineConfig)"),
    ("cache_salt (tenants)", "03", "engine/prefix_cache.py:hash_block serve/guard.py:tenant_salt",
     f"v1/core/kv_cache_utils.py:generate_block_hash_extra_keys {CHAT}protocol.py:ChatCompletionRequest.cache_salt",
     "vLLM salts the first block only (the chain carries it); ours salts every block, and derives it from the API key"),
    ("CPU tier", "03", "engine/prefix_cache.py:CPUTier",
     f"{KV}offloading_connector.py:OffloadingConnector v1/kv_offload/cpu/manager.py:CPUOffloadingManager "
     "config/cache.py:CacheConfig.kv_offloading_size",
     "vLLM's is a KV connector that copies blocks out as they are computed; ours saves a block when it is evicted"),
    ("Continuous batching", "04", "engine/scheduler.py:Scheduler.schedule", f"{SCHED}.schedule",
     "the same rule: running requests first, then waiting ones while tokens, sequences and blocks allow"),
    ("Batch limits", "04", "engine/config.py:EngineConfig.max_num_seqs engine/config.py:EngineConfig.max_num_batched_tokens",
     "config/scheduler.py:SchedulerConfig.max_num_seqs config/scheduler.py:SchedulerConfig.max_num_batched_tokens",
     "vLLM picks defaults per device and usage context (EngineArgs.get_batch_defaults)"),
    ("Preemption by recompute", "04", "engine/scheduler.py:Scheduler.preempt", f"{SCHED}._preempt_request",
     "both free the last running request's blocks and requeue it at the front (with the priority policy: the least "
     "urgent one's, requeued at its place)"),
    ("Chunked prefill", "05", "engine/scheduler.py:chunk_rule engine/config.py:EngineConfig.long_prefill_token_threshold",
     "config/scheduler.py:SchedulerConfig.enable_chunked_prefill config/scheduler.py:SchedulerConfig.long_prefill_token_threshold",
     "on by default in vLLM, off in ours; vLLM can adapt the threshold (long_prefill_token_threshold_adaptive)"),
    ("Priority scheduling", "05", "engine/request_queue.py:PriorityQueue engine/request_queue.py:priority_order "
     "engine/scheduler.py:Scheduler._schedule engine/limits.py:EngineLimits.check_priority",
     "v1/core/sched/request_queue.py:PriorityRequestQueue v1/request.py:Request.__lt__ "
     "config/scheduler.py:SchedulerConfig.policy",
     "same order (priority, then arrival) and victim (the least urgent, newest running request); vLLM keeps a heap "
     "and takes a victim already scheduled back out of its step, ours a sorted list, and visits the running most "
     "urgent first; vLLM 0.32 no longer refuses a priority under fcfs, ours does, as its API docs promise"),
    ("CUDA graphs", "GPU", "kernels/cuda_graphs.py:DecodeGraphs kernels/cpu_decode_layers.py:CpuDecodeLayers",
     "v1/cudagraph_dispatcher.py:CudagraphDispatcher compilation/cuda_graph.py:CUDAGraphWrapper",
     "ours: full graphs of decode steps (on the CPU, one C++ call per layer instead); "
     "vLLM also captures piecewise graphs for mixed batches"),
    ("Fused kernels", "GPU", "kernels/triton_ops.py:triton_rope_qk kernels/cpu_ops.py:cpu_rope_qk "
     "kernels/cpu_ops.py:cpu_rms_norm kernels/cpu_ops.py:cpu_silu_mul models/llama.py:fuse_projections",
     "model_executor/layers/rotary_embedding/base.py:RotaryEmbedding model_executor/layers/layernorm.py:RMSNorm "
     "model_executor/layers/activation.py:SiluAndMul model_executor/layers/linear.py:QKVParallelLinear "
     "model_executor/custom_op.py:CustomOp", "vLLM's are CustomOps: compiled C++/CUDA kernels with a PyTorch fallback"),
    ("Frontend (prompt to tokens)", "06", "frontend.py:Frontend",
     "v1/engine/input_processor.py:InputProcessor renderers/hf.py:HfRenderer", "vLLM also renders multimodal inputs and tools"),
    ("Async engine", "06", "serve/core_client.py:EngineCoreClient serve/engine_core.py:EngineCore "
     "serve/request_stream.py:RequestStream serve/async_engine.py:AsyncEngine",
     "v1/engine/async_llm.py:AsyncLLM.generate v1/engine/core_client.py:AsyncMPClient v1/engine/core.py:EngineCoreProc "
     "v1/engine/output_processor.py:RequestOutputCollector",
     "both run the engine core in its own process, reached over ZMQ with msgpack; ours keeps chapter 06's "
     "engine-loop thread too (--engine-in-process)"),
    ("OpenAI API", "06", "serve/api.py:create_app serve/protocol.py:ChatCompletionRequest",
     f"{CHAT}serving.py:OpenAIServingChat {CHAT}protocol.py:ChatCompletionRequest entrypoints/launchers/app.py:build_app "
     "entrypoints/serve/instrumentator/health.py:health",
     "vLLM adds tools, reasoning, the Responses API; 0.32 moved the server to entrypoints/launchers"),
    ("API keys", "06", "serve/guard.py:Guard", "entrypoints/serve/middleware/authenticate.py:AuthenticationMiddleware",
     "the same bearer-token check"),
    ("Prometheus metrics", "06", "serve/metrics.py:ServerMetrics", "v1/metrics/loggers.py:PrometheusStatLogger",
     "ours exposes vLLM's metric names, under labsupport: instead of vllm:"),
    ("Serving benchmark and goodput", "06", "bench/serving/serve_bench.py:run_benchmark bench/serving/serve_bench.py:goodput "
     "bench/serving/serve_datasets.py:sample_requests",
     "benchmarks/serve.py:benchmark benchmarks/serve.py:calculate_metrics benchmarks/datasets/datasets.py:RandomDataset "
     "entrypoints/cli/benchmark/serve.py:BenchmarkServingSubcommand",
     "the same metrics (TTFT, TPOT, ITL, E2EL, goodput); `vllm bench serve` drives either server"),
    ("KV connector interface", "07", "engine/kv_connector.py:KVConnectorBase", f"{KV}base.py:KVConnectorBase_V1",
     "vLLM makes a scheduler-side and a worker-side instance (KVConnectorRole), often in two processes"),
    ("Pull connector", "07", "pd/connector.py:TcpConnector",
     f"{NIXL}connector.py:NixlConnector {NIXL}connector.py:NixlPullConnector {NIXL}pull_worker.py:NixlPullConnectorWorker",
     "NIXL reads remote blocks in place (RDMA, NVLink, UCX); ours copies them through a TCP socket"),
    ("Moving blocks", "07", "pd/kv_transfer.py:pack_blocks pd/kv_transfer.py:pull_blocks",
     f"{NIXL}base_worker.py:NixlBaseConnectorWorker.register_kv_caches {NIXL}pull_worker.py:NixlPullConnectorWorker.start_load_kv",
     "NIXL registers the KV memory once and reads block by block: no packing"),
    ("Leases on held blocks", "07", "pd/connector.py:TcpConnector.request_finished",
     f"{NIXL}pull_scheduler.py:NixlPullConnectorScheduler.request_finished {NIXL}base_scheduler.py:NixlBaseConnectorScheduler",
     "both 30 s by default (kv_lease_duration); waiting decode instances renew NIXL's with heartbeats"),
    ("Waiting for remote KV", "07", "engine/request.py:RequestStatus.WAITING_FOR_REMOTE_KVS "
     "engine/lifecycle.py:RequestLifecycle.poll_connector",
     f"v1/request.py:RequestStatus.WAITING_FOR_REMOTE_KVS {SCHED}._update_waiting_for_remote_kv",
     "the same status: the request holds blocks, not a batch slot"),
    ("kv_transfer_config", "07", "serve/server.py:kv_transfer_config",
     "config/kv_transfer.py:KVTransferConfig config/kv_transfer.py:KVTransferConfig.kv_load_failure_policy",
     "the same JSON; kv_load_failure_policy defaults to fail in vLLM, to recompute in ours"),
    ("PD proxy protocol", "07", "pd/router.py:Router.prefill", f"{CHAT}protocol.py:ChatCompletionRequest.kv_transfer_params",
     "vLLM's proxy is not in the wheel (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py in its repository); "
     "it forwards a prefill answer without kv_transfer_params; ours answers 502 unless --kv-params optional"),
    ("Load balancing", "07", "pd/routing.py:LeastLoaded", "v1/engine/core_client.py:DPLBAsyncMPClient",
     "vLLM balances data-parallel engines by waiting + running requests; prefix-aware routing is not in the wheel"),
    ("Penalties and logit bias", "00", "engine/logits_processors.py:Penalties engine/logits_processors.py:apply_logit_bias",
     "v1/sample/sampler.py:Sampler.apply_penalties v1/sample/logits_processor/builtin.py:LogitBiasLogitsProcessor",
     "the same order: logit bias, then the repetition, frequency and presence penalties"),
    ("Structured output", "08", "engine/structured_output.py:StructuredOutputs",
     "v1/structured_output/__init__.py:StructuredOutputManager v1/structured_output/backend_xgrammar.py:XgrammarBackend",
     "both compile the grammar with xgrammar and mask the tokens it forbids"),
    ("KV cache events", "08", "serve/kv_events.py:ZmqEventPublisher serve/kv_events.py:BlockStored",
     "distributed/kv_events.py:ZmqEventPublisher distributed/kv_events.py:BlockStored config/kv_events.py:KVEventsConfig",
     "the same wire format (msgpack over ZMQ PUB, a replay ROUTER), so vLLM's KVEventBatch decodes ours"),
    ("Speculative decoding", "09", "engine/spec_decode.py:Speculator engine/spec_decode.py:ngram_propose "
     "engine/spec_decode.py:rejection_sample",
     "v1/spec_decode/ngram_proposer.py:NgramProposer v1/spec_decode/eagle.py:EagleProposer "
     "v1/sample/rejection_sampler.py:RejectionSampler",
     "both verify k guesses in one pass; ours guesses by prompt lookup or a draft model, vLLM also by EAGLE"),
]]

# (our method, side, vLLM's name, whether ExampleConnector overrides it, NixlConnector's implementation, note)
CONNECTOR_METHODS = [
    {"ours": ours, "side": side, "vllm": f"{KV}base.py:KVConnectorBase_V1.{theirs}",
     "example": (f"{KV}example_connector.py:ExampleConnector." if own else f"{KV}base.py:KVConnectorBase_V1.") + theirs,
     "nixl": NIXL + nixl, "note": note}
    for ours, side, theirs, own, nixl, note in [
        ("get_num_new_matched_tokens", "scheduler", "get_num_new_matched_tokens", True,
         "pull_scheduler.py:NixlPullConnectorScheduler.get_num_new_matched_tokens",
         "vLLM may answer None (ask again later); ExampleConnector loads synchronously, NIXL asynchronously"),
        ("update_state_after_alloc", "scheduler", "update_state_after_alloc", True,
         "pull_scheduler.py:NixlPullConnectorScheduler.update_state_after_alloc",
         "vLLM passes KVCacheBlocks (one list per KV group), ours a list of block ids"),
        ("build_connector_meta", "scheduler", "build_connector_meta", True,
         "base_scheduler.py:NixlBaseConnectorScheduler.build_connector_meta", "the same: this step's loads"),
        ("request_finished", "scheduler", "request_finished", False,
         "pull_scheduler.py:NixlPullConnectorScheduler.request_finished",
         "ExampleConnector keeps the default (free at once, no kv_transfer_params); NIXL holds the blocks"),
        ("start_load_kv", "worker", "start_load_kv", True, "pull_worker.py:NixlPullConnectorWorker.start_load_kv",
         "vLLM binds the metadata first (bind_connector_metadata) and passes the forward context"),
        ("wait_for_layer_load", "worker", "wait_for_layer_load", True, "connector.py:NixlBaseConnector.wait_for_layer_load",
         "returns at once in both: neither loads layer by layer during the forward"),
        ("save_kv_layer", "worker", "save_kv_layer", True, "connector.py:NixlBaseConnector.save_kv_layer",
         "ExampleConnector writes each layer to a file; NIXL (pull) saves nothing"),
        ("wait_for_save", "worker", "wait_for_save", True, "connector.py:NixlBaseConnector.wait_for_save",
         "NIXL copies to a host buffer here when the device memory cannot be read remotely"),
        ("get_finished", "worker", "get_finished", False, "base_worker.py:NixlBaseConnectorWorker.get_transfer_results",
         "0.32 adds get_transfer_results (sends, receives and failures at once); get_finished wraps it"),
        ("get_failed_loads", "worker", "get_block_ids_with_load_errors", False,
         "base_worker.py:NixlBaseConnectorWorker.get_block_ids_with_load_errors",
         "vLLM reports the block ids that failed, ours the request ids with a reason"),
        ("close", "worker", "shutdown", False, "connector.py:NixlBaseConnector.shutdown", "renamed"),
    ]]
# our connector's methods that vLLM's base class has no counterpart of, and why they exist
CONNECTOR_OURS_ONLY = {"check_params": "refuses kv_transfer_params it could not follow when a request is made, so a "
                                       "bad field fails that request, not a step of others"}

# (feature, vLLM's references, what it is, a regex for its entry point in ours). Only what our engine lacks: each
# row's pattern must match no code of labsupport/ (strings and comments aside), which tests/test_source_map.py checks.
NOT_IN_OURS = [{"feature": f, "vllm": refs.split(), "what": what, "absent": absent} for f, refs, what, absent in [
    ("Piecewise CUDA graphs", "config/compilation.py:CUDAGraphMode compilation/cuda_graph.py:CUDAGraphWrapper",
     "graphs around everything but attention, so mixed prefill+decode steps replay too "
     "(ours replays decode-only steps: kernels/cuda_graphs.py)", r"(?i)piecewise|CUDAGraphMode"),
    ("torch.compile", "compilation/decorators.py:support_torch_compile compilation/backends.py:VllmBackend",
     "the model's graph compiled once, with fusion passes", r"torch\.compile\b|support_torch_compile"),
    ("FlashAttention, FlashInfer, fused MoE", "v1/attention/backends/flash_attn.py:FlashAttentionImpl "
     "v1/attention/backends/flashinfer.py:FlashInferImpl model_executor/layers/fused_moe/fused_moe.py:fused_experts",
     "attention libraries and fused expert kernels (ours: its own C++ kernels on the CPU, Triton on a GPU)",
     r"(?i)\bflash_?attn\b|flashinfer|fused_experts|fused_moe"),
    ("Async scheduling", "v1/core/sched/async_scheduler.py:AsyncScheduler", "plans step n+1 while step n runs",
     r"AsyncScheduler|async_scheduling"),
    ("RDMA and cluster-store KV connectors", f"{NIXL}connector.py:NixlPushConnector "
     f"{KV}mooncake/mooncake_connector.py:MooncakeConnector {KV}lmcache_connector.py:LMCacheConnectorV1 "
     f"{KV}multi_connector.py:MultiConnector",
     "RDMA/NVLink transfers, a cluster-wide KV store, several connectors at once (ours: one TCP pull connector)",
     r"(?i)nixl_?(?:push_?)?connector|mooncake|lmcache|MultiConnector"),
    ("Disk and remote KV tiers", f"{KV}offloading_connector.py:OffloadingConnector v1/kv_offload/tiering/manager.py",
     "evicted KV kept on disk or in a remote store too (ours: one CPU tier, cpu_offload_blocks, chapter 03)",
     r"(?i)disk|OffloadingConnector|kv_offload"),
    ("Hybrid KV cache", "v1/core/kv_cache_coordinator.py:HybridKVCacheCoordinator "
     "v1/core/single_type_kv_cache_manager.py:SlidingWindowManager v1/core/single_type_kv_cache_manager.py:MambaManager",
     "sliding-window and state-space layers beside full attention", r"(?i)sliding_?window|mamba"),
    ("Tensor, pipeline and expert parallelism", "distributed/parallel_state.py:initialize_model_parallel "
     "model_executor/layers/linear.py:ColumnParallelLinear model_executor/layers/linear.py:RowParallelLinear",
     "one model split over several GPUs (ours: one model per process; replicas behind chapter 07's router)",
     r"torch\.distributed|tensor_parallel|pipeline_parallel|all_reduce|ParallelLinear"),
    ("fp8 weights and KV cache", "model_executor/layers/quantization/fp8.py:Fp8LinearMethod "
     "config/cache.py:CacheConfig.cache_dtype",
     "8-bit floating-point weights and KV (ours: weight-only int8 and int4; KV in the model's dtype)",
     r"(?i)float8|\bfp8\b|cache_dtype"),
    ("LoRA", "lora/model_manager.py:LoRAModelManager lora/punica_wrapper/punica_base.py:PunicaWrapperBase",
     "many adapters in one batch", r"\blora_request\b|LoRA[A-Z]\w*|enable_lora|max_loras"),
    ("Multimodal", "multimodal/registry.py:MultiModalRegistry v1/core/encoder_cache_manager.py:EncoderCacheManager",
     "images, audio and video through encoders", r"(?i)multi_?modal|pixel_values|image_url|encoder_cache"),
    ("Tool-call and reasoning parsers", "tool_parsers/abstract_tool_parser.py:ToolParser "
     "reasoning/abs_reasoning_parsers.py:ReasoningParser",
     "per-model parsers of the output (ours refuses a request that needs one, as vllm serve without them does)",
     r"ToolParser|ReasoningParser|tool_call_parser|reasoning_parser"),
    ("Responses API", "entrypoints/openai/responses/serving.py:OpenAIServingResponses",
     "POST /v1/responses (ours serves /v1/chat/completions and /v1/completions)", r"/v1/responses|ServingResponses"),
    ("Beam search", "entrypoints/generate/beam_search/offline.py:BeamSearchOfflineMixin.beam_search",
     "the k most likely sequences kept at every step", r"(?i)beam"),
    ("Sleep mode", "v1/engine/core.py:EngineCore.sleep", "weights and KV memory released, and taken back later",
     r"\bdef\s+sleep\b|\bwake_up\b|sleep_mode"),
]]


def vllm_root(venv: str | Path | None = None) -> Path | None:
    """The installed ``vllm`` package in ``.venv-vllm`` (or ``venv``), found on disk: importing it would need its torch."""
    venvs = [Path(venv)] if venv else [root / ".venv-vllm" for root in (REPO, Path.cwd())]
    for v in venvs:
        for package in sorted(v.glob("lib/python3*/site-packages/vllm")):
            if (package / "__init__.py").is_file():
                return package
    return None


def vllm_version(root: Path | None = None) -> str | None:
    """The installed vLLM's version, read from its ``_version.py``."""
    version_file = (root or vllm_root() or Path("/nonexistent")) / "_version.py"
    match = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)",
                      version_file.read_text() if version_file.is_file() else "")
    return match.group(1) if match else None


def vllm_refs() -> list[str]:
    """Every vLLM reference of the three tables, once each."""
    refs = [r for row in MECHANISMS for r in row["vllm"]]
    refs += [row[k] for row in CONNECTOR_METHODS for k in ("vllm", "example", "nixl")]
    refs += [r for row in NOT_IN_OURS for r in row["vllm"]]
    return list(dict.fromkeys(refs))


def our_refs() -> list[str]:
    return list(dict.fromkeys(r for row in MECHANISMS for r in row["ours"]))


@functools.lru_cache(maxsize=None)
def _lines(path: Path) -> tuple[str, ...]:
    return tuple(path.read_text(encoding="utf-8").splitlines())


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _find(lines, start: int, end: int, indent: int, name: str) -> int | None:
    """The line of ``lines[start:end]``, at exactly ``indent``, that defines ``name`` (class, def, assignment)."""
    n = re.escape(name)
    pattern = re.compile(rf"\s*(?:(?:async\s+)?def|class)\s+{n}\b|\s*{n}\s*(?::|=(?!=))")
    return next((i for i in range(start, end) if _indent(lines[i]) == indent and pattern.match(lines[i])), None)


def _body(lines, header: int) -> tuple[int, int, int]:
    """(first line, end, indentation) of the block opened at ``header``; it ends at the next statement
    indented no deeper than the header (a closing bracket of a long signature does not count)."""
    indent = _indent(lines[header])
    end = next((i for i in range(header + 1, len(lines))
                if lines[i].strip() and _indent(lines[i]) <= indent and re.match(r"\s*[A-Za-z_@]", lines[i])), len(lines))
    colon = next((i for i in range(header, end) if lines[i].split("#")[0].rstrip().endswith(":")), header)
    inner = next((_indent(lines[i]) for i in range(colon + 1, end) if lines[i].strip()), indent + 4)
    return colon + 1, end, inner


def ref_problem(ref: str, root: Path) -> str | None:
    """Why ``ref`` does not resolve under ``root``, or None when it does."""
    path, _, name = ref.partition(":")
    file = root / path
    if not file.exists():
        return f"{ref}: no {path} in {root}"
    if not name:
        return None
    if not file.is_file():
        return f"{ref}: {path} is a folder; it cannot define {name}"
    lines = _lines(file)
    start, end, indent, scope = 0, len(lines), 0, path
    for part in name.split("."):
        found = _find(lines, start, end, indent, part)
        if found is None:
            return f"{ref}: no class, def or assignment named {part!r} in {scope}"
        (start, end, indent), scope = _body(lines, found), f"{scope}:{part}" if scope == path else f"{scope}.{part}"
    return None


def missing(refs, root: Path) -> list[str]:
    return [problem for ref in refs if (problem := ref_problem(ref, root))]


def missing_paths(root: Path | None = None) -> list[str]:
    """Every cited vLLM path and name the installed vLLM lacks: an empty list means the map is right."""
    root = root or vllm_root()
    if root is None:
        raise FileNotFoundError("vLLM is not installed in .venv-vllm: `make vllm-env` installs it")
    return missing(vllm_refs(), root)


def missing_ours() -> list[str]:
    """Every cited labsupport path and name this repository lacks."""
    return missing(our_refs(), REPO / "labsupport")


def code_only(source: str) -> str:
    """``source`` with its strings and comments blanked: a docstring that names vLLM's mechanism is not the mechanism."""
    lines = source.splitlines(keepends=True)
    blank = {tokenize.STRING, tokenize.COMMENT} | {getattr(tokenize, n) for n in ("FSTRING_MIDDLE",) if hasattr(tokenize, n)}
    for tok in reversed(list(tokenize.generate_tokens(io.StringIO(source).readline))):
        if tok.type in blank:
            (r0, c0), (r1, c1) = tok.start, tok.end
            if r0 == r1:
                lines[r0 - 1] = lines[r0 - 1][:c0] + " " * (c1 - c0) + lines[r0 - 1][c1:]
            else:
                lines[r0 - 1] = lines[r0 - 1][:c0] + "\n"
                for r in range(r0, r1 - 1):
                    lines[r] = "\n"
                lines[r1 - 1] = " " * c1 + lines[r1 - 1][c1:]
    return "".join(lines)


def present_in_ours(pattern: str, root: Path | None = None) -> list[str]:
    """``file:line`` of every match of ``pattern`` in the code (not the strings or comments) of ``root``'s .py files,
    this map aside (it names every mechanism); empty means ours has no such entry point."""
    root = root or REPO / "labsupport"
    found = []
    for file in sorted(root.rglob("*.py")):
        if file.resolve() == Path(__file__).resolve():
            continue
        for number, line in enumerate(code_only(file.read_text(encoding="utf-8")).splitlines(), 1):
            if re.search(pattern, line):
                found.append(f"{file.relative_to(root)}:{number}: {line.strip()[:100]}")
    return found


def _cell(value, column: str) -> str:
    items = value if isinstance(value, list) else [value]
    code = isinstance(value, list) or column == "ours" or re.fullmatch(r"[\w/.]+\.py(:[\w.]+)?", str(value))
    return "<br>".join(f"`{v}`" if code else str(v) for v in items).replace("|", "\\|")


def as_markdown(table: list[dict], columns: list[str] | None = None) -> str:
    """A table as Markdown (``IPython.display.Markdown(as_markdown(MECHANISMS))``); references in code style."""
    columns = columns or list(table[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(_cell(row[c], c) for c in columns) + " |" for row in table])
