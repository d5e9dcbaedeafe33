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


@dataclass
class ComparisonWorkload:
    """One offline workload of ``bench compare``: the same token ids for every engine.

    All requests arrive at once, decode greedily and ignore EOS, so each produces exactly its
    ``max_tokens``: engines differ only in how fast they do identical work. ``hf_batch_size`` is
    the static batch the transformers baseline uses; ``prefix_caching`` asks the engines that
    have one to turn their prefix cache on (W3)."""

    name: str
    description: str
    prompts: list[list[int]]
    max_tokens: list[int]
    hf_batch_size: int
    prefix_caching: bool = False

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def summary(self) -> dict:
        lens = [len(p) for p in self.prompts]
        return {"description": self.description, "requests": len(self.prompts), "prompt_tokens": sum(lens),
                "prompt_len_min_max": [min(lens), max(lens)], "output_tokens": self.output_tokens,
                "max_tokens_min_max": [min(self.max_tokens), max(self.max_tokens)],
                "hf_batch_size": self.hf_batch_size, "prefix_caching": self.prefix_caching}


COMPARISON_WORKLOADS = ("W0", "W1", "WV", "W3")


def comparison_workloads(tokenizer, names=COMPARISON_WORKLOADS, quick: bool = False,
                         seed: int = 0) -> dict[str, ComparisonWorkload]:
    """The workloads of ``bench compare`` by name; ``quick`` gives tiny versions for tests.

    W0: one request (TPOT, the latency floor). W1: a uniform batch (throughput). WV: varied
    prompt and output lengths (where static batching wastes slots). W3: chapter 03's shape, a long
    shared system prompt with a short question each (what a prefix cache saves)."""
    unknown = set(names) - set(COMPARISON_WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workloads {sorted(unknown)}: choose from {', '.join(COMPARISON_WORKLOADS)}")
    out = {}
    for name in names:
        rng = random.Random(f"{name}-{seed}")  # each workload the same whichever others are chosen
        pool = _token_pool(tokenizer, rng)

        def cut(n):
            start = rng.randrange(0, len(pool) - n)
            return pool[start:start + n]

        if name == "W0":
            n_in, n_out = (32, 16) if quick else (128, 256)
            w = ComparisonWorkload(name, f"1 request, {n_in}-token prompt, {n_out} out (TPOT)", [cut(n_in)],
                                   [n_out], 1)
        elif name == "W1":
            n, n_in, n_out = (4, 32, 16) if quick else (32, 200, 128)
            w = ComparisonWorkload(name, f"{n} prompts x {n_in} tokens, {n_out} out each",
                                   [cut(n_in) for _ in range(n)], [n_out] * n, 32)
        elif name == "WV":
            n, (lo, hi), (olo, ohi), batch = (6, (8, 48), (4, 16), 4) if quick else (48, (20, 400), (8, 256), 16)
            lens = [rng.randint(lo, hi) for _ in range(n)]
            w = ComparisonWorkload(name, f"{n} prompts of {lo}-{hi} tokens, {olo}-{ohi} out (uniform)",
                                   [cut(k) for k in lens], [rng.randint(olo, ohi) for _ in range(n)], batch)
        else:
            n, shared, own, (olo, ohi) = (4, 64, 8, (4, 8)) if quick else (16, 600, 32, (8, 32))
            prefix = pool[:shared]
            w = ComparisonWorkload(name, f"{n} requests sharing a {shared}-token prefix + {own} own, "
                                         f"{olo}-{ohi} out (prefix caching on)",
                                   [prefix + cut(own) for _ in range(n)],
                                   [rng.randint(olo, ohi) for _ in range(n)], n, prefix_caching=True)
        out[name] = w
    return out


def warmup_prompts(tokenizer, n: int = 4, length: int = 24, seed: int = 12345) -> list[list[int]]:
    """A few prompts unlike any workload's, to warm an engine up without filling its prefix cache."""
    rng = random.Random(seed)
    pool = _token_pool(tokenizer, rng)[::-1]
    return [pool[i * length:(i + 1) * length] for i in range(n)]
