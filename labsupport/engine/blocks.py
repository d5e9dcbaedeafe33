"""Paged KV memory, the bookkeeping half: which fixed-size block of the pool holds which tokens.

The pool is cut into ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns a
*block table*, the list of its blocks in order, so token ``p`` of the sequence lives in slot
``table[p // block_size] * block_size + p % block_size``. Blocks need not be contiguous, so no
sequence reserves memory for tokens it may never generate: the only waste is the unused tail of
each sequence's last block.

Reference counts let blocks be shared (chapter 03's prefix cache); a block returns to the free
list when its count drops to zero. Freeing a free block is a bug that would hand the same
memory to two sequences, so it raises.
"""
from __future__ import annotations

from collections import deque


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_blocks)

    def allocate(self) -> int:
        if not self.free_blocks:
            raise MemoryError("no free KV blocks")
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def share(self, block: int):
        """Another sequence uses this block too."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free; it cannot be shared")
        self.ref_counts[block] += 1

    def free(self, block: int):
        if self.ref_counts[block] <= 0:
            raise ValueError(f"double free of block {block}")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def slot_mapping(block_table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """Pool slots of tokens ``start .. start + n - 1`` of a sequence with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


class KVCacheManager:
    """Gives each request the blocks its tokens need, and takes them back when it leaves.

    The scheduler (policy) asks ``can_allocate`` before admitting or extending a request; the
    attention backend (mechanism) only reads ``request.block_table``.
    """

    def __init__(self, num_blocks: int, block_size: int, allocator: BlockAllocator | None = None):
        self.block_size = block_size
        self.allocator = allocator or BlockAllocator(num_blocks)
        self.tables: dict[str, object] = {}  # request_id -> request, for snapshots

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def num_new_blocks(self, req, num_new_tokens: int) -> int:
        return max(0, blocks_needed(req.num_computed_tokens + num_new_tokens, self.block_size) - len(req.block_table))

    def can_allocate(self, req, num_new_tokens: int) -> bool:
        return self.allocator.can_allocate(self.num_new_blocks(req, num_new_tokens))

    def allocate(self, req, num_new_tokens: int):
        for _ in range(self.num_new_blocks(req, num_new_tokens)):
            req.block_table.append(self.allocator.allocate())
        self.tables[req.request_id] = req

    def free(self, req):
        for block in reversed(req.block_table):  # tail first: a prefix stays cached longest (ch. 03)
            self.allocator.free(block)
        req.block_table = []
        self.tables.pop(req.request_id, None)

    def snapshot(self) -> dict:
        """The pool as the block-map widget draws it."""
        n, bs = self.num_blocks, self.block_size
        owners, tokens = [[] for _ in range(n)], [0] * n
        for rid, req in self.tables.items():
            for i, block in enumerate(req.block_table):
                owners[block].append(rid)
                tokens[block] = max(tokens[block], min(bs, req.num_tokens - i * bs))
        return {"block_size": bs, "owners": owners, "ref_counts": list(self.allocator.ref_counts), "tokens": tokens}
