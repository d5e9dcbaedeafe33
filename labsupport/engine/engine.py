"""LLMEngine: one loop tells the whole story. ``step()`` = schedule -> run -> update -> detokenize.

The scheduler decides what runs (it holds the queues, and the lifecycle that writes a request's state); the
runner turns its decision into one forward pass and one sampled token per sequence; the scheduler's lifecycle
(``scheduler.lifecycle.update_from_output``) moves the requests forward and frees the finished;
the detokenizers turn new tokens into new text and find stop strings. ``last_step`` is the step's ``SchedulerOutput``, the engine's own record.
``clock`` (``time.perf_counter`` unless the engine was assembled with another, as ``sim/`` does with a virtual
one) stamps every time the engine records: a request's arrival, admission, tokens and finish, a step's start and end.

A step that raises (a bug, or an attendee's plugged-in function) fails only the requests it
touched (finish reason ``"error"``, memory freed), then re-raises: the engine keeps serving.
What a chapter may change on a live engine (options, the attendee's pieces) is in ``plug_points.py``.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import torch

from ..kernels import cpu_ops
from ..models.loader import load_model, resolve_device
from ..kernels import cpu_memory
from . import build
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, catch_up
from .kv_cache_manager import ContiguousKVManager, KVCacheManager
from .limits import EngineLimits
from .paged_attention import PagedAttention
from .kv_connector import make_connector
from .plug_points import PlugRegistry, RuntimeOptions
from .request import Request, RequestOutput, SamplingParams
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerOutput
from .structured_output import StructuredOutputs

log = logging.getLogger(__name__)

class LLMEngine:
    clock = staticmethod(time.perf_counter)  # every time the engine records comes from here (see the module's doc)

    def __init__(self, config: EngineConfig):
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":  # activations reuse their pages instead of faulting fresh ones in each step
            cpu_memory.keep_freed_memory()
            cpu_ops.build()  # RoPE and products in C++ (kernels/cpu_ops.py); else PyTorch's
        self.model, self.tokenizer, self.model_path = load_model(config.model, self.device, config.dtype)
        self.quantization_report = None  # chapter 09: weights quantized before memory is sized and graphs captured
        if config.quantization is not None:
            from ..models.quantize import quantize_model
            self.quantization_report = quantize_model(self.model, config.quantization)
        limit = self.model.config.max_position_embeddings
        self.config = dataclasses.replace(config, max_model_len=min(config.max_model_len or min(limit, 8192), limit),
                                          chunk_cost_context=build.chunk_cost_context(config, self.model.config))
        self.draft_model = build.load_draft(self.config, self.model, self.device)  # ch. 09: its KV shares the pool
        for model in (self.model, self.draft_model) if self.draft_model else (self.model,):
            build.model_kernels(model, self.device)  # the device's kernels (kernels/select.py), chosen once
        self.kv, self.backend = build.kv_and_backend(self.config, self.model, self.device, self.draft_model)
        self.runner = ModelRunner(self.model, self.backend, self.device,
                                  build.step_executor(self.config, self.model, self.backend, self.device))
        self.connector = None  # chapter 07: KV to and from other engines (kv_transfer_config, kv_connector.py)
        if self.config.kv_transfer_config is not None:
            self.connector = make_connector(self.config.kv_transfer_config, self.backend)
            self.backend.attach_connector(self.connector)  # its per-layer hooks run around each layer's attention
        self.scheduler = Scheduler(self.config, self.kv, build.eos_token_ids(self.tokenizer, self.model_path),
                                   connector=self.connector, clock=self.clock)
        self.speculator = (build.speculator(self.config, self.kv, self.backend, self.runner.sampler, self.model,
                                            self.draft_model, self.device)
                           if self.config.speculative_config else None)  # chapter 09
        self.structured_outputs = self.runner.sampler.structured = StructuredOutputs(  # grammars compile on first use
            self.tokenizer, self.model.config.vocab_size, self.scheduler.lifecycle.eos_token_ids)
        self._finish_assembly(self.model.config.vocab_size)
        follow = build.follow_options(self.runner.executor)  # CUDA graphs re-recorded when max_num_seqs is raised
        if follow is not None:
            self.runtime_options.watch(follow)

    @classmethod
    def from_parts(cls, config: EngineConfig, kv, runner, vocab_size: int, eos_token_ids=(), clock=time.perf_counter,
                   connector=None):
        """An engine around parts made elsewhere, with no model loaded: ``sim/`` steps the real scheduler, KV
        manager and lifecycle with a runner that returns tokens without computing them, on a virtual ``clock``.
        ``config`` must be resolved (``max_model_len`` set); the engine gives token ids only (no tokenizer).
        ``connector``: a KV connector (a simulated one moves no bytes), handed to the scheduler as ``__init__`` does."""
        self = cls.__new__(cls)
        self.device, self.clock = torch.device("cpu"), clock
        self.model = self.tokenizer = self.model_path = self.draft_model = self.quantization_report = None
        self.config = dataclasses.replace(config, detokenize=False)
        self.kv, self.backend, self.runner, self.connector, self.speculator = kv, None, runner, connector, None
        self.scheduler = Scheduler(self.config, kv, eos_token_ids, connector=connector, clock=clock)
        self.structured_outputs = None
        self._finish_assembly(vocab_size)
        return self

    def _finish_assembly(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        # what a chapter may change on this live engine (plug_points.py); the runner's one point is the acceptance
        # rule of speculative decoding, a point only where a speculator runs
        self.runtime_options = RuntimeOptions(self.config)
        self.plug_points = PlugRegistry(self.scheduler, self.backend, self.kv, self.runner if self.speculator else None,
                                        self.connector, describe=f"this engine (kv_cache={self.config.kv_cache!r})")
        self.num_steps = 0
        self.last_step: SchedulerOutput | None = None

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None,
                    cache_salt: str | None = None, prompt_checked: bool = False, priority: int = 0,
                    arrival_time: float | None = None) -> Request:
        """Queue a request; raises ValueError, saying what to change, for one this engine cannot run.
        ``prompt_checked``: the caller ran ``check_prompt`` on this engine already (``Frontend.prepare``
        does, before anything is queued), so the prompt is checked once on its way in. ``priority``: with
        ``scheduling_policy="priority"``, smaller is served first (ties: the earlier arrival); any other
        policy refuses a priority other than 0 rather than ignore it. It is an argument here and a field of
        the request, not a sampling parameter, as in vLLM (``LLMEngine.add_request(..., priority=0)``):
        it says when the request runs, not what it generates. ``arrival_time``: when the user sent it, on the
        engine's ``clock`` (a driver replaying arrivals gives it); default now."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if prompt_checked:
            self.check_alive()  # what check_prompt would also have said
        else:
            self.check_prompt(prompt_token_ids)
        self.check_params(params)
        self.limits.check_priority(priority)
        if isinstance(self.kv, ContiguousKVManager) and self.kv.budget_bytes is not None:
            need = self.kv.reservation_bytes(len(prompt_token_ids), params.max_tokens)
            if need > self.kv.budget_bytes:
                raise ValueError(f"this request reserves {need:,} bytes of KV (prompt + max_tokens), more than "
                                 f"kv_cache_memory_bytes={self.kv.budget_bytes:,}: lower max_tokens or raise the budget")
        req = Request(prompt_token_ids, params, request_id, prompt, cache_salt, self.scheduler.lifecycle.eos_token_ids,
                      int(priority), self.clock() if arrival_time is None else arrival_time)
        if params.structured_outputs is not None:  # compiled here, in the engine: a failure is this request's error
            self.structured_outputs.add(req)
        if self.config.detokenize:
            self.detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                                       params.stop, params.min_tokens)
        self.scheduler.add_request(req)
        return req

    @property
    def limits(self) -> EngineLimits:
        """What a request must satisfy here, read afresh (chunked prefill can change on a live engine)."""
        paged = isinstance(self.kv, KVCacheManager)
        return EngineLimits(self.max_model_len, self.vocab_size, self.config.max_num_batched_tokens,
                            self.config.enable_chunked_prefill, self.kv.num_blocks if paged else None,
                            self.kv.block_size if paged else None, self.connector and self.connector.name,
                            self.speculator is not None, self.config.max_num_seqs,
                            self.config.scheduling_policy)

    def check_params(self, params: SamplingParams):
        """Raise ValueError for sampling parameters this engine cannot follow (``EngineLimits.check_params``:
        ``n > 1`` among them; SamplingParams checked the rest when it was made)."""
        self.limits.check_params(params)

    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int | None = None) -> int:
        """Raise ValueError, saying what to change, for a prompt this engine can never run; else the output
        budget (``EngineLimits.check_prompt``)."""
        self.check_alive()
        return self.limits.check_prompt(prompt_token_ids, max_tokens)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_pending_transfers(self) -> bool:
        """KV still on its way to or from another engine: ``step()`` must keep being called to finish it."""
        return self.scheduler.has_pending_transfers()

    # ------------------------------------------------------------------ what a chapter changes (plug_points.py)

    def set_options(self, **changes) -> dict:
        """Change scheduling options of a live engine (chapter 04's ``max_num_seqs`` dial); returns the old values."""
        return self.runtime_options.set(**changes)

    def options(self, **changes):
        """``with engine.options(max_num_seqs=4): ...``: every run-time option is as before on exit."""
        return self.runtime_options.changed(**changes)

    def plug(self, **pieces) -> dict:
        """Put the attendee's pieces in; returns those they replaced. Prefer ``plugged``, which puts them back."""
        return self.plug_points.swap(pieces)

    def plugged(self, **pieces):
        """``with engine.plugged(schedule_fn=my_schedule): ...`` runs the engine on the attendee's pieces and puts
        its own back on exit, also when the attendee's code raised. Requests still in flight at exit ran on the
        plugged pieces; with a swapped allocator they are aborted (their blocks are the plugged one's)."""
        return self.plug_points.plugged(pieces, before_restore=self._abort_on_allocator_restore)

    def _abort_on_allocator_restore(self, names: set[str]):
        if "block_allocator" in names and self.kv.tables:
            self.abort_requests(list(self.kv.tables.values()))

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[Request]:
        """One forward pass. Returns the requests that received a token (finished ones included)."""
        self.check_alive()
        began = self.clock()
        out = None
        try:
            out = self.scheduler.schedule()                               # policy: who runs, how many tokens
            if self.connector is not None:                                # KV to fetch for requests parked now
                self.connector.start_load_kv(self.connector.build_connector_meta(out))
            if not out.requests:
                return []
            sampled = self.runner.execute(out)                            # mechanism: one forward pass
            got_token = self.scheduler.lifecycle.update_from_output(out, sampled)  # bookkeeping: requests move on
            if self.config.detokenize:
                self.detokenize(got_token, out)                           # new text, stop strings
            else:                                                         # the caller detokenizes (serve/core_client.py)
                for req in got_token:
                    if req.is_finished:
                        self._forget(req)
            if self.speculator is not None:                               # chapter 09: the next guesses
                self.speculator.propose([r for r in got_token if not r.is_finished],
                                        self.scheduler.lifecycle.longest)
        except BaseException as exc:
            self._fail_step(out, exc)
            raise
        out.index, out.start, out.end = self.num_steps, began, self.clock()
        self.num_steps += 1
        self.last_step = out
        return got_token

    def detokenize(self, requests: list[Request], out: SchedulerOutput):
        """New text for each request's new token; a stop string ends the request here."""
        for req in requests:
            detok = self.detokenizers.get(req.request_id)
            if detok is None:  # a sample forked from an n > 1 request (chapter 03): its first token
                detok = self.detokenizers[req.request_id] = IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, req.params.stop, req.params.min_tokens)
            cut = catch_up(detok, req.output_token_ids, req.num_new_output_tokens, req.is_finished, req.finish_reason)
            stopped = cut is not None
            if stopped:
                self.scheduler.lifecycle.drop_tokens_after(req, cut)
            req.text = detok.text  # the engine owns detokenization: the text is the detokenizer's, as it stands
            if stopped and not req.is_finished:
                self.scheduler.lifecycle.finish(req, "stop")
                out.finished.append(req)
            if req.is_finished:
                self._forget(req)

    def _fail_step(self, out: SchedulerOutput | None, exc: BaseException):
        """Fail the requests of a step that raised; the others, and the engine, go on.

        Which requests a failed *schedule* touched is unknown, so then the running ones fail (the
        head of the queue if none runs): every failed step finishes at least one request, and a
        policy that always raises cannot hang a server."""
        interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
        victims = list(out.requests) if out is not None and out.requests else list(self.scheduler.running)
        if not victims and self.scheduler.waiting and not interrupted:
            victims = [self.scheduler.waiting[0]]
        if not interrupted:
            log.error("engine step failed (%s: %s); failing %d requests", type(exc).__name__, exc, len(victims))
        self.abort_requests(victims, "abort" if interrupted else "error")

    def abort_requests(self, requests: list[Request], reason: str = "abort", with_samples: bool = True):
        """Finish requests now (a client went away, ``generate`` was interrupted): their memory is freed.
        An ``n > 1`` request's samples go with it, unless ``with_samples=False``: the engine core ends one
        sample at its stop string (sample 0 is the request itself) while the others go on."""
        samples = [sample for r in requests for sample in r.samples] if with_samples else []
        for req in [*requests, *samples]:
            if not req.is_finished:
                self.scheduler.lifecycle.finish(req, reason)
            self._forget(req)

    def abort(self, req: Request):
        self.abort_requests([req])

    is_shut_down = False  # set by shutdown(): the engine's memory is returned and it takes no more work

    def shutdown(self):
        """Abort unfinished requests and return the engine's memory now: the KV pool (and CPU tier, or
        contiguous caches) and the engine's reference to the model, whose weights go once no other
        engine shares them. Idempotent; afterwards ``add_request`` and ``step`` raise RuntimeError."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        try:
            queues = self.scheduler.queues
            self.abort_requests([*queues.running, *queues.waiting, *queues.loading.values()])
        finally:  # even if a plugged piece raised while freeing: the memory goes
            if self.connector is not None:
                self.connector.close()  # no more pulls of this pool
            if isinstance(self.backend, PagedAttention):
                self.backend.k_pool, self.backend.v_pool = [], []
            if isinstance(self.kv, ContiguousKVManager):
                self.kv.caches.clear()
            if isinstance(self.kv, KVCacheManager):
                self.kv.cpu_tier = None  # its views would keep the pool alive
            self.model = self.runner.model = self.runner.executor = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            else:  # the pool's pages back to the system now, not kept by malloc for a pool that never returns
                cpu_memory.release_freed_memory()

    def check_alive(self):
        if self.is_shut_down:
            raise RuntimeError("this engine was shut down; create a new LLM")

    def _forget(self, req: Request):
        self.detokenizers.pop(req.request_id, None)
        self.runner.sampler.release(req)
        if self.speculator is not None:
            self.speculator.release(req)

    @staticmethod
    def output(req: Request, with_samples: bool = True) -> RequestOutput:
        """The request as the API sees it; logprobs only for a request that asked for them. The server
        streams each sample as a choice of its own, so it asks without the samples (``with_samples=False``)."""
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.text,
                             list(req.output_token_ids), req.finish_reason, req.metrics,
                             logprobs=None if req.params.logprobs is None else list(req.logprobs.output),
                             prompt_logprobs=None if req.logprobs.prompt is None else list(req.logprobs.prompt),
                             num_cached_tokens=req.metrics.num_cached_tokens, kv_transfer_params=req.remote_kv.transfer_params,
                             samples=[LLMEngine.output(sample) for sample in req.samples] if with_samples else [])

    def stats(self) -> dict:
        queues = self.scheduler.queues
        pd = {} if self.connector is None else {**self.connector.counters, "kv_requests_held": len(queues.held),
                                                "kv_requests_loading": len(queues.loading)}
        return {**self.kv.stats(), **self.scheduler.stats(), "num_steps": self.num_steps, **pd}

