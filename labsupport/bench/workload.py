"""Workloads: which requests arrive when, with which prompt and output lengths.

Arrivals follow a Poisson process (exponential gaps at ``rate`` requests per second), the usual
model of independent users; ``rate=inf`` sends everything at once (an offline batch). Lengths
are drawn from a list of choices, so a mix of short and long answers — the case where static
batching wastes slots — is one argument. Everything is seeded: the same call gives the same run.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    arrival_time: float  # seconds after the start of the run
    prompt_token_ids: list[int]
    max_tokens: int
    request_id: str | None = None  # a name to show in timelines (default: the engine numbers it)


def poisson_workload(tokenizer, num_requests: int, rate: float = math.inf, input_lens=(128,), output_lens=(64,),
                     shared_prefix_len: int = 0, seed: int = 0) -> list[BenchRequest]:
    """``num_requests`` requests; each prompt is real text cut to a length drawn from ``input_lens``
    (the first ``shared_prefix_len`` tokens the same for all), each answer forced to a length drawn
    from ``output_lens`` (the driver sets ``ignore_eos``)."""
    rng = random.Random(seed)
    pool = _token_pool(tokenizer, rng)
    shared = pool[:shared_prefix_len]
    t, requests = 0.0, []
    for _ in range(num_requests):
        if math.isfinite(rate):
            t += rng.expovariate(rate)
        n = rng.choice(list(input_lens))
        start = rng.randrange(shared_prefix_len, max(shared_prefix_len + 1, len(pool) - n))
        prompt = (shared + pool[start:start + max(1, n - len(shared))])[:max(n, 1)]
        requests.append(BenchRequest(t if math.isfinite(rate) else 0.0, prompt, rng.choice(list(output_lens))))
    return requests


def long_prompt_workload(tokenizer, num_decoding: int = 4, decode_input_len: int = 32, decode_output_len: int = 64,
                         num_long: int = 2, long_input_len: int = 1024, long_output_len: int = 8,
                         long_start: float = 4, long_every: float = 16, seed: int = 0) -> list[BenchRequest]:
    """Chapter 05's mix: ``num_decoding`` short requests start at once and decode for a while;
    ``num_long`` long prompts arrive among them, the first at ``long_start``, then every
    ``long_every`` (seconds, or steps with the driver's ``clock="steps"``). Ids: ``short-i``, ``long-j``."""
    rng = random.Random(seed)
    pool = _token_pool(tokenizer, rng)
    if long_input_len >= len(pool):
        raise ValueError(f"long_input_len must be below {len(pool)} tokens")

    def cut(n):
        start = rng.randrange(0, len(pool) - n)
        return pool[start:start + n]

    short = [BenchRequest(0.0, cut(decode_input_len), decode_output_len, f"short-{i}") for i in range(num_decoding)]
    long_ = [BenchRequest(long_start + j * long_every, cut(long_input_len), long_output_len, f"long-{j}")
             for j in range(num_long)]
    return short + long_


def _token_pool(tokenizer, rng) -> list[int]:
    """A few thousand tokens of varied text to cut prompts from."""
    text = " ".join(f"Request {i} asks about topic {rng.randint(0, 10**6)}." for i in range(400))
    return tokenizer(text).input_ids
