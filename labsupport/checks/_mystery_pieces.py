"""Block keeping for the mystery engine of chapter 03 (``mystery.py``), written afresh; see that file."""
from __future__ import annotations


def cost_1(ref_counts, hit_blocks, num_blocks):
    held = 0
    for block in hit_blocks:
        if ref_counts[block] >= 0:
            held += 1
    return num_blocks - held


def cost_2(ref_counts, hit_blocks, num_blocks):
    held = 0
    for block in hit_blocks:
        if ref_counts[block] > 0:
            held += 1
    return num_blocks - held


def hold_1(allocator, hit_blocks):
    for block in hit_blocks:
        if not allocator.ref_counts[block]:
            allocator.reclaim(block)


def hold_2(allocator, hit_blocks):
    for block in hit_blocks:
        if allocator.ref_counts[block]:
            allocator.share(block)
        else:
            allocator.reclaim(block)


def hold_3(allocator, hit_blocks):
    for block in hit_blocks:
        if allocator.ref_counts[block]:
            allocator.share(block)
        else:
            allocator.allocate()


def release_1(allocator, block_table):
    for i in range(len(block_table) - 1, -1, -1):
        allocator.free(block_table[i])


def release_2(allocator, block_table):
    for i in range(len(block_table)):
        allocator.free(block_table[i])


def release_3(allocator, block_table):
    for i in range(len(block_table) - 1, 0, -1):
        allocator.free(block_table[i])
