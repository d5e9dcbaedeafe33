"""``LLM``: the offline entry point, shaped like vLLM's so the habits carry over.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct, device="auto"
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))

A prompt is a string (used as is), a chat message list (the chat template is applied), or a
dict ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``; a dict may carry ``"cache_salt"``
(the tenant: requests with different salts share no cached KV and no cached results).

``enable_result_cache=True`` puts an exact-match result cache in front of the engine
(``labsupport.result_cache``); ``generate(..., use_result_cache=False)`` bypasses it.
``with llm.plugged(schedule_fn=...)`` runs the engine on an exercise's piece for a while.
``llm.shutdown()`` returns the engine's memory at once (engines of one model share its weights).

One ``generate`` at a time per ``LLM``: each call steps the engine until its own requests finish, and
two calls from two threads would step it at once (the scheduler's state is not made for that: one
call crashed, the other got ``finish_reason="error"``). A second concurrent call raises instead,
pointing at ``AsyncEngine``, which serves any number of concurrent callers from one engine loop.
"""
from __future__ import annotations

import threading
import time

from tqdm.auto import tqdm

from .engine.config import EngineConfig
from .engine.engine import LLMEngine
from .engine.request import RequestOutput, SamplingParams
from .frontend import Frontend, is_chat
from .result_cache import ResultCache


class LLM:
    def __init__(self, model: str | None = None, device: str = "auto", enable_result_cache: bool = False,
                 result_cache_size: int = 1024, result_cache_ttl_s: float = 600.0, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, device=device, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_path.name
        self.result_cache = ResultCache(result_cache_size, result_cache_ttl_s) if enable_result_cache else None
        self.frontend = Frontend(self.engine, self.model_name, self.result_cache)
        self._generating = threading.Lock()  # held by the one generate() running

    def tokenize(self, prompt) -> tuple[list[int], str | None]:
        """Return ``(token_ids, text)`` for any accepted prompt form."""
        return self.frontend.tokenize(prompt)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, use_result_cache: bool = True,
                 priority: int | list[int] | None = None) -> list[RequestOutput]:
        """Run the prompts to completion and return their outputs in order. ``priority``: one for every prompt,
        or one per prompt, as vLLM's ``LLM.generate`` takes it; only with ``scheduling_policy="priority"``
        (smaller first).

        Every prompt is checked before any is queued, so a bad one loses nothing. If the call
        raises or is interrupted (the notebook's stop button), the requests it added are aborted
        and their memory freed: the next call runs only its own.

        Raises RuntimeError if another thread is inside ``generate`` on this LLM (see the module's docstring)."""
        if not self._generating.acquire(blocking=False):
            raise RuntimeError(
                "LLM.generate is already running in another thread on this LLM: an LLM steps its engine for one "
                "caller at a time. For concurrent callers, serve it: labsupport.serve.async_engine.AsyncEngine "
                "(behind create_app / `python -m labsupport serve`) batches them all in one engine loop; or give "
                "each thread its own LLM (they share the weights)")
        try:
            return self._generate(prompts, sampling_params, use_tqdm, use_result_cache, priority)
        finally:
            self._generating.release()

    def _generate(self, prompts, sampling_params, use_tqdm, use_result_cache, priority) -> list[RequestOutput]:
        self.engine.check_alive()
        single = isinstance(prompts, (str, dict)) or is_chat(prompts)
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams: give one, or one per prompt")
        priority = [priority or 0] * len(prompts) if priority is None or isinstance(priority, int) else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities: give one per prompt")
        prepared = [self.frontend.prepare(p, sp, use_result_cache=use_result_cache, priority=pr)
                    for p, sp, pr in zip(prompts, params, priority)]
        requests = []
        try:
            requests = [None if p.cached else self.frontend.submit(p) for p in prepared]
            mine = [r for r in requests if r is not None]
            ids = {r.request_id for r in mine}
            with tqdm(total=len(prompts), desc="Generating", unit="req", disable=not use_tqdm) as bar:
                bar.update(len(prompts) - len(mine))
                while not all(r.is_finished and all(c.is_finished for c in r.samples) for r in mine):
                    got = self.engine.step()
                    bar.update(sum(r.is_finished and r.request_id in ids for r in got))
                    if not got and self.engine.has_pending_transfers():
                        time.sleep(0.001)  # KV on its way from another engine (chapter 07): let it land
        except BaseException:
            self.engine.abort_requests([r for r in requests if r is not None])
            raise
        return [p.cached or self.frontend.complete(p, r) for p, r in zip(prepared, requests)]

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True):
        """One conversation (a message list) or several: the chat template is applied to each."""
        convs = [messages] if is_chat(messages) else list(messages)
        return self.generate(convs, sampling_params, use_tqdm=use_tqdm)

    def plugged(self, **pieces):
        """``with llm.plugged(schedule_fn=schedule): ...``: see ``LLMEngine.plugged``."""
        return self.engine.plugged(**pieces)

    def reset_prefix_cache(self) -> bool:
        """Forget the KV prefix cache (device and CPU tier), as vLLM's ``LLM.reset_prefix_cache``: False, and
        nothing forgotten, while a request holds blocks (``KVCacheManager.reset_prefix_cache``)."""
        return self.engine.kv.reset_prefix_cache()

    def shutdown(self):
        """Abort unfinished requests and return this LLM's memory now (KV cache, its hold on the weights):
        ``LLMEngine.shutdown``. Idempotent; a later ``generate`` raises RuntimeError. An ``LLM`` that
        is simply dropped (``del llm``) frees the same memory once the last reference to it goes."""
        self.engine.shutdown()

    def stats(self) -> dict:
        hits = self.result_cache.hits if self.result_cache is not None else 0
        return {**self.engine.stats(), "result_cache_hits": hits}
