"""Mechanism: turn a scheduled batch into one forward pass and one new token per sequence.

The runner knows nothing about queues or policy, and changes no request. It flattens the scheduled tokens of all
sequences into one [T] tensor with their positions (no padding), runs the model once with
the attention backend, and samples from the last position of each sequence.
"""
from __future__ import annotations

import torch

from ..models.llama import LlamaForCausalLM
from .attention import AttentionBackend, AttentionBatch, RecomputeAttention
from .sampler import Sampler
from .scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, device: torch.device):
        self.model, self.backend, self.device = model, backend, device
        self.sampler = Sampler()
        self.graphs = None  # DecodeGraphs on a GPU (cuda_graphs.py): decode-only steps replay a CUDA graph

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> list[int]:
        if self.graphs is not None and self.graphs.backend is self.backend and self.graphs.can_run(batch):
            return self.sampler.sample(self.graphs.run(batch), batch.requests)
        token_ids, positions = [], []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            token_ids += req.all_token_ids[start:start + n]
            positions += range(start, start + n)
        meta = self.backend.prepare(batch.requests, batch.num_new_tokens)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.backend, meta)
        last = torch.tensor(meta.query_offsets[1:], device=self.device) - 1
        logits = self.model.logits(hidden[last])
        return self.sampler.sample(logits, batch.requests)


@torch.inference_mode()
def sequence_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, computed from scratch: [len(token_ids), vocab].

    This is the whole model as chapter 00 sees it: tokens in, one next-token distribution per
    position out, nothing remembered between calls.
    """
    device = next(model.parameters()).device
    n = len(token_ids)
    hidden = model(torch.tensor(token_ids, device=device), torch.arange(n, device=device),
                   RecomputeAttention(), AttentionBatch([n], [n]))
    return model.logits(hidden)
