"""What a paged attention step knows before its first layer runs: the typed boundary between preparing and reading.

``PagedAttention.prepare`` works out once per step where every new token's K/V goes and how each row of the
flat batch will read its context; every layer's ``attend`` then reads that same answer. Several readers
besides ``attend`` look at it (the CPU's one-call-per-layer decode, ``kernels/cpu_decode_layers.py``; the
mixed-read check of chapter 02) and one more writer builds it (CUDA graphs' static buffers,
``kernels/cuda_graphs.py``). A dataclass, not a dict of strings, so each of them names a field the
type checker, the editor and a reader can follow to this file, where each field says what it holds and
who reads it; a misspelled key is an ``AttributeError`` at once, not a ``None`` three calls later.

It lives apart from ``paged_attention.py`` because ``AttentionBatch`` (``attention.py``), which
``paged_attention.py`` builds on, carries it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeRows:
    """The decode rows of a step: where they sit in the flat batch and where their KV lives."""

    token_index: torch.Tensor   # [B] row of each decode token in the flat [T] batch
    block_tables: torch.Tensor  # [B, max_blocks] (padded with block 0)
    context_lens: torch.Tensor  # [B]
    padding: torch.Tensor       # [B, max_blocks * block_size] True where a slot is past the context


@dataclass
class PrefillSeqs:
    """Every prefill sequence of a step, for a kernel that serves them in one call (``kernels/cpu_attention.py``); or
    every sequence of a step, decodes included, for a plugged ``mixed_attention`` (chapter 02)."""

    block_tables: torch.Tensor  # [S, max_blocks] (padded with block 0)
    starts: torch.Tensor        # [S] first row of each in the flat batch
    query_lens: torch.Tensor    # [S] its new tokens: the last query_lens of its context_lens positions
    context_lens: torch.Tensor  # [S]


@dataclass
class PrefillRows:
    """One prefill sequence's rows, for the plain PyTorch path that attends one sequence at a time."""

    start: int                  # first row in the flat batch
    end: int
    context_slots: torch.Tensor | None  # pool slots of the whole context; None: a fresh prompt


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """A step's paged-attention metadata, built once by ``PagedAttention.prepare`` and read by every layer.

    vLLM's counterpart is ``FlashAttentionMetadata`` (``vllm/v1/attention/backends/flash_attn.py``), built once
    per step by its metadata builder: the same ``slot_mapping``, and block tables and lengths for the kernel.
    vLLM hands every row to one varlen kernel; here the rows are split by how they are read (decode rows
    batched, prefill rows per sequence or in one kernel call, ``paged_attention.py`` says why), so the
    metadata holds one field per way of reading, and a field that is not needed this step is empty.

    Exactly one way of reading is in use for each row: ``mixed`` alone (an exercise's read of the whole
    step), or ``decode`` for the decode rows and one of ``prefill_seqs`` / ``prefill`` for the others.
    """

    # [T] the pool slot of each new token's K/V, in flat-batch order: every layer's attend writes k and v
    # there before reading (so do the C++ decode layer, kernels/cpu_decode_layers.py, and CUDA graphs'
    # static buffer, whose padding rows write to the scratch block)
    slot_mapping: torch.Tensor
    # the decode rows (one token each, or speculative decoding's guesses), read in one batched call by
    # PagedAttention.decode_attention; None: no decode rows this step. Read by attend and CpuDecodeLayers
    decode: DecodeRows | None = None
    # the prefill sequences the plain PyTorch path serves one at a time (prefill_attention); empty when a
    # prefill kernel serves them (prefill_seqs) or a plugged mixed_attention serves the whole step. Read by attend
    prefill: list[PrefillRows] = field(default_factory=list)
    # every prefill sequence for PagedAttention.prefill_kernel (the C++ CPU kernel), which reads the pool in
    # place in one call per layer; None without such a kernel or without prefill rows. Read by attend
    prefill_seqs: PrefillSeqs | None = None
    # every sequence of the step, decodes included, for a plugged mixed_attention (chapter 02's exercise); when
    # set, it is the only field besides slot_mapping. Read by attend
    mixed: PrefillSeqs | None = None

    @property
    def decodes_only(self) -> bool:
        """Every row is a decode row, in flat-batch order: the common step, which one decode call serves whole
        (``attend``'s fast path, and the only step ``CpuDecodeLayers`` runs)."""
        return self.decode is not None and not self.prefill and self.prefill_seqs is None and self.mixed is None
