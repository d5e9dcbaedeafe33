"""Attention backends: where the keys and values of past tokens come from.

The model computes q, k, v for the tokens of this forward pass and calls
``backend.attend(layer, q, k, v, batch)``. A backend decides what "the past" is:

* ``RecomputeAttention`` (chapter 00) keeps nothing. Every step feeds the whole sequence
  again, so generating token n costs a forward over n tokens.
* ``ContiguousAttention`` (chapter 01) keeps each request's K/V in its own tensor, reserved
  up front for the longest the request may become. Each token is computed once.
* ``PagedAttention`` (chapter 02, ``paged_attention.py``) keeps K/V in fixed-size blocks of
  one shared pool, found through each request's block table.

Each backend turns the scheduled requests into its own metadata (``prepare``); the memory itself
is reserved and freed by the scheduler's KV manager (``kv_cache_manager.py``). The model, runner
and sampler never change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .attention_metadata import PagedAttentionMetadata
from .plug_points import PlugPoint


@dataclass
class AttentionBatch:
    """Which tokens of the flat [T] batch belong to which sequence.

    ``query_lens[i]`` tokens of sequence i are in this forward pass; ``context_lens[i]`` is the
    sequence's length once they are added (cached tokens + new ones). The new tokens are the
    last ``query_lens[i]`` positions of that context, which is what makes the mask causal.
    ``attn_metadata`` is what ``PagedAttention.prepare`` worked out for every layer (the slots to write, how
    each row reads its context: ``attention_metadata.py``); the other backends need only the lengths.
    """

    query_lens: list[int]
    context_lens: list[int]
    request_ids: list[str] = field(default_factory=list)
    attn_metadata: PagedAttentionMetadata | None = None

    def __post_init__(self):
        offsets = [0]
        for n in self.query_lens:
            offsets.append(offsets[-1] + n)
        self.query_offsets = offsets


class AttentionBackend:
    """Interface: ``prepare`` once per step, then ``attend`` once per layer."""

    PLUG_POINTS: dict = {}  # a backend with pieces an exercise replaces declares them (ContiguousAttention, PagedAttention)

    def prepare(self, requests, num_new_tokens: list[int]) -> AttentionBatch:
        return AttentionBatch(list(num_new_tokens), [r.num_computed_tokens + n for r, n in zip(requests, num_new_tokens)],
                              [r.request_id for r in requests])

    def attend(self, layer: int, q, k, v, batch: AttentionBatch) -> torch.Tensor:
        raise NotImplementedError


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` for one sequence, heads first: q [H, Lq, D], k/v [Hkv, Lk, D].

    Called with a batch dimension of 1 on purpose: PyTorch's fused CPU kernel (flash attention,
    which never materialises the [H, Lq, Lk] scores) takes only 4-D inputs, and 3-D ones fall back
    to the math path, which materialises every score: several times slower on long prompts
    (benchmarks/README.md has the figures)."""
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                         enable_gqa=True)
    return out[0]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence. q: [Lq, H, D], k/v: [Lk, Hkv, D] with Lq <= Lk, the queries being the last Lq
    positions. Grouped-query attention: each KV head serves H / Hkv query heads."""
    lq, lk = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if lq == lk:
        out = sdpa(qh, kh, vh, causal=True)
    else:
        # query i sits at position lk - lq + i and may see keys 0 .. lk - lq + i
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        out = sdpa(qh, kh, vh, mask=keep)
    return out.transpose(0, 1)


class RecomputeAttention(AttentionBackend):
    """No cache: the forward pass must contain every token of every sequence."""

    def attend(self, layer, q, k, v, batch):
        out = torch.empty_like(q)
        for i, (n, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
            if n != ctx:
                raise ValueError("RecomputeAttention keeps no KV: feed the whole sequence every step")
            s, e = batch.query_offsets[i], batch.query_offsets[i + 1]
            out[s:e] = causal_attention(q[s:e], k[s:e], v[s:e])
        return out


def cached_attention(cache_k, cache_v, start: int, q, k, v) -> torch.Tensor:
    """Append n new tokens' K/V at ``start`` of one sequence's cache, then attend over the cache.

    cache_k/v: [capacity, Hkv, D]; q: [n, H, D]; k/v: [n, Hkv, D] for positions start..start+n-1.
    (Chapter 01's exercise writes this function; this is the engine's reference.)
    """
    n = q.shape[0]
    cache_k[start:start + n] = k
    cache_v[start:start + n] = v
    return causal_attention(q, cache_k[:start + n], cache_v[:start + n])


class ContiguousAttention(AttentionBackend):
    PLUG_POINTS = {"attend_fn": PlugPoint("attend_fn", "append to one sequence's cache and attend (ch. 01)")}

    """Attention over one contiguous K/V tensor per request and layer, which the
    ``ContiguousKVManager`` reserved for the request's longest possible length.

    ``attend_fn`` is the append-and-attend step for one sequence (``cached_attention`` or the
    attendee's own, chapter 01).
    """

    def __init__(self, kv, attend_fn=cached_attention):
        self.kv, self.attend_fn = kv, attend_fn

    def attend(self, layer, q, k, v, batch):
        out = torch.empty_like(q)
        for i, rid in enumerate(batch.request_ids):
            s, e = batch.query_offsets[i], batch.query_offsets[i + 1]
            cache_k, cache_v = self.kv.caches[rid][layer]
            out[s:e] = self.attend_fn(cache_k, cache_v, batch.context_lens[i] - (e - s), q[s:e], k[s:e], v[s:e])
        return out
