"""``LLM``: the offline entry point, shaped like vLLM's so the habits carry over.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct, device="auto"
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))

A prompt is a string (used as is), a chat message list (the chat template is applied), or a
dict ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``.
"""
from __future__ import annotations

from tqdm.auto import tqdm

from .engine.engine import EngineConfig, LLMEngine
from .engine.request import RequestOutput, SamplingParams


def is_chat(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


class LLM:
    def __init__(self, model: str | None = None, device: str = "auto", **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, device=device, **engine_options))
        self.tokenizer = self.engine.tokenizer

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
                 use_tqdm: bool = True) -> list[RequestOutput]:
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
        requests = [self.engine.add_request(ids, sp, prompt=text) for (ids, text), sp in zip(encoded, params)]
        bar = tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            done = sum(r.is_finished for r in self.engine.step())
            bar.update(done)
        bar.close()
        return [self.engine.output(r) for r in requests]

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True):
        """One conversation (a message list) or several: the chat template is applied to each."""
        convs = [messages] if is_chat(messages) else list(messages)
        return self.generate(convs, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        return self.engine.stats()
