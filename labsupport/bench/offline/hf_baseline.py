"""The Hugging Face transformers baseline: ``model.generate`` with static batches.

This is how most people first serve a model, and what continuous batching is measured against.
Prompts are left-padded into batches (``hf_batch_size`` of the workload), and each batch runs
until its longest request is done (``min_new_tokens = max_new_tokens`` = the longest), greedy.
A user receives only their own ``max_tokens``, so the output tokens counted are those: the
steps a short request spends waiting for the batch's longest are static batching's waste, and
they show in the throughput (WV). There is no prefix cache: W3 recomputes the shared prompt.

A logits processor stamps the time of every step (it runs once per generated token, right
after the forward pass), which gives TTFT and the time per output token without a streamer.
"""
from __future__ import annotations

import statistics
import time

import torch


def load_model(folder):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generation-config chatter is not a result
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def generate_batch(model, prompts: list[list[int]], new_tokens: int, pad_id: int, stop_at_eos: bool = False):
    """Left-pad ``prompts``, generate greedily; return ``(token lists, step timestamps, start time)``.

    ``stop_at_eos=False`` forces exactly ``new_tokens`` tokens (EOS suppressed until then)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=0 if stop_at_eos else new_tokens, do_sample=False,
                             pad_token_id=pad_id, logits_processor=LogitsProcessorList([Clock()]))
    return out[:, width:].tolist(), stamps, start


def run_workload(model, workload, pad_id: int) -> dict:
    """Time one comparison workload, batch after batch; the figures ``compare`` prints."""
    size, tokens = workload.hf_batch_size, workload.max_tokens
    wall, gaps, ttfts, decode_s, decode_tokens = 0.0, [], [], 0.0, 0
    for lo in range(0, len(workload.prompts), size):
        batch, wants = workload.prompts[lo:lo + size], tokens[lo:lo + size]
        _, stamps, start = generate_batch(model, batch, max(wants), pad_id)
        ttfts += [wall + stamps[0] - start] * len(batch)  # counted from the start of the whole run
        wall += time.perf_counter() - start
        gaps += [b - a for a, b in zip(stamps, stamps[1:])]
        decode_s += stamps[-1] - stamps[0]
        decode_tokens += sum(w - 1 for w in wants)  # what users receive after their first token
    out_tokens = sum(tokens)
    generated = sum(max(tokens[lo:lo + size]) * len(tokens[lo:lo + size]) for lo in range(0, len(tokens), size))
    return {"wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
            "tpot_ms": statistics.median(gaps) * 1e3 if gaps else None,
            "median_ttft_ms": statistics.median(ttfts) * 1e3,
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
            "generated_tokens": generated}  # users' tokens plus the steps spent waiting for the longest


def run(folder, workloads: dict, warmup: list[list[int]], agreement_prompts=(), agreement_len: int = 32,
        log=print) -> dict:
    """Load once (not timed), warm up, run every workload; results by workload name, and under
    ``"agreement_tokens"`` the batch-1 greedy tokens of ``agreement_prompts``."""
    started = time.perf_counter()
    model = load_model(folder)
    pad_id = model.generation_config.pad_token_id
    pad_id = pad_id if pad_id is not None else model.config.eos_token_id
    generate_batch(model, warmup, 4, pad_id)
    results = {"startup_s": time.perf_counter() - started}
    for name, workload in workloads.items():
        log(f"  transformers {name} ...")
        results[name] = run_workload(model, workload, pad_id)
    if agreement_prompts:
        results["agreement_tokens"] = greedy_tokens(model, list(agreement_prompts), agreement_len)
    return results


def greedy_tokens(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations up to the first EOS (inclusive): the reference for agreement. Prompts
    of one length run as one batch (no padding, so nothing differs from batch 1 but the order of
    sums); others one by one."""
    pad_id = model.generation_config.pad_token_id
    pad_id = pad_id if pad_id is not None else model.config.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    same_length = len({len(p) for p in prompts}) == 1
    groups = [prompts] if same_length else [[p] for p in prompts]
    result = []
    for group in groups:
        for toks in generate_batch(model, group, new_tokens, pad_id, stop_at_eos=True)[0]:
            cut = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
            result.append(toks[:cut])
    return result
