"""Attention backends: where the keys and values of past tokens come from.

The model computes q, k, v for the tokens of this forward pass and calls
``backend.attend(layer, q, k, v, batch)``. A backend decides what "the past" is:

* ``RecomputeAttention`` (chapter 00) keeps nothing. Every step feeds the whole sequence
  again, so generating token n costs a forward over n tokens: the waste chapter 01 removes.

Later chapters add backends that keep K/V between steps (a contiguous cache, paged blocks);
the model and the sampler never change.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionBatch:
    """Which tokens of the flat [T] batch belong to which sequence.

    ``query_lens[i]`` tokens of sequence i are in this forward pass; ``context_lens[i]`` is the
    sequence's length once they are added (cached tokens + new ones). The new tokens are the
    last ``query_lens[i]`` positions of that context, which is what makes the mask causal.
    """

    query_lens: list[int]
    context_lens: list[int]

    def __post_init__(self):
        offsets = [0]
        for n in self.query_lens:
            offsets.append(offsets[-1] + n)
        self.query_offsets = offsets


class AttentionBackend:
    """Interface. ``keeps_kv`` tells the engine whether computed tokens stay computed."""

    keeps_kv = False

    def attend(self, layer: int, q, k, v, batch: AttentionBatch) -> torch.Tensor:
        raise NotImplementedError


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence. q: [Lq, H, D], k/v: [Lk, Hkv, D] with Lq <= Lk, the queries being the last Lq
    positions. Grouped-query attention: each KV head serves H / Hkv query heads."""
    lq, lk = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if lq == lk:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        # query i sits at position lk - lq + i and may see keys 0 .. lk - lq + i
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep, enable_gqa=True)
    return out.transpose(0, 1)


class RecomputeAttention(AttentionBackend):
    """No cache: the forward pass must contain every token of every sequence."""

    keeps_kv = False

    def attend(self, layer, q, k, v, batch):
        out = torch.empty_like(q)
        for i, (n, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
            if n != ctx:
                raise ValueError("RecomputeAttention keeps no KV: feed the whole sequence every step")
            s, e = batch.query_offsets[i], batch.query_offsets[i + 1]
            out[s:e] = causal_attention(q[s:e], k[s:e], v[s:e])
        return out
