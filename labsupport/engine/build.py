"""How an engine's parts are built from its configuration: the KV manager and attention backend
that go together, the default pool's size, the draft model and speculator of chapter 09.

Kept apart from ``engine.py`` so the engine file reads as the loop it runs; everything here runs
once, in ``LLMEngine.__init__``.
"""
from __future__ import annotations

import json

import torch

from ..kernels import select
from ..kernels.cpu_decode_layers import CpuDecodeLayers
from ..kernels.cuda_graphs import DecodeGraphs
from ..models.loader import device_memory, load_model
from .attention import ContiguousAttention, RecomputeAttention
from .config import CPU_KV_CACHE_BYTES, EngineConfig, gpu_kv_cache_bytes
from .kv_cache_manager import ContiguousKVManager, KVCacheManager, KVManager
from .paged_attention import PagedAttention
from .prefix_cache import CPUTier
from .spec_decode import DraftModelProposer, Speculator


def kv_and_backend(c: EngineConfig, model, device, draft_model=None):
    """The KV manager (who owns which memory) and the attention backend (how it is read) of ``kv_cache``:
    "none" recomputes, "contiguous" reserves a whole sequence, "paged" hands out blocks."""
    cfg, dtype = model.config, next(model.parameters()).dtype
    if c.kv_cache == "none":
        return KVManager(), RecomputeAttention()
    if c.kv_cache == "contiguous":
        kv = ContiguousKVManager(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, device,
                                 c.max_model_len, budget_bytes=c.kv_cache_memory_bytes)
        return kv, ContiguousAttention(kv)
    num_blocks = c.num_blocks or blocks_in_budget(c, [model] + ([draft_model] if draft_model else []), device, dtype)
    backend = PagedAttention(cfg.num_layers, num_blocks, c.block_size, cfg.num_kv_heads, cfg.head_dim,
                             dtype, device, scratch_block=uses_cuda_graphs(c, device, cfg.head_dim),
                             cpu_kernel=c.cpu_decode_kernel)
    cpu_tier = (CPUTier(c.cpu_offload_blocks, backend.k_pool, backend.v_pool, c.block_size)
                if c.cpu_offload_blocks else None)
    kv = KVCacheManager(num_blocks, c.block_size, enable_prefix_caching=c.enable_prefix_caching, cpu_tier=cpu_tier)
    kv.copy_block = backend.copy_block  # copy-on-write (parallel samples, chapter 03)
    return kv, backend


def blocks_in_budget(c: EngineConfig, models: list, device, dtype) -> int:
    """Blocks of the default pool: as many as ``kv_cache_memory_bytes`` holds; without it, on a GPU,
    what ``gpu_memory_utilization`` leaves (``gpu_kv_cache_bytes``), on the CPU ``CPU_KV_CACHE_BYTES``.
    A draft model's pool has as many blocks (the same ids), so a block costs every model's bytes."""
    per_block = sum(2 * m.config.num_layers * m.config.num_kv_heads * m.config.head_dim for m in models) \
        * dtype.itemsize * c.block_size
    budget = c.kv_cache_memory_bytes
    if budget is None and torch.device(device).type == "cuda":
        weights = sum(t.numel() * t.element_size() for m in models for t in [*m.parameters(), *m.buffers()])
        budget = gpu_kv_cache_bytes(c, models[0].config, weights, per_block, *device_memory(device))
    elif budget is None:
        budget = CPU_KV_CACHE_BYTES
    if budget < per_block:
        raise ValueError(f"kv_cache_memory_bytes={budget} holds no block of {per_block} bytes")
    return budget // per_block


def uses_cuda_graphs(c: EngineConfig, device, head_dim: int | None = None) -> bool:
    """Decode steps replay CUDA graphs on a GPU with the Triton kernel, unless ``enforce_eager``. Not without the
    kernel, or for a head or block size it does not serve: the PyTorch path a graph would replay gathers every
    row's blocks up to ``max_model_len`` (its shapes must not change between replays), far slower than eager."""
    if torch.device(device).type != "cuda" or c.enforce_eager or c.kv_cache != "paged":
        return False
    from ..kernels import triton_attention
    return triton_attention.available(device) and (head_dim is None
                                                   or triton_attention.kernel_applies(head_dim, c.block_size))


def uses_cpu_decode_layers(c: EngineConfig, device, backend, model) -> bool:
    """Small decode steps run a C++ call per layer on a CPU whose decode kernel is built, in float32, unless
    ``enforce_eager`` (built here, once per machine, as the other kernels; ``kernels/cpu_decode_layers.py``)."""
    if (torch.device(device).type != "cpu" or c.enforce_eager or c.kv_cache != "paged" or not c.cpu_decode_kernel
            or not getattr(backend, "k_pool", None)):
        return False
    return CpuDecodeLayers.applies(model, backend)


def step_executor(c: EngineConfig, model, backend, device):
    """How the runner runs a step's forward on this device, chosen once: CUDA graphs where the backend was made
    for them (``uses_cuda_graphs``), the CPU's C++ decode layers where they apply, else None (the Python layers).
    Graphs are recorded here, for every batch up to ``max_num_seqs``, before the engine serves anything and
    before a KV connector starts its threads (``kernels/cuda_graphs.py`` says why); they follow ``c``, the
    engine's live config, when ``max_num_seqs`` is raised (``follow_options``)."""
    if getattr(backend, "scratch_slot", None) is not None:
        graphs = DecodeGraphs(model, backend, c.max_num_seqs, c.max_model_len, config=c)
        graphs.capture_all()
        return graphs
    if uses_cpu_decode_layers(c, device, backend, model):
        return CpuDecodeLayers(model, backend)
    return None


def follow_options(executor):
    """What the engine's ``RuntimeOptions.watch`` gets for its step executor: CUDA graphs re-recorded when
    ``max_num_seqs`` is raised (chapter 04's dial), at the change rather than inside the next timed step;
    None for an executor that no option sizes."""
    return getattr(executor, "follow", None)


def model_kernels(model, device):
    """The model's kernels for its device and dtype (``kernels/select.py``), given to it once, here."""
    model.use_kernels(select.select(device, next(model.parameters()).dtype))


def chunk_cost_context(c: EngineConfig, cfg) -> int:
    """``chunk_cost_context="auto"`` (the server's default): the context length at which a prompt token's
    attention costs as many FLOPs as its products, from the model's widths. Per layer a token's products
    take 2 x (its projections' and MLP's weights) FLOPs and its attention 4 x heads x head_dim per earlier
    token (scores and the weighted sum), so K = weights per layer / (2 x heads x head_dim): 3,072 for
    SmolLM2-135M (576 wide, 9 heads of 64), about 26,000 for Llama-3.1-8B, where attention matters much
    later. How closely the lab's CPU kernels follow the FLOPs is measured in ``benchmarks/README.md`` (a long
    prompt beside decoding streams)."""
    if c.chunk_cost_context != "auto":
        return c.chunk_cost_context
    if not c.enable_chunked_prefill:
        return 0
    width = cfg.num_heads * cfg.head_dim
    kv_width = cfg.num_kv_heads * cfg.head_dim
    weights = cfg.hidden_size * (2 * width + 2 * kv_width) + 3 * cfg.hidden_size * cfg.intermediate_size
    return max(1, round(weights / (2 * width)))


def load_draft(c: EngineConfig, model, device):
    """The draft model of ``speculative_config`` (None for prompt lookup or no speculation)."""
    spec = c.speculative_config
    if not spec or spec["method"] != "draft_model":
        return None
    draft, _, _ = load_model(spec["model"], device, next(model.parameters()).dtype)
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                         f"target's ({model.config.vocab_size}): choose a draft of the same tokenizer")
    return draft


def speculator(c: EngineConfig, kv, backend, sampler, model, draft_model, device) -> Speculator:
    """Prompt lookup needs nothing more; a draft model gets its own KV pool with the target's block ids."""
    if draft_model is None:
        return Speculator(c.speculative_config, kv)
    cfg, dtype = draft_model.config, next(model.parameters()).dtype
    pool = PagedAttention(cfg.num_layers, backend.num_blocks, c.block_size, cfg.num_kv_heads, cfg.head_dim,
                          dtype, device, cpu_kernel=c.cpu_decode_kernel)
    return Speculator(c.speculative_config, kv, DraftModelProposer(draft_model, pool, sampler))


def eos_token_ids(tokenizer, model_path) -> set[int]:
    """The tokenizer's EOS and those of the checkpoint's ``generation_config.json`` (often several)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = model_path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
