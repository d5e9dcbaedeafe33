"""``LLM``: the offline entry point, shaped like vLLM's so the habits carry over.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct, device="auto"
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))

A prompt is a string (used as is), a chat message list (the chat template is applied), or a
dict ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``; a dict may carry ``"cache_salt"``
(the tenant: requests with different salts share no cached KV and no cached results).

``enable_result_cache=True`` puts an exact-match result cache in front of the engine
(``labsupport.serve.result_cache``); ``generate(..., use_result_cache=False)`` bypasses it.
"""
from __future__ import annotations

from tqdm.auto import tqdm

import time

from .engine.engine import EngineConfig, LLMEngine
from .engine.request import RequestOutput, SamplingParams, next_request_id
from .serve.result_cache import ResultCache, is_deterministic, result_key


def is_chat(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


class LLM:
    def __init__(self, model: str | None = None, device: str = "auto", enable_result_cache: bool = False,
                 result_cache_size: int = 1024, result_cache_ttl_s: float = 600.0, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, device=device, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_path.name
        self.result_cache = ResultCache(result_cache_size, result_cache_ttl_s) if enable_result_cache else None

    def tokenize(self, prompt) -> tuple[list[int], str | None]:
        """Return ``(token_ids, text)`` for any accepted prompt form."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), None
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
        if is_chat(prompt):
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False).input_ids, text
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids, prompt
        raise ValueError(f"a prompt is a string, a chat message list or a dict, not {type(prompt).__name__}")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, use_result_cache: bool = True) -> list[RequestOutput]:
        single = isinstance(prompts, (str, dict)) or is_chat(prompts)
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams: give one, or one per prompt")
        # tokenize and check everything before queueing anything, so a bad prompt loses nothing
        encoded = [self.tokenize(p) for p in prompts]
        for ids, _ in encoded:
            self.engine.check_prompt(ids)
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        cache = self.result_cache if use_result_cache else None
        keys = [result_key(self.model_name, ids, sp, salt) if cache is not None and is_deterministic(sp) else None
                for (ids, _), sp, salt in zip(encoded, params, salts)]
        cached = [cache.get(k) if k else None for k in keys]
        requests = [None if hit else self.engine.add_request(ids, sp, prompt=text, cache_salt=salt)
                    for (ids, text), sp, salt, hit in zip(encoded, params, salts, cached)]
        bar = tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm)
        bar.update(sum(hit is not None for hit in cached))
        while self.engine.has_unfinished_requests():
            done = sum(r.is_finished for r in self.engine.step())
            bar.update(done)
        bar.close()
        outputs = []
        for req, hit, key in zip(requests, cached, keys):
            if hit is not None:
                outputs.append(self._from_result_cache(hit))
            else:
                out = self.engine.output(req)
                if key and out.finish_reason in ("stop", "length"):
                    cache.put(key, out.copy())  # a copy: the caller may change what it got
                outputs.append(out)
        return outputs

    @staticmethod
    def _from_result_cache(out: RequestOutput) -> RequestOutput:
        """A copy of the cached answer, with its own id and timings: it arrived and finished now."""
        now = time.perf_counter()
        metrics = type(out.metrics)(arrival_time=now, first_scheduled_time=now, first_token_time=now,
                                    finished_time=now, token_times=[now] * len(out.token_ids))
        return out.copy(request_id=next_request_id(), metrics=metrics, cached=True)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True):
        """One conversation (a message list) or several: the chat template is applied to each."""
        convs = [messages] if is_chat(messages) else list(messages)
        return self.generate(convs, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        hits = self.result_cache.hits if self.result_cache is not None else 0
        return {**self.engine.stats(), "result_cache_hits": hits}
