"""Block keeping for the mystery engine of chapter 03 (``mystery.py``), written afresh; see that file."""
from __future__ import annotations


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


def release_1(allocator, block_table):
    for i in range(len(block_table) - 1, -1, -1):
        allocator.free(block_table[i])


def release_2(allocator, block_table):
    for i in range(len(block_table)):
        allocator.free(block_table[i])


def release_3(allocator, block_table):
    for i in range(len(block_table) - 1, 0, -1):
        allocator.free(block_table[i])


def write_1(allocator, block_table, index, new_block, copy_block):
    block = block_table[index]
    if allocator.ref_counts[block] < 2:
        return
    copy = new_block()
    copy_block(block, copy)
    allocator.free(block)
    block_table[index] = copy


def write_2(allocator, block_table, index, new_block, copy_block):
    block = block_table[index]
    if allocator.ref_counts[block] <= 2:
        return
    copy = new_block()
    copy_block(block, copy)
    allocator.free(block)
    block_table[index] = copy
