"""PagedAttention in PyTorch: K/V live in fixed-size blocks of one pool per layer.

Writing: the new tokens' K/V go to their *slots* (``slot_mapping``), wherever their blocks are.
Reading: each sequence's context is gathered through its block table into a padded batch,
and one masked attention call serves every sequence at once — prefill chunks of different
lengths and single-token decodes alike. (A GPU kernel such as vLLM's reads the blocks in place
instead of gathering them; the gather is the price of staying in plain PyTorch, and the
block-size trade-off in chapter 02 measures it.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import AttentionBackend, AttentionBatch
from .block_pool import slot_mapping


class PagedAttention(AttentionBackend):
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype, device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = device
        self.slot_mapping = slot_mapping  # chapter 02's exercise plugs the attendee's own in here
        slots = num_blocks * block_size
        # one pool per layer, flat over slots: slot s = block * block_size + offset
        self.k_pool = [torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pool = [torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_pool + self.v_pool)

    def prepare(self, requests, num_new_tokens) -> AttentionBatch:
        batch = super().prepare(requests, num_new_tokens)
        bs = self.block_size
        writes = []
        for req, n, ctx in zip(requests, num_new_tokens, batch.context_lens):
            writes += self.slot_mapping(req.block_table, ctx - n, n, bs)  # only the new tokens' slots
        max_q, max_k = max(batch.query_lens), max(batch.context_lens)
        dev = self.device
        # reads: every slot of each whole block table at once, cut to the context (padding: slot 0)
        max_blocks = -(-max_k // bs)
        tables = torch.zeros(len(requests), max_blocks, dtype=torch.long)
        for i, req in enumerate(requests):
            used = -(-batch.context_lens[i] // bs)
            tables[i, :used] = torch.tensor(req.block_table[:used])
        gather = (tables[:, :, None] * bs + torch.arange(bs)).flatten(1)[:, :max_k]
        gather[torch.arange(max_k)[None, :] >= torch.tensor(batch.context_lens)[:, None]] = 0
        q_index = torch.zeros(len(requests), max_q, dtype=torch.long)
        for i, n in enumerate(batch.query_lens):
            q_index[i, :n] = torch.arange(batch.query_offsets[i], batch.query_offsets[i] + n)
        qlen = torch.tensor(batch.query_lens)[:, None, None]
        ctx = torch.tensor(batch.context_lens)[:, None, None]
        i = torch.arange(max_q)[None, :, None]
        j = torch.arange(max_k)[None, None, :]
        q_valid = i < qlen
        # query i of a sequence sits at position ctx - qlen + i; padded query rows see key 0 only
        mask = (j <= ctx - qlen + i) & (j < ctx) & q_valid | (~q_valid & (j == 0))
        batch.extra = {
            "slot_mapping": torch.tensor(writes, dtype=torch.long, device=dev),
            "gather": gather.to(dev),
            "q_index": q_index.to(dev),
            "q_valid": q_valid[:, :, 0].to(dev),
            "mask": mask[:, None].to(dev),
        }
        return batch

    def attend(self, layer, q, k, v, batch):
        x = batch.extra
        k_pool, v_pool = self.k_pool[layer], self.v_pool[layer]
        k_pool[x["slot_mapping"]] = k
        v_pool[x["slot_mapping"]] = v
        keys = k_pool[x["gather"]].transpose(1, 2)    # [B, Hkv, Lk, D]
        values = v_pool[x["gather"]].transpose(1, 2)
        queries = q[x["q_index"]].transpose(1, 2)      # [B, H, Lq, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=x["mask"], enable_gqa=True)
        return out.transpose(1, 2)[x["q_valid"]]      # back to the flat [T, H, D] order
