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

Only decode-only steps replay; a step with any prefill rows runs eagerly. Every bucket up to
``max_num_seqs`` is captured **when the engine is built** (``capture_all``), as vLLM does at start-up, for
two reasons. A capture inside a step would land in whatever that step is timing (two warm-up forwards and
the recording: a chapter's first batch of each size would look slow). And a capture beside another thread
that touches the GPU is fragile: chapter 07's KV-receive thread writes into the pool (``unpack_blocks``:
pageable copies, ``torch.tensor(..., device=cuda)``, allocations) while the engine steps. At build no such
thread exists yet. Raising ``max_num_seqs`` on a live engine (chapter 04's dial) re-sizes the buffers and
re-captures every bucket (``resize``), when the option changes (``LLMEngine.set_options`` tells the
executor), or at the latest before the first step that needs a larger bucket: graphs are never silently
dropped for eager steps. Such a re-capture may run beside a KV thread, so captures use
``capture_error_mode="thread_local"``: CUDA calls of *other* threads stay legal while this thread records
(the default, "global", makes them errors and invalidates the capture). The capture itself runs on
PyTorch's own non-blocking capture stream, so work another thread queues on the default stream is not
pulled into the graph. ``capture=False`` runs the same static-buffer forward eagerly: the CPU tests check
that way that the buffers are filled right.
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
    """A GPU's step executor (``ModelRunner(executor=...)``): decode-only steps replay a graph, others run eagerly.

    ``config``: the engine's live ``EngineConfig``; its ``max_num_seqs`` may be raised while the engine lives,
    and the graphs follow it (``follow``)."""

    def __init__(self, model, backend: PagedAttention, max_batch: int, max_model_len: int, capture: bool = True,
                 config=None):
        if backend.scratch_slot is None:
            raise ValueError("decode graphs need a scratch block: PagedAttention(..., scratch_block=True)")
        self.model, self.backend, self.capture, self.config = model, backend, capture, config
        self.device = backend.device
        self.max_blocks = -(-max_model_len // backend.block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output buffer
        self.captured: list[int] = []  # bucket sizes in the order they were recorded (read by tests and probes)
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for every bucket
        self.decode_fn = backend.decode_attention  # graphs captured with this kernel; another one: run eagerly
        self._allocate(max_batch)

    def _allocate(self, max_batch: int):
        """Static buffers for batches up to ``max_batch``. A graph reads its buffers' addresses, so graphs
        recorded on older buffers are dropped here (``resize`` records them again)."""
        bs = self.backend.block_size
        self.sizes, self.max_batch = capture_sizes(max_batch), max_batch
        # All inputs in one buffer, staged in pinned host memory: one copy to the GPU per step.
        # Rows: token ids, positions, slots to write, context lengths; then the block tables.
        self.host = torch.zeros(max_batch * (4 + self.max_blocks), dtype=torch.long,
                                pin_memory=torch.device(self.device).type == "cuda")
        self.staged = torch.zeros_like(self.host, device=self.device)
        self.host_rows, self.host_tables = self._views(self.host, max_batch)
        (self.ids, self.positions, self.slots, self.context_lens), self.tables = self._views(self.staged, max_batch)
        self.host_rows[2], self.host_rows[3], self.host_tables[:] = self.backend.scratch_slot, 1, \
            self.backend.scratch_slot // bs
        self.graphs.clear()
        self.logits.clear()

    def capture_all(self):
        """Record every bucket not recorded yet, on padding rows that write only the scratch block (so a live
        pool is never touched). Without ``capture`` (CPU tests) there is nothing to record."""
        if not self.capture:
            return
        for size in self.sizes:
            if size not in self.graphs:
                self._fill([], size)
                self._capture(size)

    def resize(self, max_batch: int) -> bool:
        """Serve batches up to ``max_batch``: larger buffers, every bucket recorded again. A lower bound keeps
        what is there (a bucket larger than the batch is only padding). True if anything changed."""
        if max_batch <= self.max_batch:
            return False
        self._allocate(max_batch)
        self.capture_all()
        return True

    def follow(self, config=None) -> bool:
        """Catch up with the engine's ``max_num_seqs`` (``LLMEngine.set_options`` calls this when it changes)."""
        config = config or self.config
        return config is not None and self.resize(config.max_num_seqs)

    def decode_logits(self, batch) -> torch.Tensor | None:
        if len(batch.requests) > self.max_batch:
            self.follow()  # the option was raised without telling us: record now rather than decode eagerly
        return self.run(batch) if self.can_run(batch) else None

    def can_run(self, batch) -> bool:
        return (0 < len(batch.requests) <= self.max_batch
                and all(n == 1 for n in batch.num_new_tokens)
                and self.backend.decode_attention is self.decode_fn and self.backend.mixed_attention is None
                and self.backend.slot_mapping is slot_mapping  # an attendee's own is checked eagerly
                and not layer_hooks(self.backend.connector))

    @torch.inference_mode()
    def run(self, batch) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step (``can_run`` said yes)."""
        b = len(batch.requests)
        size = next(s for s in self.sizes if s >= b)
        self._fill(batch.requests, size)
        if not self.capture:
            return self._forward(size)[:b]
        if size not in self.graphs:  # an executor made without capture_all (gpu_decode's timing)
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
        width = max((p // bs for p in pos), default=0) + 1
        scratch_block = self.backend.scratch_slot // bs
        tables = [r.block_table[:width] + [scratch_block] * (width - len(r.block_table[:width])) for r in requests]
        rows, host_tables = self.host_rows, self.host_tables
        if b:
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
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):  # see the docstring
            self.logits[size] = self._forward(size)
        self.graphs[size] = graph
        self.captured.append(size)


def layer_hooks(connector) -> bool:
    """True if ``connector`` runs Python in the forward pass (``wait_for_layer_load``, ``save_kv_layer``): a graph
    would replay what those did when it was recorded, not what they do now, so such steps run eagerly. The
    course's TCP connector pulls whole requests between steps and keeps the base class's empty hooks."""
    if connector is None:
        return False
    from ..engine.kv_connector import KVConnectorBase
    return any(getattr(type(connector), name) is not getattr(KVConnectorBase, name)
               for name in ("wait_for_layer_load", "save_kv_layer"))
