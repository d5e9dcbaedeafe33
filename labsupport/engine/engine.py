"""LLMEngine: one loop tells the whole story. ``step()`` = schedule -> run -> postprocess.

``add_request`` checks and queues; ``step`` runs one forward pass for the scheduled batch and
appends one token to every sequence it finished feeding; requests that hit EOS, a stop string,
``max_tokens`` or the context length leave at once. ``last_step`` keeps the engine's own record
of the step (a ``StepRecord``), which timelines and tests read instead of guessing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.loader import load_model, resolve_device
from .attention import ContiguousAttention, RecomputeAttention
from .blocks import KVCacheManager, blocks_needed
from .paged_attention import PagedAttention
from .prefix_cache import CPUTier
from .request import Request, RequestOutput, SamplingParams
from .runner import ModelRunner
from .scheduler import Scheduler


@dataclass
class StepRecord:
    """What one step did, for timelines and tests: the engine's own account, not a reconstruction."""

    index: int
    start: float  # time.perf_counter() before scheduling
    end: float  # after the forward pass and sampling
    scheduled: dict[str, tuple[int, bool]]  # request id -> (tokens fed, was it prefill rather than a decode)
    running: list[str]  # the running list after scheduling: the batch's slots
    waiting: list[str]  # still queued, in queue order
    preempted: list[str]  # sent back to the queue this step
    finished: list[str]  # left this step


@dataclass
class EngineConfig:
    """Engine options, with vLLM's names."""

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
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if (self.enable_prefix_caching or self.cpu_offload_blocks) and self.kv_cache != "paged":
            raise ValueError("prefix caching and the CPU tier need kv_cache='paged'")
        if self.long_prefill_token_threshold < 0 or (self.long_prefill_token_threshold
                                                     and not self.enable_chunked_prefill):
            raise ValueError("long_prefill_token_threshold must be >= 0 and needs enable_chunked_prefill=True")
        if self.cpu_offload_blocks and not self.enable_prefix_caching:
            raise ValueError("cpu_offload_blocks needs enable_prefix_caching=True: the CPU tier holds cached blocks")


class LLMEngine:
    def __init__(self, config: EngineConfig, backend=None):
        self.config = config
        self.device = resolve_device(config.device)
        self.model, self.tokenizer, self.model_path = load_model(config.model, self.device, config.dtype)
        limit = self.model.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or min(limit, 8192), limit)
        self.eos_token_ids = self._eos_token_ids()
        self.kv = None
        self.backend = backend or self._make_backend()
        self.runner = ModelRunner(self.model, self.backend, self.device)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.kv,
                                   config.enable_chunked_prefill, config.scheduling_policy,
                                   config.long_prefill_token_threshold)
        self.counters = {"prompt_tokens_computed": 0, "generation_tokens": 0, "num_steps": 0}
        self.last_step: StepRecord | None = None

    def _make_backend(self):
        cfg, c = self.model.config, self.config
        dtype = next(self.model.parameters()).dtype
        if c.kv_cache == "none":
            return RecomputeAttention()
        if c.kv_cache == "contiguous":
            return ContiguousAttention(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, self.device,
                                       self.max_model_len)
        num_blocks = c.num_blocks or self._blocks_in_budget(dtype)
        backend = PagedAttention(cfg.num_layers, num_blocks, c.block_size, cfg.num_kv_heads, cfg.head_dim,
                                 dtype, self.device)
        cpu_tier = (CPUTier(c.cpu_offload_blocks, backend.k_pool, backend.v_pool, c.block_size)
                    if c.cpu_offload_blocks else None)
        self.kv = KVCacheManager(num_blocks, c.block_size, enable_prefix_caching=c.enable_prefix_caching,
                                 cpu_tier=cpu_tier)
        return backend

    def _blocks_in_budget(self, dtype) -> int:
        cfg = self.model.config
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            budget = int(0.9 * torch.cuda.mem_get_info()[0]) if self.device.type == "cuda" else 1 << 30
        per_block = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize * self.config.block_size
        if budget < per_block:
            raise ValueError(f"kv_cache_memory_bytes={budget} holds no block of {per_block} bytes")
        return budget // per_block

    def use_block_allocator(self, allocator):
        """Swap in another block allocator (chapter 02's exercise) while the engine is idle."""
        if self.kv is None or self.has_unfinished_requests():
            raise ValueError("the engine must be idle and use kv_cache='paged'")
        self.kv.allocator = allocator

    def _eos_token_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        gen = self.model_path / "generation_config.json"
        if gen.exists():
            import json
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return ids

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None,
                    cache_salt: str | None = None) -> Request:
        self.check_prompt(prompt_token_ids)
        req = Request(prompt_token_ids, params, request_id, prompt, cache_salt)
        self.scheduler.add(req)
        return req

    def check_prompt(self, prompt_token_ids: list[int]):
        """Raise ValueError, saying what to change, for a prompt this engine can never run."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is "
                             f"{self.max_model_len}: shorten the prompt or raise max_model_len")
        if not self.config.enable_chunked_prefill and len(prompt_token_ids) > self.config.max_num_batched_tokens:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, more than max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens}: raise it or set enable_chunked_prefill=True")
        if self.kv is not None and blocks_needed(len(prompt_token_ids) + 1, self.kv.block_size) > self.kv.num_blocks:
            raise ValueError(f"the prompt needs more KV blocks than the pool has ({self.kv.num_blocks}): "
                             "raise num_blocks or kv_cache_memory_bytes, or shorten the prompt")
        vocab = self.model.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One forward pass. Returns the requests that received a token (finished ones included)."""
        began = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        scheduled = {r.request_id: (n, not (n == 1 and r.num_computed_tokens == r.num_tokens - 1))
                     for r, n in zip(batch.requests, batch.num_new_tokens)}
        running = [r.request_id for r in self.scheduler.running]
        tokens = self.runner.execute(batch)
        now = time.perf_counter()
        self.counters["num_steps"] += 1
        touched = []
        for req, n, token in zip(batch.requests, batch.num_new_tokens, tokens):
            done_feeding = req.num_computed_tokens + n == req.num_tokens
            # prompt tokens that went through the model this step (recompute counts them every step)
            start = req.num_computed_tokens
            self.counters["prompt_tokens_computed"] += max(0, min(len(req.prompt_token_ids), start + n) - start)
            req.num_computed_tokens = req.num_computed_tokens + n if self.backend.keeps_kv else 0
            if self.kv is not None:
                self.kv.cache_full_blocks(req)
            if done_feeding:  # a partial prompt chunk samples nothing
                self._append_token(req, token, now)
                touched.append(req)
        self.last_step = StepRecord(self.counters["num_steps"] - 1, began, time.perf_counter(), scheduled, running,
                                    [r.request_id for r in self.scheduler.waiting],
                                    [r.request_id for r in self.scheduler.preempted_this_step],
                                    [r.request_id for r in touched if r.is_finished])
        return touched

    def _append_token(self, req: Request, token: int, now: float):
        req.output_token_ids.append(token)
        self.counters["generation_tokens"] += 1
        req.metrics.token_times.append(now)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        reason = None
        if token in self.eos_token_ids and not req.params.ignore_eos:
            reason = "stop"
        elif any(s in req.text for s in req.params.stop):
            cut = min(req.text.find(s) for s in req.params.stop if s in req.text)
            req.text, reason = req.text[:cut], "stop"
        elif len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason:
            req.metrics.finished_time = now
            self._release(req, reason)

    def _release(self, req: Request, reason: str):
        self.scheduler.finish(req, reason)  # frees its KV blocks
        self.backend.free(req)
        self.runner.sampler.release(req)

    def abort(self, req: Request):
        """Drop a request (a client went away): it leaves the queues and frees what it held."""
        if not req.is_finished:
            req.metrics.finished_time = time.perf_counter()
            self._release(req, "abort")

    @staticmethod
    def output(req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.text,
                             list(req.output_token_ids), req.finish_reason, req.metrics)

    def stats(self) -> dict:
        kv = {"kv_blocks_total": self.kv.num_blocks, "kv_blocks_free": self.kv.allocator.num_free,
              "block_size": self.kv.block_size, **self.kv.counters,
              "cpu_tier_blocks": len(self.kv.cpu_tier) if self.kv.cpu_tier else 0} if self.kv else {}
        return {
            **kv,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            **self.counters,
        }
