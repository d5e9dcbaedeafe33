"""Check for chapter 03's exercise on sharing: parallel samples (``n > 1``) sharing a prompt's blocks.

``fork_blocks(allocator, block_table)`` gives a new sample the request's blocks, shared;
``copy_on_write(allocator, block_table, index, new_block, copy_block)`` makes a block the
sequence's own before it writes into it. The mistakes that matter are silent in a small test
and fatal in a server: a fork that does not count its holders (a double free later), a table
shared as one list (one sample's copy rewires the others), a write into a shared block (the
samples overwrite each other's KV: garbage text), a copy in the wrong direction, a copy that never
lets go of the original (a leak), a copy of a block nobody shares (memory thrown away). The
check plays each situation on a small allocator, then runs the real engine: n seeded samples
must equal n independent requests with seeds ``seed + i``, and every block must come back.
"""
from __future__ import annotations

from .base import CheckFailed, passed


class _Recorder:
    """``new_block`` and ``copy_block`` as the engine passes them, recording what the attendee asked."""

    def __init__(self, allocator):
        self.allocator, self.new, self.copies = allocator, [], []

    def new_block(self):
        block = self.allocator.allocate()
        self.new.append(block)
        return block

    def copy_block(self, src, dst):
        self.copies.append((src, dst))


def _check_fork(fork_blocks):
    from ..engine.block_pool import BlockAllocator

    alloc = BlockAllocator(8)
    parent = [alloc.allocate() for _ in range(3)]
    child = fork_blocks(alloc, parent)
    if list(child) != parent:
        raise CheckFailed(f"fork_blocks({parent}) returned {child}: a new sample starts with the very same blocks "
                          "(the prompt's KV is computed once, stored once)")
    if child is parent:
        raise CheckFailed("fork_blocks returned the parent's own list: the sample needs its own block table (a list "
                          "with the same block numbers), since copy-on-write later replaces entries in it")
    if alloc.ref_counts[:3] != [2, 2, 2] or alloc.num_free != 5:
        raise CheckFailed(f"after the fork each block has two holders: ref counts should be [2, 2, 2] with 5 blocks "
                          f"still free, got {alloc.ref_counts[:3]} and {alloc.num_free} free: otherwise the first sample to finish "
                          "frees blocks the others still read")
    return alloc, parent, list(child)


def _check_cow(copy_on_write, alloc, parent, child):
    rec = _Recorder(alloc)
    copy_on_write(alloc, child, 2, rec.new_block, rec.copy_block)
    if len(rec.new) != 1 or child[2] != (rec.new[0] if rec.new else None):
        raise CheckFailed(f"block 2 of the sample's table {parent} is shared (ref count 2) and about to be written: "
                          f"afterwards that entry of the sample's table must be a block only it holds, got table {child} "
                          f"after {len(rec.new)} new blocks. Writing into the shared block would overwrite the other "
                          "sample's KV")
    new = rec.new[0]
    if rec.copies != [(parent[2], new)]:
        raise CheckFailed(f"the new block {new} must start as a copy of the shared block {parent[2]}, got copies "
                          f"{rec.copies} (as (src, dst) pairs): the sample still needs the tokens already in it")
    if alloc.ref_counts[parent[2]] != 1:
        raise CheckFailed(f"after copying, the sample no longer holds block {parent[2]}, so its ref count must drop "
                          f"to 1 (the parent alone), got {alloc.ref_counts[parent[2]]}")
    if parent != [0, 1, 2] or child[:2] != parent[:2]:
        raise CheckFailed(f"copy-on-write changed other entries: parent {parent}, sample {child}")
    rec2 = _Recorder(alloc)
    copy_on_write(alloc, parent, 2, rec2.new_block, rec2.copy_block)
    copy_on_write(alloc, child, 2, rec2.new_block, rec2.copy_block)
    if rec2.new or rec2.copies or parent[2] != 2 or child[2] != new:
        raise CheckFailed("a block the sequence holds alone (ref count 1) is written in place: no new block, no "
                          f"copy (got {len(rec2.new)} new blocks, copies {rec2.copies}). Copying it throws memory away")


def check_copy_on_write(fork_blocks, copy_on_write, llm=None, n=4):
    """The fork and the copy on small allocators; with ``llm`` (a paged engine, max_num_seqs >= n), the
    engine then samples ``n`` answers on them, which must equal ``n`` independent seeded requests."""
    try:
        alloc, parent, child = _check_fork(fork_blocks)
        _check_cow(copy_on_write, alloc, parent, child)
    except CheckFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - the attendee's code: report it
        raise CheckFailed(f"{type(exc).__name__}: {exc}") from exc
    passed("fork_blocks shares every block into the sample's own table; copy_on_write copies a shared block "
           "before the write, lets go of the original, and writes a block held alone in place")
    if llm is None:
        return
    from ..engine.request import SamplingParams

    prompt = [{"role": "user", "content": "Name a colour and say why you like it."}]
    params = SamplingParams(n=n, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    before = llm.stats()["cow_copies"]
    try:
        with llm.plugged(fork_blocks=fork_blocks, copy_on_write=copy_on_write):
            forked = llm.generate(prompt, params, use_tqdm=False)[0].outputs
    except Exception as exc:  # noqa: BLE001
        raise CheckFailed(f"the engine failed on your pieces: {type(exc).__name__}: {exc}") from exc
    stats = llm.stats()
    alone = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0] for i in range(n)]
    for i, (a, b) in enumerate(zip(forked, alone)):
        if a.token_ids != b.token_ids:
            raise CheckFailed(f"sample {i} differs from a request alone with seed {1234 + i}: {a.text!r} vs {b.text!r}. "
                              "The samples wrote into each other's blocks, or a copy went the wrong way")
    if stats["kv_blocks_free"] != stats["kv_blocks_total"]:
        raise CheckFailed(f"after the samples finished {stats['kv_blocks_total'] - stats['kv_blocks_free']} blocks "
                          "are still held: a leak")
    passed(f"the engine sampled {n} answers from one prompt on your pieces ({stats['cow_copies'] - before} blocks "
           f"copied on write): each equals a request alone with its seed, and every block came back")
