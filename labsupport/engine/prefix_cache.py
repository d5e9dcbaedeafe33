"""Prefix caching: find the KV blocks another request already computed for the same tokens.

Every *full* block gets a content hash chained with its parent's: ``hash(parent, salt, tokens)``.
Chaining makes a block's hash stand for the whole prefix up to and including it, so two
requests that share the first 1,000 tokens share the first 62 blocks' hashes and nothing after
the first difference. Only full blocks are cached: a partial block's contents are still
changing (the next token is written into it), so its hash would be stale at once.

The hash decides where to look; the stored token ids decide whether it is a hit, so even a hash
collision can never hand a request someone else's KV. The salt (``cache_salt``, per tenant) is
part of every hash: tenants never share blocks, which closes a timing side channel (a fast
first token would otherwise reveal that another tenant sent the same prompt).

``CPUTier`` keeps blocks evicted from the device pool in host memory (pinned on CUDA), so a later
hit copies them back instead of recomputing them.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch


def hash_block(parent: bytes | None, token_ids, salt: str | None = None) -> bytes:
    h = hashlib.sha256(parent or b"")
    h.update(repr((salt, tuple(token_ids))).encode())
    return h.digest()


def chain_hashes(token_ids, block_size: int, salt: str | None = None) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids``, each chained with the one before it."""
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes


def longest_prefix(hashes: list[bytes], lookup) -> list:
    """Blocks of the longest run of leading hashes that ``lookup(i, h)`` finds; stop at the first miss,
    because block i's KV is only valid after exactly the tokens of blocks 0..i-1."""
    found = []
    for i, h in enumerate(hashes):
        block = lookup(i, h)
        if block is None:
            break
        found.append(block)
    return found


class PrefixCache:
    """Index of device blocks by content hash; which blocks hold which full-block contents."""

    def __init__(self):
        self.block_of: dict[bytes, int] = {}
        self.entry_of: dict[int, tuple[bytes, tuple]] = {}  # block -> (hash, token ids)

    def lookup(self, h: bytes, tokens: tuple) -> int | None:
        block = self.block_of.get(h)
        if block is None or self.entry_of[block][1] != tokens:  # compare tokens: collisions can't lie
            return None
        return block

    def insert(self, block: int, h: bytes, tokens: tuple) -> bool:
        """Index the block's contents; False if the hash is indexed already (then nothing changes)."""
        if h in self.block_of:  # two requests may compute the same block at once: keep the first
            return False
        self.block_of[h] = block
        self.entry_of[block] = (h, tokens)
        return True

    def evict(self, block: int) -> tuple[bytes, tuple] | None:
        """The block is about to hold new contents: forget what it held (returned for the CPU tier)."""
        entry = self.entry_of.pop(block, None)
        if entry is not None:
            del self.block_of[entry[0]]
        return entry

    def is_cached(self, block: int) -> bool:
        return block in self.entry_of


class CPUTier:
    """Host-memory copies of evicted blocks, LRU. Mechanism only: copy a block out, copy it back."""

    def __init__(self, num_blocks: int, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        # pools are [Hkv, slots, D]: block b of a layer is device_k[layer][:, b], [Hkv, bs, D]
        self.device_k = [p.view(p.shape[0], -1, block_size, p.shape[2]) for p in k_pool]
        self.device_v = [p.view(p.shape[0], -1, block_size, p.shape[2]) for p in v_pool]
        pin = k_pool[0].device.type == "cuda"
        hkv, _, _, d = self.device_k[0].shape
        shape = (num_blocks, hkv, block_size, d)
        self.host_k = [torch.zeros(shape, dtype=p.dtype, pin_memory=pin) for p in k_pool]
        self.host_v = [torch.zeros(shape, dtype=p.dtype, pin_memory=pin) for p in v_pool]
        self.slot_of: OrderedDict[bytes, tuple[int, tuple]] = OrderedDict()  # hash -> (host slot, tokens)
        self.free_slots = list(range(num_blocks))
        self.events = None  # KV-cache events (serve --kv-events-config): what this tier stores and drops

    def __len__(self):
        return len(self.slot_of)

    def save(self, h: bytes, tokens: tuple, device_block: int):
        if h in self.slot_of:
            self.slot_of.move_to_end(h)
            return
        if not self.free_slots:
            dropped, (slot, _) = self.slot_of.popitem(last=False)  # the least recently used copy goes
            self.free_slots.append(slot)
            if self.events is not None:
                self.events.removed([dropped], "CPU")
        slot = self.free_slots.pop()
        for layer in range(len(self.host_k)):
            self.host_k[layer][slot].copy_(self.device_k[layer][:, device_block], non_blocking=True)
            self.host_v[layer][slot].copy_(self.device_v[layer][:, device_block], non_blocking=True)
        self.slot_of[h] = (slot, tokens)
        if self.events is not None:
            self.events.stored([h], list(tokens), "CPU")

    def clear(self):
        """Drop every copy (``KVCacheManager.reset_prefix_cache``)."""
        if self.events is not None and self.slot_of:
            self.events.removed(list(self.slot_of), "CPU")
        self.slot_of.clear()
        self.free_slots = list(range(self.num_blocks))

    def contains(self, h: bytes, tokens: tuple) -> bool:
        entry = self.slot_of.get(h)
        return entry is not None and entry[1] == tokens

    def has(self, h: bytes) -> bool:
        return h in self.slot_of

    def touch(self, h: bytes):
        self.slot_of.move_to_end(h)

    def load(self, h: bytes, device_block: int):
        slot, _ = self.slot_of[h]
        self.slot_of.move_to_end(h)
        for layer in range(len(self.host_k)):
            self.device_k[layer][:, device_block].copy_(self.host_k[layer][slot], non_blocking=True)
            self.device_v[layer][:, device_block].copy_(self.host_v[layer][slot], non_blocking=True)
