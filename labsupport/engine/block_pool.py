"""Paged KV memory, the bookkeeping half: which fixed-size block of the pool holds which tokens.

The pool is cut into ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns a
*block table*, the list of its blocks in order, so token ``p`` of the sequence lives in slot
``table[p // block_size] * block_size + p % block_size``. Blocks need not be contiguous, so no
sequence reserves memory for tokens it may never generate: the only waste is the unused tail of
each sequence's last block.

Reference counts let blocks be shared (chapter 03's prefix cache); a block returns to the free
list when its count drops to zero. Freeing a free block is a bug that would hand the same
memory to two sequences, so it raises. The free list is kept in the order blocks were freed:
``allocate`` takes the least recently freed, so a freed block that still holds cached KV
(chapter 03) survives as long as possible and ``reclaim`` can pull it back out on a cache hit.
"""
from __future__ import annotations

from collections import OrderedDict


class BlockAllocator:
    """Free list and reference counts of one pool of blocks (chapter 02's exercise writes one)."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> int:
        """A free block for one sequence (ref count 1); the least recently freed goes first."""
        if not self.free_blocks:
            raise MemoryError("no free KV blocks")
        block, _ = self.free_blocks.popitem(last=False)
        self.ref_counts[block] = 1
        return block

    def reclaim(self, block: int):
        """Take this particular free block back: it still holds KV a new request can reuse."""
        del self.free_blocks[block]
        self.ref_counts[block] = 1

    def share(self, block: int):
        """Another sequence uses this block too."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free; it cannot be shared")
        self.ref_counts[block] += 1

    def free(self, block: int):
        """One sequence stops using the block; it is free again when nobody does."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"double free of block {block}")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None


def free_blocks_needed(ref_counts: list[int], hit_blocks: list[int], num_blocks: int) -> int:
    """Blocks the free list must give so a request holds ``num_blocks`` blocks, ``hit_blocks`` of them
    found by the prefix cache. A live hit block (another request holds it) is shared: it costs
    nothing. A cached hit block that is free costs one, as a fresh block does: it comes off the free
    list. Counting it as free twice admits a request that then runs out of blocks mid-step."""
    return num_blocks - sum(1 for block in hit_blocks if ref_counts[block] > 0)


def hold_prefix_blocks(allocator: BlockAllocator, hit_blocks: list[int]):
    """A new request takes the blocks of its prefix hit: it shares the live ones and takes the free
    cached ones back off the free list (that very block: it holds the KV; any other holds garbage)."""
    for block in hit_blocks:
        if allocator.ref_counts[block] > 0:
            allocator.share(block)
        else:
            allocator.reclaim(block)


def release_blocks(allocator: BlockAllocator, block_table: list[int]):
    """A request leaves: free its blocks tail first. The free list hands out the least recently freed
    block first, so the prefix, freed last and shared by the most requests, stays cached longest."""
    for block in reversed(block_table):
        allocator.free(block)


def fork_blocks(allocator: BlockAllocator, block_table: list[int]) -> list[int]:
    """A new sample of a request (``n > 1``) starts with the request's blocks: the same blocks, one more
    holder each, no copy. The prompt's KV is computed once and stored once."""
    for block in block_table:
        allocator.share(block)
    return list(block_table)


def copy_on_write(allocator: BlockAllocator, block_table: list[int], index: int, new_block, copy_block):
    """Make ``block_table[index]`` this sequence's own before it writes into it. A block other
    sequences hold too (ref count > 1) is copied to a new block (``new_block()``, then
    ``copy_block(src, dst)``) and let go; a block it holds alone is written in place."""
    block = block_table[index]
    if allocator.ref_counts[block] > 1:
        copy = new_block()
        copy_block(block, copy)
        allocator.free(block)
        block_table[index] = copy


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def slot_mapping(block_table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """Pool slots of tokens ``start .. start + n - 1`` of a sequence with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
