"""Rotary position embeddings' frequencies for each RoPE variant a Llama-family checkpoint may name."""
from __future__ import annotations

import math

import torch

from .model_config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of rotary embeddings and the attention scaling, for each RoPE variant.

    Long-context models stretch the low frequencies so positions beyond the training length
    still look familiar: Llama 3 scales by wavelength band, YaRN blends interpolation and
    extrapolation per dimension and rescales attention, "linear" divides all positions.
    """
    dim, base = cfg.head_dim, cfg.rope_theta
    # on the CPU whatever the default device: a model is built on "meta", where this arithmetic would import
    # torch's compiler (a large import in every process) for numbers nobody reads (load_model sets its own)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    s = cfg.rope_scaling
    kind = s.get("rope_type", s.get("type", "default"))
    scaling = 1.0
    if kind == "linear":
        inv_freq = inv_freq / s["factor"]
    elif kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        inv_freq = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "yarn":
        factor = s["factor"]
        old_len = s.get("original_max_position_embeddings") or cfg.max_position_embeddings
        beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

        def correction_dim(rotations):
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        scaling = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    elif kind != "default":
        raise ValueError(f"RoPE type {kind!r} is not supported (default, linear, llama3, yarn are)")
    return inv_freq.float(), float(scaling)
