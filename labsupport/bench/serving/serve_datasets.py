"""Workloads for ``bench serve``: prompts as *text* of an exact token length, and arrival times.

The load generator talks HTTP to any OpenAI-compatible server (ours or ``vllm serve``), so it
cannot send token ids: it sends text, and the server tokenizes it again. A random token sequence
decoded to text does not always re-encode to the same number of tokens (merges across the old
boundaries), so, as ``vllm bench serve`` does, we decode, re-encode and cut or extend until the
count is right. The tokenizer is the model's own: the embedded model's, or ``--tokenizer FOLDER``.

Arrivals follow vLLM's rule: gaps drawn from a gamma distribution of shape ``burstiness`` and
mean ``1/rate`` (``burstiness=1`` is a Poisson process; below 1 burstier, above 1 more regular),
then scaled so the last request arrives at ``n/rate`` (runs with different seeds then offer the
same load). ``rate=inf`` sends everything at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "shared-prefix", "long-short")


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens of the prompt text alone (a chat template adds a few on the server)
    output_len: int  # max_completion_tokens; exact when the server honours ignore_eos


def load_tokenizer(name_or_folder: str | None = None):
    """The embedded model's tokenizer (None), or that of a Hugging Face folder / hub id."""
    from ...models.loader import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path(name_or_folder))


def _ordinary_ids(tokenizer) -> np.ndarray:
    """Token ids that decode to plain text: special and added tokens (``<|im_start|>``) are left out,
    or the server would read them back as control tokens."""
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special])


def text_of_length(tokenizer, ids: list[int], target: int, vocab: np.ndarray, rng: np.random.Generator,
                   tries: int = 10) -> tuple[str, int]:
    """Text that re-encodes to ``target`` tokens (or as close as ``tries`` rounds get): ``(text, length)``."""
    ids = list(ids)
    for _ in range(tries + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            break
        ids = ids[:target] if len(ids) > target else ids + rng.choice(vocab, target - len(ids)).tolist()
    return text, len(ids)


def _lengths(mean: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """Integers uniform in ``[mean*(1-ratio), mean*(1+ratio)]`` (vLLM's ``--random-range-ratio``), at least 1."""
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, n).tolist()


def sample_requests(tokenizer, dataset_name: str = "random", num_prompts: int = 100, input_len: int = 1024,
                    output_len: int = 128, range_ratio: float = 0.0, prefix_len: int = 0, num_long: int | None = None,
                    long_input_len: int = 1024, seed: int = 0) -> list[SampleRequest]:
    """``num_prompts`` requests of one workload, the same for the same arguments.

    * ``random``: lengths drawn around ``input_len`` / ``output_len``; no two prompts share a prefix.
    * ``shared-prefix``: the first ``prefix_len`` tokens are the same for all (a system prompt, a
      document asked about many times): what a prefix cache saves; ``input_len`` more of each.
    * ``long-short``: ``num_long`` prompts of ``long_input_len`` tokens spread among short ones (default
      one in eight): the long prefills stall the short requests' decoding (chapter 05's picture).
    """
    if dataset_name not in DATASETS:
        raise ValueError(f"unknown dataset {dataset_name!r}: choose from {', '.join(DATASETS)}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    vocab = _ordinary_ids(tokenizer)
    in_lens = _lengths(input_len, range_ratio, num_prompts, rng)
    out_lens = _lengths(output_len, range_ratio, num_prompts, rng)
    prefix = rng.choice(vocab, prefix_len).tolist() if dataset_name == "shared-prefix" else []
    if dataset_name == "long-short":
        num_long = max(1, num_prompts // 8) if num_long is None else num_long
        for k in range(min(num_long, num_prompts)):  # evenly spread, the first a little after the start
            in_lens[(k * num_prompts + num_prompts // 2) // max(num_long, 1)] = long_input_len
    requests = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = prefix + rng.choice(vocab, n_in).tolist()
        text, length = text_of_length(tokenizer, ids, len(prefix) + n_in, vocab, rng)
        requests.append(SampleRequest(text, length, n_out))
    return requests


def arrival_gaps(n: int, rate: float, burstiness: float = 1.0, rng: np.random.Generator | None = None) -> np.ndarray:
    """``n`` gaps between arrivals: gamma(shape=burstiness, scale=1/(rate*burstiness)), mean ``1/rate``."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):  # perfectly regular
        return np.full(n, 1.0 / rate)
    rng = np.random.default_rng(0) if rng is None else rng
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds after the start, scaled so the last is ``n/rate`` (as vLLM does)."""
    times = np.cumsum(arrival_gaps(n, rate, burstiness, np.random.default_rng(seed)))
    if n and times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times.tolist()
