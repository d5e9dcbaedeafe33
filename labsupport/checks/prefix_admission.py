"""Checks for chapter 03's hard exercise (admitting a prefix hit) and the leak detector of its planted-bug hunt.

Admitting a request whose prefix is cached is where a paged pool with a prefix cache gets
subtle: a hit block may be *live* (another request holds it: share it, free of charge) or *free
but cached* (nobody holds it, its KV is still there: take that very block back off the free
list, which costs a free block). Counting wrongly admits a request that runs out of blocks in the
middle of a step, or refuses one that fits; taking another block hands the request garbage KV;
freeing head first evicts the shared prefix before the request's own tail. Each check below
names the mistake it sees, then runs the real engine on the attendee's pieces.

The leak detector finds leaked blocks from the block map's snapshot alone (held, yet no request owns
them), as an engineer would on a dashboard whose free-block count only goes down. The planted bug
itself, drawn at random from five, is ``mystery.py``'s.
"""
from __future__ import annotations

import contextlib

from .base import CheckFailed, passed


def _allocator(n=8):
    from ..engine.block_pool import BlockAllocator

    return BlockAllocator(n)


def _check_cost(free_blocks_needed):
    cases = [  # (ref counts, hit blocks, blocks the request will hold, expected, the mistake if wrong)
        ([1, 1, 1, 0, 0, 0, 0, 0], [0, 1], 3, 1, "the 2 hit blocks are live (ref count 1: another request holds "
         "them) and the third block is new"),
        ([0] * 8, [0, 1], 3, 3, "the 2 hit blocks are free but cached (ref count 0, still on the "
         "free list); too few admits a request that runs out of blocks mid-step"),
        ([2, 0, 0, 0, 0, 0, 0, 0], [0, 1], 4, 3, "block 0 is live (ref count 2), block 1 is free but cached "
         "(ref count 0), two blocks are new"),
        ([1, 1, 0, 0, 0, 0, 0, 0], [], 5, 5, "no hit: every block is new"),
        ([1, 0, 0, 0, 0, 0, 0, 0], [0], 1, 0, "a request whose only block is a live hit needs no free block"),
    ]
    for refs, hit, n, want, why in cases:
        got = free_blocks_needed(list(refs), list(hit), n)
        if got != want:
            raise CheckFailed(f"free_blocks_needed(ref_counts={refs}, hit_blocks={hit}, num_blocks={n}) returned "
                              f"{got}, expected {want} ({why}): it must be exactly the number of blocks the free "
                              f"list loses when the request is admitted")


def _check_hold(hold_prefix_blocks):
    alloc = _allocator()
    a = [alloc.allocate() for _ in range(3)]  # request A holds blocks 0, 1, 2
    hold_prefix_blocks(alloc, a[:2])
    if alloc.ref_counts[:3] != [2, 2, 1] or alloc.num_free != 5:
        raise CheckFailed(f"A holds blocks {a}; after B holds the live hit {a[:2]} too, each of those blocks has "
                          f"two holders and nothing left the free list (ref counts [2, 2, 1], 5 blocks still free): "
                          f"got ref counts {alloc.ref_counts[:3]} and {alloc.num_free} free")
    for block in [2, 1, 0, 1, 0]:
        alloc.free(block)  # A and B leave: all free again, blocks 0 and 1 still hold their KV
    hold_prefix_blocks(alloc, [0, 1])
    if alloc.ref_counts[:2] != [1, 1] or 0 in alloc.free_blocks or 1 in alloc.free_blocks:
        raise CheckFailed(f"blocks 0 and 1 are free but cached; after holding them the request holds exactly those "
                          f"blocks (they hold its KV: any other block's contents are garbage for it), each with ref "
                          f"count 1 and off the free list: got ref counts {alloc.ref_counts[:2]}, free list "
                          f"{list(alloc.free_blocks)}")
    if alloc.num_free != 6 or any(alloc.ref_counts[2:]):
        raise CheckFailed(f"holding 2 cached blocks should leave 6 of 8 free and touch no other block: "
                          f"{alloc.num_free} free, ref counts {alloc.ref_counts}")


def _check_release(release_blocks):
    alloc = _allocator()
    for _ in range(8):
        alloc.allocate()
    for block in (0, 1, 2, 3, 4, 6):
        alloc.free(block)  # blocks 5 and 7 stay held; the free list is 0 1 2 3 4 6, then the request's
    alloc.share(5)
    table = [7, 5]
    release_blocks(alloc, table)
    if alloc.ref_counts[5] != 1 or 5 in alloc.free_blocks:
        raise CheckFailed("block 5 was shared (ref count 2): releasing one request must leave it held by the other "
                          f"(ref count 1, not free); got ref count {alloc.ref_counts[5]}")
    if alloc.ref_counts[7] != 0 or 7 not in alloc.free_blocks:
        raise CheckFailed("block 7 was held by this request only: after release it must be free")
    alloc = _allocator()
    for _ in range(8):
        alloc.allocate()
    # A block table as a busy pool hands it out: scattered, neither ascending nor descending, so freeing
    # by block id (either way) is not mistaken for freeing by position in the table.
    table = [5, 2, 7, 0]  # the prefix first, the tail last
    for block in (1, 3, 4, 6):
        alloc.free(block)
    release_blocks(alloc, list(table))
    order = list(alloc.free_blocks)[-4:]
    if sorted(order) != sorted(table):
        raise CheckFailed(f"releasing {table} must free every block once: the free list ends {order}")
    if order != table[::-1]:
        raise CheckFailed(f"releasing block table {table} freed them in the order {order}. allocate() takes the "
                          "least recently freed block, so this order leaves the blocks other requests can reuse (the "
                          "start of the table, which every request with the same prompt shares) to be overwritten "
                          "before the ones only this request had")


def admission_scenario(llm, **pieces):
    """Requests sharing a prefix on a fresh 20-block pool: two at once (live sharing), one after (a
    reclaim), then a filler that forces evictions, then the prefix again (what survived). ``pieces``: plug
    points to run it on. Returns (tokens per phase, prefix-cache hits per phase, (blocks held, any ref
    count left) after the run)."""
    from ..engine.block_pool import BlockAllocator
    from ..engine.request import SamplingParams

    bs = llm.engine.kv.block_size
    prefix = list(range(2000, 2000 + 4 * bs))
    ask = [prefix + list(range(3000 + 10 * i, 3000 + 10 * i + bs // 2)) for i in range(4)]
    filler = list(range(5000, 5000 + 16 * bs + bs // 2))  # 17 blocks with its answer: evicts 4 cached ones
    params = SamplingParams(max_tokens=bs // 2, temperature=0, ignore_eos=True)
    tokens, hits = [], []
    with llm.plugged(block_allocator=BlockAllocator(20), **pieces):
        for batch in ([ask[0], ask[1]], [ask[2]], [filler], [ask[3]]):
            before = llm.stats()["prefix_cache_hits"]
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            tokens.append([o.token_ids for o in outs])
            hits.append(llm.stats()["prefix_cache_hits"] - before)
        stats = llm.stats()
        leftover = (stats["kv_blocks_total"] - stats["kv_blocks_free"], any(llm.engine.kv.allocator.ref_counts))
    return tokens, hits, leftover


def check_prefix_admission(free_blocks_needed, hold_prefix_blocks, release_blocks, llm=None):
    """The three pieces of admitting a prefix hit, alone and then (with ``llm``, a prefix-caching paged
    engine) plugged into the engine, which must produce the same tokens and hits as with its own."""
    for name, fn, check in (("free_blocks_needed", free_blocks_needed, _check_cost),
                            ("hold_prefix_blocks", hold_prefix_blocks, _check_hold),
                            ("release_blocks", release_blocks, _check_release)):
        try:
            check(fn)
        except CheckFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - the attendee's code: report it
            raise CheckFailed(f"{name} raised {type(exc).__name__}: {exc}") from exc
    passed("free_blocks_needed counts live hits as free of charge and cached ones as a block each; "
           "hold_prefix_blocks shares or reclaims; release_blocks frees tail first")
    if llm is None:
        return
    if llm.engine.kv.prefix_cache is None:
        raise ValueError("check_prefix_admission needs an engine with enable_prefix_caching=True")
    own = admission_scenario(llm)
    try:
        yours = admission_scenario(llm, free_blocks_needed=free_blocks_needed, hold_prefix_blocks=hold_prefix_blocks,
                                   release_blocks=release_blocks)
    except CheckFailed:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckFailed(f"the engine failed on your pieces: {type(exc).__name__}: {exc}") from exc
    names = ["two requests at once", "a third after them", "a filler", "the prefix after the filler"]
    for name, a, b in zip(names, yours[0], own[0]):
        if a != b:
            raise CheckFailed(f"{name}: the engine generated other tokens on your pieces ({a} vs {b}): a request "
                              "read KV that is not its prefix's")
    if yours[1] != own[1]:
        raise CheckFailed(f"prefix-cache hits (tokens) per phase were {yours[1]} on your pieces, {own[1]} on the "
                          f"engine's ({', '.join(names)}): under eviction, other blocks were overwritten than the engine's")
    if yours[2] != (0, False):
        raise CheckFailed(f"after the run {yours[2][0]} blocks are still held: a block leaked")
    passed(f"the engine ran 5 requests on a 20-block pool on your pieces: same tokens, same hits per phase "
           f"{own[1]}, every block free at the end")


# ---------------------------------------------------------------- the leak detector

def _snap(refs, owners):
    return {"ref_counts": refs, "owners": owners, "block_size": 4, "tokens": [0] * len(refs),
            "cached": [False] * len(refs)}


def check_leak_finder(find_leaked_blocks, llm=None):
    """``find_leaked_blocks(snapshot) -> sorted block ids`` held by more requests than own them (a
    ``KVCacheManager.snapshot()``). With ``llm`` (a prefix-caching paged engine), also on the snapshot of an engine
    that leaks (``mystery.py``'s leak, every request finished)."""
    cases = [(_snap([0, 1, 1, 0], [[], ["A"], ["A"], []]), [], "a healthy pool: every held block has its owner"),
             (_snap([1, 0, 2, 0], [[], [], ["A", "B"], []]), [0], "block 0 is held (ref count 1) but no request "
              "owns it"),
             (_snap([2, 1, 0, 1], [["A"], ["A"], [], []]), [0, 3], "block 0 has ref count 2 but one owner (a share "
              "never given back), block 3 has ref count 1 and none"),
             (_snap([0, 0, 0], [[], [], []]), [], "an empty pool")]
    for snap, want, why in cases:
        got = sorted(find_leaked_blocks(snap))
        if got != want:
            raise CheckFailed(f"ref_counts {snap['ref_counts']}, owners {snap['owners']}: expected {want}, got {got} "
                              f"({why})")
    passed("find_leaked_blocks finds held blocks nobody owns, and shares nobody gave back, in 4 pools")
    if llm is None:
        return
    from .mystery import planted_pieces, workload

    for phase in workload(llm, **planted_pieces("leak")):
        held = [b for b, refs in enumerate(phase.snapshot["ref_counts"]) if refs > 0]  # every request has finished
        found = sorted(find_leaked_blocks(phase.snapshot))
        if found != held:
            raise CheckFailed(f"on an engine that leaks, after phase '{phase.name}' (every request finished) you "
                              f"found {found}; the blocks still held are {held}")
    passed(f"on an engine that leaks your finder named the held blocks after each phase ({len(held)} at the end)")
