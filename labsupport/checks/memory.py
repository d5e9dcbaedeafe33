"""Checks for chapters 02-03: paged KV blocks and the prefix cache."""
from __future__ import annotations

from .base import CheckFailed, first_difference, passed


# ---------------------------------------------------------------- chapter 02: PagedAttention

def check_slot_mapping(slot_mapping):
    """``slot_mapping(block_table, start, n, block_size)`` -> pool slot of each of the n tokens."""
    from ..engine.block_pool import slot_mapping as reference

    cases = [([0], 0, 3, 4), ([5, 2], 0, 8, 4), ([5, 2, 9], 3, 6, 4), ([7, 1], 15, 1, 16), ([3, 8, 4], 31, 2, 16),
             ([2, 6], 4, 1, 4)]
    for table, start, n, bs in cases:
        got, want = slot_mapping(list(table), start, n, bs), reference(table, start, n, bs)
        if list(got) != want:
            raise CheckFailed(f"slot_mapping({table}, start={start}, n={n}, block_size={bs}): "
                              f"{first_difference(list(got), want)} (a sequence's tokens fill its blocks in the order of "
                              f"its block table, block_size to a block)")
    passed(f"slot_mapping is right in {len(cases)} cases, block boundaries included")


def check_block_allocator(allocator_cls):
    """An allocator with ``allocate() -> block`` and ``free(block)``, ref counts, and errors on misuse."""
    alloc = allocator_cls(4)
    got = [alloc.allocate() for _ in range(4)]
    if sorted(got) != [0, 1, 2, 3]:
        raise CheckFailed(f"allocating all 4 blocks gave {got}: each block must be handed out exactly once")
    if alloc.num_free != 0:
        raise CheckFailed(f"after allocating every block num_free should be 0, not {alloc.num_free}")
    try:
        alloc.allocate()
    except MemoryError:
        pass
    else:
        raise CheckFailed("allocate() on an empty pool must raise MemoryError (never hand out a used block)")
    alloc.free(got[2])
    if alloc.num_free != 1 or alloc.allocate() != got[2]:
        raise CheckFailed("a freed block must go back to the free list and be allocatable again")
    alloc.share(got[0])
    alloc.free(got[0])
    if alloc.num_free != 0:
        raise CheckFailed("a shared block (ref count 2) freed once is still in use: it must not be free yet")
    alloc.free(got[0])
    if alloc.num_free != 1:
        raise CheckFailed("freeing the last reference must return the block (leak)")
    try:
        alloc.free(got[0])
    except ValueError:
        pass
    else:
        raise CheckFailed("freeing a free block must raise ValueError: a double free would let two "
                          "sequences write the same memory")
    for b in (got[1], got[2], got[3]):
        alloc.free(b)
    if alloc.num_free != 4 or any(alloc.ref_counts):
        raise CheckFailed(f"after freeing everything, all 4 blocks must be free with ref count 0 "
                          f"(num_free={alloc.num_free}, ref_counts={list(alloc.ref_counts)})")
    passed("the allocator hands out each block once, counts references, and refuses exhaustion and double frees")


# ---------------------------------------------------------------- chapter 03: prefix cache

def check_chain_hashes(chain_hashes):
    """``chain_hashes(token_ids, block_size, salt) -> list of bytes``: one chained hash per full block."""
    from ..engine.prefix_cache import chain_hashes as reference

    tokens = list(range(100, 150))
    cases = [(tokens, 16, None), (tokens, 16, "tenant-a"), (tokens[:32], 16, None), (tokens[:15], 16, None),
             (tokens, 4, "t")]
    for toks, bs, salt in cases:
        got, want = chain_hashes(list(toks), bs, salt), reference(toks, bs, salt)
        if len(got) != len(want):
            raise CheckFailed(f"{len(toks)} tokens in blocks of {bs}: expected {len(want)} hashes (full blocks only: "
                              f"a partial block is still being written), got {len(got)}")
        if got != want:
            raise CheckFailed(f"{len(toks)} tokens, block_size={bs}, salt={salt!r}: hash of block "
                              f"{next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)} differs. "
                              "A block's hash must stand for every token up to the end of the block, and the salt")
    # the properties the chain exists for, stated on their own
    a = chain_hashes([1] * 8 + [2] * 8, 8, None)
    b = chain_hashes([3] * 8 + [2] * 8, 8, None)
    if a[1] == b[1]:
        raise CheckFailed("the same block after different prefixes got the same hash: chain in the parent's hash")
    if chain_hashes([1] * 8, 8, "x") == chain_hashes([1] * 8, 8, "y"):
        raise CheckFailed("different cache_salt values gave the same hash: tenants would share KV")
    passed("chain_hashes hashes full blocks only, chained on the parent and the salt")


def check_longest_prefix(longest_prefix):
    """``longest_prefix(hashes, lookup) -> blocks`` of the leading hashes that ``lookup(i, h)`` finds."""
    table = {b"h0": 7, b"h1": 3, b"h3": 9}
    cases = [([b"h0", b"h1", b"h2", b"h3"], [7, 3]), ([b"h2", b"h0"], []), ([b"h0"], [7]), ([], []),
             ([b"h0", b"h1", b"h3"], [7, 3, 9])]
    for hashes, want in cases:
        got = list(longest_prefix(list(hashes), lambda i, h: table.get(h)))
        if got != want:
            raise CheckFailed(f"hashes {[h.decode() for h in hashes]} with cached {sorted(k.decode() for k in table)}: "
                              f"expected blocks {want}, got {got}. Stop at the first miss: a block's KV is only "
                              "valid after exactly the blocks before it")
    passed("longest_prefix returns the cached blocks of the leading hashes and stops at the first miss")
