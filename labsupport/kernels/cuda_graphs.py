"""Decode steps replayed from CUDA graphs: the GPU runs the step without Python launching each kernel.

A decode step of a small model on a GPU is a few hundred tiny kernels (norms, projections,
RoPE, the attention kernel, per layer). Launched one by one from Python each costs microseconds of
CPU time, and for SmolLM2-135M that launch time, not the GPU, sets the step time (``benchmarks/README.md``). A CUDA graph
records the kernels of one forward once and replays them with one call. vLLM does the same
(``cudagraph_capture_sizes``); this file is its idea in ~150 lines.

A graph replays *fixed* addresses and shapes, so:

* inputs live in **static buffers** (token ids, positions, the slots to write, block tables,
  context lengths), overwritten before each replay;
* one graph per **batch size bucket** (1, 2, 4, 8, 16, 24, ...): a step of B sequences runs the
  smallest bucket >= B; the padding rows write their K/V to a **scratch block** that no request
  owns (``PagedAttention(scratch_block=True)``) and read one token from it;
* block tables are padded to the longest context the engine allows, and the attention must not
  depend on the batch's widest context in its shapes: the Triton kernel loops over each row's
  own length, read from memory at run time, so it replays correctly (the PyTorch decode path
  sizes its gather by the widest row, and is only used here with ``capture=False``, in tests).

Only decode-only steps replay; a step with any prefill rows runs eagerly. Graphs are captured
lazily, the first time a bucket is needed, and freed with the engine. ``capture=False`` runs the
same static-buffer forward eagerly: the CPU tests check that way that the buffers are filled right.
"""
from __future__ import annotations

import torch

from ..engine.attention import AttentionBatch
from ..engine.block_pool import slot_mapping
from ..engine.attention_metadata import DecodeRows, PagedAttentionMetadata
from ..engine.paged_attention import PagedAttention, paged_decode_attention
from ..engine.runner import EagerStep


def capture_sizes(max_batch: int) -> list[int]:
    """Batch-size buckets as vLLM picks them: 1, 2, 4, then every 8 up to ``max_batch``."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs(EagerStep):
    """A GPU's step executor (``ModelRunner(executor=...)``): decode-only steps replay a graph, others run eagerly."""

    def __init__(self, model, backend: PagedAttention, max_batch: int, max_model_len: int, capture: bool = True):
        if backend.scratch_slot is None:
            raise ValueError("decode graphs need a scratch block: PagedAttention(..., scratch_block=True)")
        self.model, self.backend, self.capture = model, backend, capture
        self.sizes = capture_sizes(max_batch)
        self.max_batch, self.device = max_batch, backend.device
        bs = backend.block_size
        self.max_blocks = -(-max_model_len // bs)
        # All inputs in one buffer, staged in pinned host memory: one copy to the GPU per step.
        # Rows: token ids, positions, slots to write, context lengths; then the block tables.
        self.host = torch.zeros(max_batch * (4 + self.max_blocks), dtype=torch.long,
                                pin_memory=torch.device(self.device).type == "cuda")
        self.staged = torch.zeros_like(self.host, device=self.device)
        self.host_rows, self.host_tables = self._views(self.host, max_batch)
        (self.ids, self.positions, self.slots, self.context_lens), self.tables = self._views(self.staged, max_batch)
        self.host_rows[2], self.host_rows[3], self.host_tables[:] = backend.scratch_slot, 1, backend.scratch_slot // bs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output buffer
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.decode_fn = backend.decode_attention  # graphs captured with this kernel; another one: run eagerly

    def decode_logits(self, batch) -> torch.Tensor | None:
        return self.run(batch) if self.can_run(batch) else None

    def can_run(self, batch) -> bool:
        return (0 < len(batch.requests) <= self.max_batch
                and all(n == 1 for n in batch.num_new_tokens)
                and self.backend.decode_attention is self.decode_fn and self.backend.mixed_attention is None
                and self.backend.slot_mapping is slot_mapping)  # an attendee's own is checked eagerly

    @torch.inference_mode()
    def run(self, batch) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step (``can_run`` said yes)."""
        b = len(batch.requests)
        size = next(s for s in self.sizes if s >= b)
        self._fill(batch.requests, size)
        if not self.capture:
            return self._forward(size)[:b]
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        return self.logits[size][:b]

    def _views(self, flat: torch.Tensor, n: int):
        return flat[:4 * n].view(4, n), flat[4 * n:].view(n, self.max_blocks)

    def _fill(self, requests, size: int):
        """Write the step's inputs into the pinned staging buffer, then copy it to the GPU at once.
        Rows b..size are padding: token 0 at position 0, writing to and reading the scratch block."""
        bs, b = self.backend.block_size, len(requests)
        pos = [r.num_computed_tokens for r in requests]
        width = max(p // bs for p in pos) + 1
        scratch_block = self.backend.scratch_slot // bs
        tables = [r.block_table[:width] + [scratch_block] * (width - len(r.block_table[:width])) for r in requests]
        rows, host_tables = self.host_rows, self.host_tables
        rows[:, :b] = torch.tensor([[r.all_token_ids[p] for r, p in zip(requests, pos)], pos,
                                    [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)], [p + 1 for p in pos]])
        host_tables[:b, :width] = torch.tensor(tables)
        rows[:2, b:size], rows[2, b:size], rows[3, b:size] = 0, self.backend.scratch_slot, 1
        host_tables[b:size, 0] = scratch_block
        self.staged.copy_(self.host, non_blocking=True)  # the host buffer is rewritten only after this step ends

    def _forward(self, size: int) -> torch.Tensor:
        bs = self.backend.block_size
        lens = self.context_lens[:size]
        padding = None  # the Triton kernel stops at each row's length; only the PyTorch path masks
        if self.decode_fn is paged_decode_attention:
            padding = torch.arange(self.max_blocks * bs, device=self.device)[None, :] >= lens[:, None]
        rows = DecodeRows(token_index=torch.arange(size, device=self.device), block_tables=self.tables[:size],
                          context_lens=lens, padding=padding)
        meta = AttentionBatch([1] * size, [0] * size,  # lengths live in the tensors above, not in Python
                              attn_metadata=PagedAttentionMetadata(slot_mapping=self.slots[:size], decode=rows))
        return self.model.logits(self.model(self.ids[:size], self.positions[:size], self.backend, meta))

    def _capture(self, size: int):
        """Warm up on a side stream (allocator and autotuning settle), then record one forward."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[size] = self._forward(size)
        self.graphs[size] = graph
