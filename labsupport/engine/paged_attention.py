"""PagedAttention in PyTorch: K/V live in fixed-size blocks of one pool per layer.

Writing: the new tokens' K/V go to their *slots* (``slot_mapping``), wherever their blocks are.
Reading takes two paths, because a step mixes two very different kinds of rows:

* **Decode rows** (one new token each, most rows of most steps; a sequence verifying k guesses of
  speculative decoding, chapter 09, is k + 1 decode rows): their blocks are gathered in
  one indexing call per layer, whole blocks at a time, into a [Hkv, B, S, D] batch padded only to
  the longest *decoding* context, and attended with one batched matmul per head group. A
  padding slot is masked by its length, not by a dense [B, Lq, Lk] mask.
* **Prefill rows** (a prompt or a chunk of one): attended one sequence at a time. A fresh
  prompt attends to its own keys with the causal rule and reads nothing from the pool; a chunk
  or a prompt with a cached prefix gathers its context first. (On the CPU in float32 a C++ kernel
  serves every prefill sequence of the step in one call instead, reading the pool in place:
  ``kernels/cpu_attention.py``; ``PrefillSeqs`` is what it is given.)

So a decode row never pads to the longest prompt of the step. The gather is the price of staying
in plain PyTorch: a GPU kernel reads the blocks in place (``triton_attention.py``), as does a
small C++ kernel on the CPU if asked for (``kernels/cpu_attention.py``), and the block-size trade-off in
chapter 02 measures the difference.

``prepare`` works all of this out once per step, a ``PagedAttentionMetadata`` (``attention_metadata.py``) on
the batch, and every layer's ``attend`` reads it.

Pool layout, per layer: ``[num_kv_heads, num_blocks * block_size, head_dim]``, slot ``s`` =
``block * block_size + offset``. Heads first, so gathering blocks gives each head's keys
contiguously, which the matmul reads without another copy.
"""
from __future__ import annotations

import math

import torch

from ..kernels import select
from .attention import AttentionBackend, AttentionBatch, sdpa
from .attention_metadata import DecodeRows, PagedAttentionMetadata, PrefillRows, PrefillSeqs
from .block_pool import slot_mapping
from .plug_points import PlugPoint


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: DecodeRows,
                           block_size: int) -> torch.Tensor:
    """One new token per sequence attending over its blocks. q: [B, H, D] -> [B, H, D].

    Grouped-query attention without repeating K/V: the query heads that share a KV head are
    that head's rows of one matmul ([Hkv, B, G, D] @ [Hkv, B, D, S])."""
    hkv, slots, d = k_pool.shape
    b, h, _ = q.shape
    # Whole blocks, gathered as rows of the pool seen as [Hkv * blocks, block_size * D]: row
    # head * blocks + block is one block of one head, so each gathered row is one contiguous copy.
    # (Indexing blocks along dim 1 of [Hkv, blocks, ...] instead was slower, and slot by slot slower still:
    # benchmarks/README.md.)
    blocks = slots // block_size
    rows_of = (rows.block_tables.flatten()[None, :] + torch.arange(hkv, device=q.device)[:, None] * blocks).flatten()
    keys = k_pool.view(hkv * blocks, block_size * d).index_select(0, rows_of).view(hkv, b, -1, d)  # [Hkv, B, S, D]
    values = v_pool.view(hkv * blocks, block_size * d).index_select(0, rows_of).view(hkv, b, -1, d)
    queries = q.view(b, hkv, h // hkv, d).transpose(0, 1)                      # [Hkv, B, G, D]
    scores = (queries @ keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(d))  # [Hkv, B, G, S]
    scores.masked_fill_(rows.padding[None, :, None, :], float("-inf"))
    out = scores.softmax(-1).to(values.dtype) @ values                          # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(b, h, d)


def prefill_attention(q, k, v, k_pool, v_pool, rows: PrefillRows) -> torch.Tensor:
    """One sequence's new tokens (q/k/v: [n, heads, D]) attending causally over its context."""
    n = q.shape[0]
    if rows.context_slots is None:  # a fresh prompt: its context is exactly its own new tokens
        keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
    else:  # earlier chunks or a cached prefix live in the pool: query i sits at position ctx - n + i
        keys, values = k_pool[:, rows.context_slots], v_pool[:, rows.context_slots]
        ctx = keys.shape[1]
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - n)
        causal = False
    return sdpa(q.transpose(0, 1), keys, values, mask, causal).transpose(0, 1)


VERIFY_ROWS = 17  # 1 + the most guesses a step verifies (num_speculative_tokens <= 16)


class PagedAttention(AttentionBackend):
    PLUG_POINTS = {
        "slot_mapping": PlugPoint("slot_mapping", "a token's position -> its slot in the pool (ch. 02)"),
        "decode_attention": PlugPoint("decode_attention", "the paged read of the decode rows (ch. 02)"),
        "mixed_attention": PlugPoint("mixed_attention", "a whole mixed step's read (ch. 02); None: the engine's "
                                     "own split of decode and prefill rows", kind="function or None"),
    }

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype, device, scratch_block: bool = False, cpu_kernel: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = device
        self.slot_mapping = slot_mapping  # chapter 02's exercise plugs the attendee's own in here
        # the gather and the per-sequence path below, unless a device reads the pool in place (kernels/select.py:
        # Triton on a GPU, where installed; C++ on a CPU if cpu_kernel and a compiler built it)
        decode, prefill = select.attention(device, dtype, head_dim, cpu_kernel)
        self.decode_attention = decode or paged_decode_attention
        self.prefill_kernel = prefill  # or None: every prefill sequence of a step in one call, read in place
        self.mixed_attention = None  # chapter 02's plug point: every row of a step, prefill or decode, in one call
        # one block past the allocator's: CUDA graphs' padding rows write there (cuda_graphs.py)
        self.scratch_slot = num_blocks * block_size if scratch_block else None
        self.connector = None  # chapter 07: a KV connector's per-layer hooks run around each layer's attention
        slots = (num_blocks + scratch_block) * block_size
        self.k_pool = [torch.zeros(num_kv_heads, slots, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pool = [torch.zeros(num_kv_heads, slots, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

    def attach_connector(self, connector):
        """Run ``connector``'s per-layer hooks around each layer's attention (chapter 07): ``wait_for_layer_load``
        before a layer reads its KV, ``save_kv_layer`` right after it wrote them."""
        self.connector = connector

    def copy_block(self, src: int, dst: int):
        """Copy block ``src``'s K/V into block ``dst`` in every layer (copy-on-write, chapter 03)."""
        bs = self.block_size
        for pool in (*self.k_pool, *self.v_pool):
            pool[:, dst * bs:(dst + 1) * bs] = pool[:, src * bs:(src + 1) * bs]

    @property
    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_pool + self.v_pool)

    def prepare(self, requests, num_new_tokens) -> AttentionBatch:
        """Build the step's metadata once (``batch.attn_metadata``); every layer reuses it."""
        batch = super().prepare(requests, num_new_tokens)
        bs, dev = self.block_size, self.device
        writes = []
        for req, n, ctx in zip(requests, num_new_tokens, batch.context_lens):
            writes += self.slot_mapping(req.block_table, ctx - n, n, bs)  # only the new tokens' slots
        slots = torch.tensor(writes, dtype=torch.long, device=dev)
        if self.mixed_attention is not None:  # one call for the whole step: a decode row is a 1-token chunk
            width = -(-max(batch.context_lens) // bs)
            tables = [req.block_table[:width] for req in requests]
            mixed = PrefillSeqs(
                torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev),
                *(torch.tensor(v, dtype=torch.long, device=dev)
                  for v in (batch.query_offsets[:-1], batch.query_lens, batch.context_lens)))
            batch.attn_metadata = PagedAttentionMetadata(slot_mapping=slots, mixed=mixed)
            return batch
        # decode rows: one new token, or a few after a context (speculative decoding's guesses, chapter 09):
        # each query token is a row of its own, seeing the context up to itself (its K/V is written first)
        decode = [(batch.query_offsets[i] + j, i, ctx - n + 1 + j)
                  for i, (n, ctx) in enumerate(zip(batch.query_lens, batch.context_lens))
                  if self._as_decode(requests[i], n) for j in range(n)]
        decode_rows = prefill_seqs = None
        if decode:
            lens = [length for _, _, length in decode]
            width = -(-max(lens) // bs)
            tables = [requests[i].block_table[:width] for _, i, _ in decode]
            tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            context_lens = torch.tensor(lens)
            decode_rows = DecodeRows(
                token_index=torch.tensor([row for row, _, _ in decode], device=dev),
                block_tables=tables.to(dev), context_lens=context_lens.to(dev),
                padding=(torch.arange(width * bs)[None, :] >= context_lens[:, None]).to(dev))
        prefill = [i for i, n in enumerate(batch.query_lens) if not self._as_decode(requests[i], n)]
        if prefill and self.prefill_kernel is not None:  # one call per layer reads every context in place
            width = -(-max(batch.context_lens[i] for i in prefill) // bs)
            tables = [requests[i].block_table[:width] for i in prefill]
            prefill_seqs = PrefillSeqs(
                torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long),
                *(torch.tensor(v, dtype=torch.long) for v in ([batch.query_offsets[i] for i in prefill],
                                                              [batch.query_lens[i] for i in prefill],
                                                              [batch.context_lens[i] for i in prefill])))
            prefill = []
        prefill_rows = []
        for i in prefill:  # else one sequence at a time, a chunk's context gathered from the pool
            n, ctx = batch.query_lens[i], batch.context_lens[i]
            context = None if ctx == n else torch.tensor(self.slot_mapping(requests[i].block_table, 0, ctx, bs),
                                                         dtype=torch.long, device=dev)
            prefill_rows.append(PrefillRows(batch.query_offsets[i], batch.query_offsets[i + 1], context))
        batch.attn_metadata = PagedAttentionMetadata(slot_mapping=slots, decode=decode_rows, prefill=prefill_rows,
                                                     prefill_seqs=prefill_seqs)
        return batch

    @staticmethod
    def _as_decode(req, n: int) -> bool:
        """A request feeding ``n`` tokens is read as decode rows if it decodes: one token, or its last token
        and the guesses of speculative decoding (chapter 09), where one batched read beats a masked one.
        (Guesses are only ever made for a decoding request; a chapter's stand-in request has none.)"""
        return n == 1 or (n <= VERIFY_ROWS and bool(getattr(getattr(req, "spec", None), "token_ids", None)))

    def attend(self, layer, q, k, v, batch):
        meta = batch.attn_metadata
        k_pool, v_pool = self.k_pool[layer], self.v_pool[layer]
        if self.connector is not None:
            self.connector.wait_for_layer_load(layer)  # a layer-wise loader: this layer's KV must be in
        k_pool.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_pool.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        if self.connector is not None:
            self.connector.save_kv_layer(layer, k_pool, v_pool, batch)  # a push connector sends it now
        if meta.mixed is not None:
            return self.mixed_attention(q, k_pool, v_pool, meta.mixed, self.block_size)
        rows, seqs = meta.decode, meta.prefill_seqs
        if meta.decodes_only:  # the common step: decodes only, in order
            return self.decode_attention(q, k_pool, v_pool, rows, self.block_size)
        q = q.contiguous()
        out = torch.empty_like(q)
        if seqs is not None:
            self.prefill_kernel(q, k_pool, v_pool, seqs, self.block_size, out)
        if rows is not None:
            out[rows.token_index] = self.decode_attention(q[rows.token_index], k_pool, v_pool, rows, self.block_size)
        for p in meta.prefill:
            out[p.start:p.end] = prefill_attention(q[p.start:p.end], k[p.start:p.end], v[p.start:p.end],
                                                   k_pool, v_pool, p)
        return out
