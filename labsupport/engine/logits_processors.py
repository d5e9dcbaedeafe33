"""Logit bias and the three penalties: the rules that change a request's logits before it samples.

They follow vLLM's sampler (``v1/sample/sampler.py`` and ``model_executor/layers/utils.py``), in its
order, on the logits before temperature, so they change greedy decoding too:

- ``logit_bias`` ``{token id: bias}`` adds the bias to that token's logit (OpenAI clamps it to
  [-100, 100]; -100 bans a token, +100 all but forces it).
- ``repetition_penalty`` (vLLM's extension, from the CTRL paper): every token already in the prompt
  *or* the output has its logit divided by the penalty if positive, multiplied if negative; 1 is off.
- ``frequency_penalty`` and ``presence_penalty`` (OpenAI's definition): the logit of a token that
  appeared ``c`` times in the *output* loses ``frequency_penalty * c + presence_penalty * (c > 0)``.

Logprobs are not affected: they are the raw logits' (the sampler computes them first), as vLLM's
default ``raw_logprobs``. The values are checked here when ``SamplingParams`` is made, so nothing
bad reaches a step. The output counts a penalty needs are kept per request by ``Penalties`` and
updated with the tokens added since the last step, instead of being recounted from the whole
output every step; ``release`` drops them when the request leaves.
"""
from __future__ import annotations

import math
import numbers

import torch

MAX_BIAS = 100.0  # OpenAI's and vLLM's clamp
MAX_PENALTY = 2.0  # presence and frequency penalties live in [-2, 2] (OpenAI's range)


def _number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def check_penalties(presence: float, frequency: float, repetition: float) -> tuple[float, float, float]:
    """The three penalties as floats, or ValueError saying which is out of range."""
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not _number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f"{name} must be a number in [-2, 2] (0 is off), got {value!r}")
    if not _number(repetition) or repetition <= 0:
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 is off), got {repetition!r}")
    return float(presence), float(frequency), float(repetition)


def check_logit_bias(bias) -> dict[int, float] | None:
    """``{token id: bias}`` with int keys (JSON's string keys such as ``"1234"`` are converted, as vLLM
    does) and finite biases clamped to [-100, 100]; the vocabulary range is the engine's to check."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict {{token id: bias}} or None, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key) if isinstance(key, str) else key
        except ValueError:
            token = None
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0, or strings of them), got {key!r}")
        if not _number(value):
            raise ValueError(f"logit_bias values must be finite numbers, got {value!r} for token {key!r}")
        out[int(token)] = max(-MAX_BIAS, min(MAX_BIAS, float(value)))
    return out or None


def needs_processing(params) -> bool:
    return bool(getattr(params, "logit_bias", None)) or has_penalties(params)


def has_penalties(params) -> bool:
    return (getattr(params, "presence_penalty", 0.0) != 0 or getattr(params, "frequency_penalty", 0.0) != 0
            or getattr(params, "repetition_penalty", 1.0) != 1)


def apply_logit_bias(logits: torch.Tensor, rows: list[int], requests) -> None:
    """Add each row's request's ``logit_bias`` to ``logits`` [rows, vocab], in place (one indexed add)."""
    index_rows, tokens, biases = [], [], []
    for i in rows:
        for token, bias in (requests[i].params.logit_bias or {}).items():
            index_rows.append(i), tokens.append(token), biases.append(bias)
    if index_rows:
        where = (torch.tensor(index_rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(where, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


class Penalties:
    """Per request (by id): its output token counts [vocab] and how many output tokens they cover,
    and the prompt's token set (for the repetition penalty). Made at its first penalized step."""

    def __init__(self):
        self.counts: dict[str, tuple[torch.Tensor, int]] = {}
        self.prompt_seen: dict[str, torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, rows: list[int], requests) -> None:
        """vLLM's ``apply_penalties`` on the given rows of ``logits`` [rows, vocab], in place."""
        for i in rows:
            req, p = requests[i], requests[i].params
            counts = self._output_counts(req, logits.shape[-1], logits.device)
            row = logits[i]
            if p.repetition_penalty != 1:
                seen = (counts > 0) | self._prompt_seen(req, logits.shape[-1], logits.device)
                penalty = torch.where(seen, p.repetition_penalty, 1.0).to(row.dtype)
                row.copy_(torch.where(row > 0, row / penalty, row * penalty))
            if p.frequency_penalty or p.presence_penalty:
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def _output_counts(self, req, vocab: int, device) -> torch.Tensor:
        out = req.output_token_ids
        counts, done = self.counts.get(req.request_id, (None, 0))
        if counts is None or done > len(out):  # new, or its output was cut (never in plain decoding): recount
            counts, done = torch.zeros(vocab, device=device), 0
        if done < len(out):
            new = torch.tensor(out[done:], device=device)
            counts.index_add_(0, new, torch.ones(len(new), device=device))
        self.counts[req.request_id] = (counts, len(out))
        return counts

    def _prompt_seen(self, req, vocab: int, device) -> torch.Tensor:
        seen = self.prompt_seen.get(req.request_id)
        if seen is None:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen[torch.tensor(req.prompt_token_ids, device=device)] = True
            self.prompt_seen[req.request_id] = seen
        return seen

    def release(self, request_id: str):
        self.counts.pop(request_id, None)
        self.prompt_seen.pop(request_id, None)
